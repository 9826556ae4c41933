"""The engine's own errors (the native core's are in :mod:`engine.session.errors`)."""

from __future__ import annotations

from ..session import ClosedError, SessionError

__all__ = ["EngineDeadError", "QueueFullError", "RequestError", "UnknownRequestError"]


class QueueFullError(SessionError):
    """The wait queue is full (``EngineConfig.max_queue``)."""


class UnknownRequestError(SessionError, KeyError):
    """No running or waiting request has this id."""


class RequestError(SessionError):
    """A request failed in the engine; ``__cause__`` holds the error behind it. The engine
    and the other requests go on."""


class EngineDeadError(ClosedError):
    """The engine can no longer serve (its step loop failed beyond recovery, or its native
    thread is gone): every pending request gets this error, and so does every later call.
    ``__cause__`` holds the error behind it. ``close()`` still works."""
