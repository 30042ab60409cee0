"""The module-length report: modules of ``kvtrio/`` longer than the house size, shown in the
terminal summary of a test run that includes ``tests/test_layers.py`` and never failing it.

A module is split by concern, not by length (a split made only to pass a line count leaves two
modules that reach into each other), so a long module is something to look at, not an error.
A warning would not do: ``pyproject.toml`` turns every warning into an error.
"""

from __future__ import annotations

from pathlib import Path

import pytest

__all__ = ["LONG_MODULES", "MAX_LINES", "long_modules", "report_long_modules"]

MAX_LINES = 450
"""The house size of a module (modules of 150–450 lines)."""

LONG_MODULES = pytest.StashKey[dict[str, int]]()
"""Where the layers test leaves what it found, for :func:`report_long_modules`."""


def long_modules(root: Path, limit: int = MAX_LINES) -> dict[str, int]:
    """Each ``.py`` file under ``root`` longer than ``limit`` lines: its path relative to
    ``root`` and its length, sorted by path."""
    found = {
        path.relative_to(root).as_posix(): lines
        for path in sorted(root.rglob("*.py"))
        if (lines := len(path.read_text(encoding="utf-8").splitlines())) > limit
    }
    return dict(sorted(found.items()))


def report_long_modules(terminal: pytest.TerminalReporter, config: pytest.Config) -> None:
    """Write the modules the layers test found too long as a section of the terminal summary
    (nothing when it did not run or found none)."""
    long = config.stash.get(LONG_MODULES, {})
    if not long:
        return
    terminal.write_sep("-", f"modules of kvtrio/ over {MAX_LINES} lines (a report, not a failure)")
    for path, lines in long.items():
        terminal.write_line(f"{path}: {lines} lines")
