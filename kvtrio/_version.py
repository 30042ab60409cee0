"""The version of kvtrio (single source for packaging and the wire ``hello``)."""

__version__ = "0.1.0"
