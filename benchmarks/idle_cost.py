"""What speculation on costs a step when nothing is drafted, per drafter, resolved to a few
tenths of a per cent: speculation off and on as two engines on ONE native thread.

Throughput ratios between runs (``benchmarks/drafters.py``) cannot resolve 2 % on a shared
machine: identical work moves by 10 % and more between runs seconds apart. Here the two
engines share one runtime (``Engine(config, runtime=...)``): each serves the same closed-loop
load, their steps take turns on the thread, under one OpenMP team, so whatever the machine
does falls on both sides alike. Per engine and repeat: the native step's milliseconds per
step (``EngineMetrics.step_seconds``) and the event loop's microseconds planning a step and
applying its result (``EngineMetrics.host_seconds``). ``step on ÷ off`` is

    (native + host, off) / (native + host, on)

per repeat: what the step alone gives up, with the rest of the loop (the callers, the event
loop's turns: about as much again as the host part on a tiny model) counted on neither side,
so it overstates the cost. It is the throughput ratio only while both sides take the same
steps: a row in which the on-side drafted says so.

    python benchmarks/idle_cost.py [--streams 1,4,16] [--repeats 5] [--only 'scenario;...']
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import anyio

from engine import EngineConfig
from engine.bench import default_requests
from engine.models import resolve_model
from engine.scheduler.params import default_model_path, engine_speculative
from engine.workloads import CODE_PROMPTS, PROMPTS

sys.path.insert(0, str(Path(__file__).resolve().parent))
import paired  # noqa: E402
from drafters import ROOT, SCENARIOS, config  # noqa: E402

sys.path.insert(0, str(ROOT))
from tests.models.make_models import build_all  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


#: real models (``--real NAME:N,N``): (row name, target, draft model, speculative type, prompts)
REAL = {
    "gemma": ("Gemma 3 270M, n-gram, mixed prompts", "gemma", None, "ngram-simple", PROMPTS),
    "coder": (
        "Qwen2.5-Coder 1.5B, 0.5B draft model, code prompts",
        "coder",
        "coder-draft",
        "draft",
        CODE_PROMPTS,
    ),
}


def real(name: str, speculative: bool, n: int, args: argparse.Namespace) -> EngineConfig:
    """A :data:`REAL` pair with the engine's defaults, speculation on or off."""
    _, target, draft, spec, _ = REAL[name]
    return EngineConfig(
        model=default_model_path() if target == "gemma" else resolve_model(target),
        draft_model=resolve_model(draft) if draft and speculative else None,
        speculative=engine_speculative(spec if speculative else "none", n),
        n_seq=n,
        threads=args.threads,
    )


async def measure(
    cfg_off: EngineConfig, cfg_on: EngineConfig, n: int, args: argparse.Namespace, prompts: list | None
) -> list[dict[str, float]]:
    """Per repeat: each side's native ms and host µs per step (:func:`paired.measure`), what the
    on-side drafted, and ``ratio``, the step on ÷ off."""
    n_req = args.requests or 4 * default_requests(n)
    reps = await paired.measure(cfg_off, cfg_on, n, n_req, args.max_tokens, args.repeats, prompts)
    for r in reps:
        r["ratio"] = (r["native_ms_off"] + r["host_us_off"] / 1e3) / (
            r["native_ms_on"] + r["host_us_on"] / 1e3
        )
    return reps


def summary(name: str, n: int, reps: list[dict[str, float]]) -> dict[str, object]:
    med = {k: statistics.median(r[k] for r in reps) for k in reps[0]}
    native = [r["native_ms_on"] / r["native_ms_off"] for r in reps]
    ratios = [r["ratio"] for r in reps]
    return {
        "scenario": name,
        "n": n,
        "repeats": reps,
        "native_on_off": statistics.median(native),
        "native_min": min(native),
        "native_max": max(native),
        "host_us_off": med["host_us_off"],
        "host_us_on": med["host_us_on"],
        "native_ms_off": med["native_ms_off"],
        "ratio": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "drafted": sum(int(r["drafted"]) for r in reps),
    }


def markdown(rows: list[dict[str, object]], args: argparse.Namespace) -> str:
    heading = "## What speculation on costs a step that drafts nothing"
    lines = [
        heading if args.streams else f"{heading}: {', '.join(REAL[r.split(':')[0]][0] for r in args.real)}",
        "",
        f"`python benchmarks/idle_cost.py {shlex.join(sys.argv[1:])}` ({args.machine}): the tiny models "
        "of the drafter table (or the real models a row names), speculation off and on as two engines on one native thread, serving "
        f"the same closed-loop load ({args.max_tokens} greedy tokens a request, "
        f"{args.requests or '16N (at least 32)'} requests a repeat, {args.threads} threads), their "
        "steps taking turns; medians of the repeats [min, max]. `native` is the native step's time "
        "per step, on ÷ off; `host` the event loop's microseconds a step planning it and applying "
        "its result; `step on ÷ off` is (native + host, off) ÷ (native + host, on), the rest of "
        "the loop counted on neither side. See the script's docstring.",
        "",
        "| scenario | N | native on ÷ off | native ms / step, off | host µs / step, off / on | step on ÷ off | drafted |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['scenario']} | {r['n']} | {r['native_on_off']:.3f} [{r['native_min']:.3f}, {r['native_max']:.3f}] "
            f"| {r['native_ms_off']:.2f} | {r['host_us_off']:.0f} / {r['host_us_on']:.0f} "
            f"| **{r['ratio']:.3f}** [{r['ratio_min']:.3f}, {r['ratio_max']:.3f}] | {r['drafted']} |"
        )
    return "\n".join(lines) + "\n"


async def main(args: argparse.Namespace) -> int:
    paths = build_all(ROOT / "tests" / "models" / ".generated")
    tiny_prompts = [[1] + [100 + 37 * i + j for j in range(12)] for i in range(8)]  # token ids
    only = args.only.split(";") if args.only else None
    runs = [
        (name, n, config(paths, target, "none", draft, n, args), config(paths, target, spec, draft, n, args))
        for name, target, spec, draft in SCENARIOS
        if only is None or name in only
        for n in [int(x) for x in args.streams.split(",") if x]
    ]
    real_runs = [
        (REAL[key][0], int(n), real(key, False, int(n), args), real(key, True, int(n), args), REAL[key][4])
        for key, ns in (r.split(":") for r in args.real)
        for n in ns.split(",")
    ]
    rows = []
    for name, n, cfg_off, cfg_on, prompts in [(*r, tiny_prompts) for r in runs] + real_runs:
        row = summary(name, n, await measure(cfg_off, cfg_on, n, args, prompts))
        rows.append(row)
        print(
            f"{name:<26} N={n:<3} native on ÷ off {row['native_on_off']:.3f} "
            f"host µs off {row['host_us_off']:.0f} on {row['host_us_on']:.0f}  "
            f"step on ÷ off {row['ratio']:.3f} [{row['ratio_min']:.3f}, {row['ratio_max']:.3f}]  "
            f"drafted {row['drafted']}",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    if args.markdown:
        Path(args.markdown).write_text(markdown(rows, args))
    return 0


if __name__ == "__main__":
    from engine.bench import machine_info

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", default="1,4,16")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--requests", type=int, help="requests per repeat (default 16N, at least 32)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--n-draft", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", help="scenario names separated by ; (default: all)")
    ap.add_argument(
        "--real",
        action="append",
        default=[],
        help=f"also a real model at these N, as NAME:N,N (NAME one of {', '.join(REAL)}; e.g. gemma:64)",
    )
    ap.add_argument("--json", help="default: benchmarks/results/idle_cost.json (a full run)")
    ap.add_argument("--markdown", help="default: benchmarks/results/idle_cost.md (a full run)")
    ap.add_argument("--gemma", help="N,N: the same as --real gemma:N,N")
    args = ap.parse_args()
    args.real += [f"gemma:{args.gemma}"] if args.gemma else []
    info = machine_info()
    args.machine = f"{info['cpu']}, {info['cores']} cores, {time.strftime('%Y-%m-%d', time.gmtime())}"
    if not args.only and args.streams == ap.get_default("streams"):  # (the tiny models' table)
        args.json = args.json or str(RESULTS / "idle_cost.json")
        args.markdown = args.markdown or str(RESULTS / "idle_cost.md")
    elif not args.streams and len(args.real) == 1:  # (one real model's)
        name = args.real[0].split(":")[0]
        args.json = args.json or str(RESULTS / f"idle_cost_{name}.json")
        args.markdown = args.markdown or str(RESULTS / f"idle_cost_{name}.md")
    sys.exit(anyio.run(main, args))
