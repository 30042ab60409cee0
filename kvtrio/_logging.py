"""Structured logs: notable events carry a name and fields; one line each, as text or JSON.

Code anywhere in kvtrio logs through the standard library and marks notable events with
:func:`event`::

    log.info("session %s ended (%s)", sid, reason, extra=event("session_end", session=sid))

:func:`configure_logging` (called by the ``kvtrio`` command) renders every record, ours and
libraries', as one line: ``text`` for people (the message alone: the fields would only repeat
it) or ``json`` for log pipelines (``timestamp``, ``level``, ``logger``, ``event``, ``message``
and the fields).
structlog's ``ProcessorFormatter`` does the rendering; it is imported only here, so the layers
that merely log do not depend on it.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from typing import Any, TextIO

__all__ = ["EVENT_KEY", "configure_logging", "event"]

EVENT_KEY = "kvtrio_event"
"""The ``extra`` key that names an event (renamed ``event`` when rendered)."""


def event(name: str, **fields: Any) -> dict[str, Any]:
    """The ``extra=`` mapping of a log call that reports the event ``name`` with ``fields``.

    Field names must not be attributes of ``logging.LogRecord`` (``name``, ``msg``, ``args``,
    ``module``...); values should be JSON-serialisable scalars.
    """
    return {EVENT_KEY: name, **fields}


def _text(_logger: Any, _name: str, event_dict: MutableMapping[str, Any]) -> str:
    timestamp = event_dict.pop("timestamp", "")
    level = str(event_dict.pop("level", "")).upper()
    logger = event_dict.pop("logger", "")
    message = event_dict.pop("message", "")
    exception = event_dict.pop("exception", None)
    line = f"{timestamp} {level} {logger}: {message}"
    if exception:
        line += "\n" + str(exception).rstrip("\n")
    return line


def configure_logging(level: str, fmt: str, stream: TextIO | None = None) -> None:
    """Send every log record to ``stream`` (stderr) at ``level``, rendered as ``fmt`` (``text``
    or ``json``). Replaces the root logger's handlers."""
    import structlog

    pre_chain: list[Any] = [
        structlog.stdlib.ExtraAdder(),
        structlog.processors.EventRenamer("message", replace_by=EVENT_KEY),
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if fmt == "json":
        final: list[Any] = [
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(default=str),
        ]
    else:
        final = [structlog.processors.format_exc_info, _reorder, _text]
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=pre_chain,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *final],
    )
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def _reorder(_logger: Any, _name: str, event_dict: MutableMapping[str, Any]) -> Any:
    """Text lines show the event name first among the fields."""
    if "event" in event_dict:
        name = event_dict.pop("event")
        rest = dict(event_dict)
        event_dict.clear()
        event_dict.update({key: rest.pop(key) for key in _FIXED if key in rest})
        event_dict["event"] = name
        event_dict.update(rest)
    return event_dict


_FIXED = ("timestamp", "level", "logger", "message", "exception")
