"""An asyncio serving engine with batched speculative decoding on llama.cpp.

``Engine`` (with ``EngineConfig`` and ``SamplingParams``) serves many concurrent requests;
the low-level, synchronous speculative session lives in :mod:`engine.session`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._lazy import lazy_names

if TYPE_CHECKING:
    from . import session
    from .scheduler import (
        Delta,
        Engine,
        EngineConfig,
        EngineDeadError,
        EngineMetrics,
        FinishReason,
        QueueFullError,
        RequestError,
        RequestMetrics,
        RequestOutput,
        SamplingParams,
        UnknownRequestError,
        engine_speculative,
    )
    from .session import (
        Batch,
        ChatMessage,
        ChatOptions,
        ChatTemplate,
        Context,
        ContextConfig,
        Model,
        Runtime,
        SessionError,
        SpeculativeConfig,
        SpeculativeSession,
        ToolCall,
        ToolCallDelta,
    )

__all__ = [
    "Batch",
    "ChatMessage",
    "ChatOptions",
    "ChatTemplate",
    "Context",
    "ContextConfig",
    "Delta",
    "Engine",
    "EngineConfig",
    "EngineDeadError",
    "EngineMetrics",
    "FinishReason",
    "Model",
    "QueueFullError",
    "RequestError",
    "RequestMetrics",
    "RequestOutput",
    "Runtime",
    "SamplingParams",
    "SessionError",
    "SpeculativeConfig",
    "SpeculativeSession",
    "ToolCall",
    "ToolCallDelta",
    "UnknownRequestError",
    "engine_speculative",
    "session",
]


# Names resolve on first use, so that importing a pure module (the scheduler's planner, the
# drafting subsystem) does not load the native extension.
_WHERE = {
    "session": "session",
    "Delta": "scheduler",
    "Engine": "scheduler",
    "EngineConfig": "scheduler",
    "EngineDeadError": "scheduler",
    "EngineMetrics": "scheduler",
    "FinishReason": "scheduler",
    "QueueFullError": "scheduler",
    "RequestError": "scheduler",
    "RequestMetrics": "scheduler",
    "RequestOutput": "scheduler",
    "SamplingParams": "scheduler",
    "UnknownRequestError": "scheduler",
    "engine_speculative": "scheduler",
    "Batch": "session",
    "ChatMessage": "session",
    "ChatOptions": "session",
    "ChatTemplate": "session",
    "Context": "session",
    "ContextConfig": "session",
    "Model": "session",
    "Runtime": "session",
    "SessionError": "session",
    "SpeculativeConfig": "session",
    "SpeculativeSession": "session",
    "ToolCall": "session",
    "ToolCallDelta": "session",
}


__getattr__ = lazy_names(__name__, _WHERE)
