"""An asyncio serving engine with batched speculative decoding on llama.cpp.

The low-level, synchronous speculative session lives in :mod:`engine.session`.
"""

from __future__ import annotations

from . import session
from .session import (
    Batch,
    Context,
    ContextConfig,
    Model,
    Runtime,
    SessionError,
    SpeculativeConfig,
    SpeculativeSession,
)

__all__ = [
    "Batch",
    "Context",
    "ContextConfig",
    "Model",
    "Runtime",
    "SessionError",
    "SpeculativeConfig",
    "SpeculativeSession",
    "session",
]
