"""Test-run hooks for every test directory of the repository (``tests/``, ``backends/*/tests``).

pytest-trio (0.8) turns a skip raised inside a trio test or fixture into a bare ``pytest.skip()``
(its ``plugin.py``: a group of one ``Skipped`` is re-raised without its message), so ``-rs``
printed "Skipped" and no reason for the conformance kit's optional features and every other
skip in an async test. The reason is still on the exception the bare skip was raised from
(``__context__``): :func:`pytest_runtest_makereport` puts it back, at the test's own location.
"""

from __future__ import annotations

import sys
from collections.abc import Generator
from types import TracebackType
from typing import Any

import pytest

if sys.version_info < (3, 11):  # pragma: no cover - exercised by the py310 tox env
    from exceptiongroup import BaseExceptionGroup


def _lost_skip(error: BaseException) -> BaseException | None:
    """The one skip, with a message, inside the group a bare skip was raised from, if any."""
    if not isinstance(error, pytest.skip.Exception) or error.msg:
        return None
    context = error.__context__
    if not isinstance(context, BaseExceptionGroup):
        return None
    leaves: list[BaseException] = []
    queue: list[BaseException] = [context]
    while queue:
        error = queue.pop()
        if isinstance(error, BaseExceptionGroup):
            queue.extend(error.exceptions)
        else:
            leaves.append(error)
    if len(leaves) == 1 and isinstance(leaves[0], pytest.skip.Exception) and leaves[0].msg:
        return leaves[0]
    return None


def _where(traceback: TracebackType | None) -> tuple[str, int] | None:
    """The file and line (0-based, as pytest keeps it) that called ``pytest.skip``: the last
    frame outside pytest."""
    found = None
    while traceback is not None:
        code = traceback.tb_frame.f_code
        if "_pytest" not in code.co_filename:
            found = (code.co_filename, traceback.tb_lineno - 1)
        traceback = traceback.tb_next
    return found


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, Any, Any]:
    report = yield
    if report.skipped and call.excinfo is not None and isinstance(report.longrepr, tuple):
        skip = _lost_skip(call.excinfo.value)
        if skip is not None:
            path, line = _where(skip.__traceback__) or (str(item.path), 0)
            report.longrepr = (path, line + 1, f"Skipped: {skip.msg}")
    return report
