"""Load benchmarks of the engine.

- :mod:`.load`: the harness, closed-loop streams through the engine or over HTTP, measured;
- :mod:`.scenarios`: multi-turn conversations, and overload with preemption;
- :mod:`.report`: repeated runs as tables, ratios with their spread, and plots.
"""

from __future__ import annotations

from .load import (
    BURST_S,
    COPY_PROMPTS,
    PROMPT_SETS,
    PROMPTS,
    SHARED_PROMPTS,
    SHARED_SYSTEM,
    BenchResult,
    KeptEngines,
    Send,
    closed_loop,
    default_requests,
    load_engine,
    load_prompts,
    machine_info,
    measure_raw,
    percentile,
    raw_decode_throughput,
    run_http_load,
    run_load,
    warm_up,
)
from .report import (
    median_spread,
    medians,
    paired_ratio,
    plot,
    reuse_ratios,
    speedups,
    summarize,
    summarize_overload,
    summarize_turns,
)
from .scenarios import (
    OverloadResult,
    TurnStats,
    run_conversations,
    run_http_conversations,
    run_overload,
)

__all__ = [
    "BURST_S",
    "Send",
    "BenchResult",
    "KeptEngines",
    "COPY_PROMPTS",
    "OverloadResult",
    "PROMPTS",
    "PROMPT_SETS",
    "SHARED_PROMPTS",
    "SHARED_SYSTEM",
    "TurnStats",
    "closed_loop",
    "default_requests",
    "load_engine",
    "load_prompts",
    "machine_info",
    "measure_raw",
    "median_spread",
    "medians",
    "paired_ratio",
    "percentile",
    "plot",
    "raw_decode_throughput",
    "reuse_ratios",
    "run_conversations",
    "run_http_conversations",
    "run_http_load",
    "run_load",
    "run_overload",
    "speedups",
    "summarize",
    "summarize_overload",
    "summarize_turns",
    "warm_up",
]
