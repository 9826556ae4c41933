"""The async scheduler: requests over ``n_seq`` slots, one native step at a time."""

from __future__ import annotations

from .engine import Engine, EngineMetrics, QueueFullError, RequestError, UnknownRequestError
from .params import EngineConfig, SamplingParams
from .request import Delta, FinishReason, RequestMetrics, RequestOutput

__all__ = [
    "Delta",
    "Engine",
    "EngineConfig",
    "EngineMetrics",
    "FinishReason",
    "QueueFullError",
    "RequestError",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "UnknownRequestError",
]
