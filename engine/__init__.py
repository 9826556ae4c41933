"""An asyncio serving engine with batched speculative decoding on llama.cpp.

``Engine`` (with ``EngineConfig`` and ``SamplingParams``) serves many concurrent requests;
the low-level, synchronous speculative session lives in :mod:`engine.session`.
"""

from __future__ import annotations

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
