"""The library's logging: structlog events carried by the standard :mod:`logging` module.

Nothing is configured globally: each logger wraps a standard logger under the ``engine``
name, so the application's logging configuration decides what is shown and where. Without
one, Python shows WARNING and above on stderr and nothing else; nothing ever goes to stdout.

A record's message is ``event key=value ...``; the event and its fields are also on the
record as ``record.engine`` (a dict), for structured handlers.
"""

from __future__ import annotations

import logging
from collections.abc import MutableMapping
from typing import Any

import structlog

__all__ = ["get_logger"]


def _render(_logger: Any, _method: str, event: MutableMapping[str, Any]) -> tuple[tuple[str], dict[str, Any]]:
    fields = {k: v for k, v in event.items() if k != "event"}
    name = str(event.get("event", ""))
    message = " ".join([name, *(f"{k}={v!r}" for k, v in fields.items())])
    return (message,), {"extra": {"engine": {"event": name, **fields}}}


def get_logger(name: str) -> Any:
    """A structlog logger over ``logging.getLogger(name)``; ``name`` starts with ``engine``."""
    return structlog.wrap_logger(
        logging.getLogger(name),
        processors=[structlog.stdlib.filter_by_level, _render],
        wrapper_class=structlog.stdlib.BoundLogger,
    )
