"""The async scheduler: requests over ``n_seq`` slots, one native step at a time.

Modules, one job each: ``inputs`` (submissions → requests), ``planner`` (slots, queue and
the step plan), ``scheduler`` (state transitions), ``output`` (verified tokens → what a
request keeps and emits), ``checkpoints`` (a request's sequence as bytes), ``engine`` (the
public API and the step loop), ``policy`` (how much to draft).
"""

from __future__ import annotations

from .engine import Engine
from .errors import EngineDeadError, QueueFullError, RequestError, UnknownRequestError
from .output import FinishReason
from .params import EngineConfig, SamplingParams, engine_speculative
from .request import Delta, RequestMetrics, RequestOutput
from .scheduler import EngineMetrics

__all__ = [
    "Delta",
    "Engine",
    "EngineConfig",
    "EngineDeadError",
    "EngineMetrics",
    "FinishReason",
    "QueueFullError",
    "RequestError",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "UnknownRequestError",
    "engine_speculative",
]
