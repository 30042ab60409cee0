"""``python -m kvtrio`` is the ``kvtrio`` command."""

from .cli import main

if __name__ == "__main__":
    main()
