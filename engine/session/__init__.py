"""engine.session: the low-level speculative session (parity with the seed API).

Everything here is synchronous and runs on one native thread per :class:`Runtime`; the
scheduler (``engine.scheduler``) builds the async engine on top.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_names
from .errors import *  # noqa: F403
from .errors import __all__ as _errors_all

if TYPE_CHECKING:
    from .chat import ChatMessage, ChatOptions, ChatParser, ChatTemplate, ToolCall, ToolCallDelta
    from .checkpoint import SequenceCheckpoint
    from .config import SPEC_TYPES, ContextConfig, SpeculativeConfig, canonical_spec_type
    from .model import STATE_SEQ_FLAGS_PARTIAL_ONLY, Batch, Context, Model, ModelInfo
    from .runtime import Runtime
    from .session import SpecStats, SpeculativeSession

__all__ = [
    "SPEC_TYPES",
    "STATE_SEQ_FLAGS_PARTIAL_ONLY",
    "Batch",
    "ChatMessage",
    "ChatOptions",
    "ChatParser",
    "ChatTemplate",
    "Context",
    "ContextConfig",
    "Model",
    "ModelInfo",
    "Runtime",
    "SequenceCheckpoint",
    "SpecStats",
    "SpeculativeConfig",
    "SpeculativeSession",
    "ToolCall",
    "ToolCallDelta",
    "canonical_spec_type",
    *_errors_all,
]


# Names resolve on first use: the pure modules (errors, messages, configuration rules) import
# without the native extension.
_WHERE = {
    "ChatMessage": "chat",
    "ChatOptions": "chat",
    "ChatParser": "chat",
    "ChatTemplate": "chat",
    "ToolCall": "chat",
    "ToolCallDelta": "chat",
    "SequenceCheckpoint": "checkpoint",
    "SPEC_TYPES": "config",
    "ContextConfig": "config",
    "SpeculativeConfig": "config",
    "canonical_spec_type": "config",
    "STATE_SEQ_FLAGS_PARTIAL_ONLY": "model",
    "Batch": "model",
    "Context": "model",
    "Model": "model",
    "ModelInfo": "model",
    "Runtime": "runtime",
    "SpecStats": "session",
    "SpeculativeSession": "session",
}


__getattr__ = lazy_names(__name__, _WHERE)
