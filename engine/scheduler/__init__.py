"""The async scheduler: requests over ``n_seq`` slots, one native step at a time.

Modules, one job each: ``inputs`` (submissions → requests), ``planner`` (slots, queue and
the step plan), ``scheduler`` (state transitions), ``output`` (verified tokens → what a
request keeps and emits), ``checkpoints`` (a request's sequence as bytes), ``engine`` (the
public API and the step loop), ``streams`` (what a caller reads a streamed request
through), ``native`` (the one door to the extension), ``drafting`` (how much to draft).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_names

if TYPE_CHECKING:
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


# Names resolve on first use: the planner, the params and the drafting subsystem import
# without the native extension, which only the engine loop and its step need.
_WHERE = {
    "Engine": "engine",
    "EngineDeadError": "errors",
    "QueueFullError": "errors",
    "RequestError": "errors",
    "UnknownRequestError": "errors",
    "FinishReason": "output",
    "EngineConfig": "params",
    "SamplingParams": "params",
    "engine_speculative": "params",
    "Delta": "request",
    "RequestMetrics": "request",
    "RequestOutput": "request",
    "EngineMetrics": "scheduler",
}


__getattr__ = lazy_names(__name__, _WHERE)
