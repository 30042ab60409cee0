"""Structured log lines: text and JSON renderings of the same records."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest

from kvtrio._logging import configure_logging, event


@pytest.fixture(autouse=True)
def restore_root_logger() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_json_lines_have_the_event_its_fields_and_the_message() -> None:
    stream = io.StringIO()
    configure_logging("info", "json", stream)
    log = logging.getLogger("kvtrio.test")
    log.info(
        "backend %s failed", "disk", extra=event("l2_backend_error", backend="disk", backoff_s=0.5)
    )
    log.debug("not shown")
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("it broke")
    first, second = (json.loads(line) for line in stream.getvalue().splitlines())
    assert first["event"] == "l2_backend_error"
    assert (first["message"], first["backend"], first["backoff_s"]) == (
        "backend disk failed",
        "disk",
        0.5,
    )
    assert (first["level"], first["logger"]) == ("info", "kvtrio.test")
    assert first["timestamp"].endswith("Z")
    assert second["level"] == "error"
    assert "ValueError: boom" in second["exception"]


def test_text_lines_are_the_message_without_repeating_the_fields() -> None:
    stream = io.StringIO()
    configure_logging("debug", "text", stream)
    logging.getLogger("kvtrio.test").warning(
        "3 leases expired", extra=event("leases_expired", count=3, note="two words")
    )
    (line,) = stream.getvalue().splitlines()
    assert line.endswith(" WARNING kvtrio.test: 3 leases expired")  # json logs carry the fields
