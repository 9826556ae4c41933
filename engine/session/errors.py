"""The session's exception hierarchy, mirroring the seed API's error variants.

Every error raised by the native core is one of these; each carries the details of its
variant as attributes (``seq_id``, ``n_seq``, ``size``, ``maximum``, ``accepted``,
``proposed``, ``code``, ``reason``), ``None`` where a variant has no such detail.
"""

from __future__ import annotations

__all__ = [
    "SessionError",
    "InitError",
    "ModelLoadError",
    "ProcessError",
    "BeginError",
    "DraftError",
    "AcceptError",
    "PromptTooLongError",
    "IncompatibleContextsError",
    "BadSeqIdError",
    "InvalidConfigError",
    "InvalidArgumentError",
    "DecodeError",
    "ProposalPendingError",
    "NoPendingProposalError",
    "AcceptedTooManyError",
    "StateError",
    "NotQuiescentError",
    "ClosedError",
]


class SessionError(Exception):
    """Base class of every error raised by the engine's native core."""

    seq_id: int | None
    n_seq: int | None
    size: int | None
    maximum: int | None
    accepted: int | None
    proposed: int | None
    code: int | None
    reason: str | None

    def __init__(
        self,
        message: str,
        *,
        seq_id: int | None = None,
        n_seq: int | None = None,
        size: int | None = None,
        maximum: int | None = None,
        accepted: int | None = None,
        proposed: int | None = None,
        code: int | None = None,
        reason: str | None = None,
    ) -> None:
        super().__init__(message)
        self.seq_id = seq_id
        self.n_seq = n_seq
        self.size = size
        self.maximum = maximum
        self.accepted = accepted
        self.proposed = proposed
        self.code = code
        self.reason = reason


class InitError(SessionError):
    """A session or context could not be created."""


class ModelLoadError(InitError):
    """A model file is missing, not GGUF, truncated, or one llama.cpp would abort on."""


class ProcessError(SessionError):
    """Handing a decoded batch to the speculative backend failed."""


class BeginError(SessionError):
    """Starting a generation on the speculative backend failed."""


class DraftError(SessionError):
    """Drafting failed."""


class AcceptError(SessionError):
    """Reporting accepted drafts to the speculative backend failed."""


class PromptTooLongError(SessionError):
    """A prompt exceeds the session's bound (``size`` > ``maximum``)."""


class IncompatibleContextsError(SessionError):
    """Target and draft contexts do not fit together (``reason``)."""


class BadSeqIdError(SessionError, IndexError):
    """A sequence id outside ``[0, n_seq)``."""


class InvalidConfigError(SessionError, ValueError):
    """An invalid configuration value (``reason``)."""


class InvalidArgumentError(SessionError, ValueError):
    """An invalid argument: token id, position, batch shape... (``reason``)."""


class DecodeError(SessionError):
    """The target decode failed (``code`` is llama.cpp's return code)."""


class ProposalPendingError(SessionError):
    """Sequence ``seq_id`` has a draft proposal that was not accepted yet."""


class NoPendingProposalError(SessionError):
    """``accept`` on sequence ``seq_id`` without a pending proposal."""


class AcceptedTooManyError(SessionError):
    """``accepted`` exceeds the ``proposed`` proposal length."""


class StateError(SessionError):
    """Capturing or restoring state failed, or the bytes are invalid (``reason``)."""


class NotQuiescentError(StateError):
    """State access while a proposal is pending somewhere."""


class ClosedError(SessionError, RuntimeError):
    """The runtime (native thread) was closed."""
