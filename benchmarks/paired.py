"""Speculation on ÷ off on every prompt set, resolved: the two sides as two engines on ONE
native thread, their steps taking turns (BENCHMARKS.md "Speculation on ÷ off on one thread").

Runs a few seconds apart move by 10 % and more on a shared 2-core machine, so the paired
throughput ratios of ``benchmarks/prompt_sets.py`` spread over 0.1 however they are
interleaved. Here the off and on engines share a runtime (``Engine(config, runtime=...)``)
and serve the same closed-loop load at once: whatever the machine does falls on both alike.
Each side generates the same tokens (end-of-generation ignored), so its throughput is
tokens ÷ its busy seconds: the native steps' time (``EngineMetrics.step_seconds``: the
target's decode, the drafter's work, sampling) plus the event loop's planning and applying
them (``EngineMetrics.host_seconds``). The rest of the loop (the callers, the event loop's
turns) is counted on neither side; it is paid per step, and the side that drafts takes fewer
steps, so leaving it out understates what drafting gains. Ramp and tail are included.

    python benchmarks/paired.py [--sets heldout,copy,...] [--streams 1,4,16] [--repeats 5]

Rows measured again replace their old ones in ``benchmarks/results/paired.json``; the table
(``paired.md``) is written from all rows kept, after every row.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio

from engine import Engine, EngineConfig
from engine.bench import BenchResult, default_requests, load_engine, warm_up
from engine.scheduler.params import default_model_path, engine_speculative
from engine.session import Runtime
from engine.workloads import load_prompts

sys.path.insert(0, str(Path(__file__).resolve().parent))
from side_by_side_report import update_readme  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
SETS = ["heldout", "copy", "code", "edits", "summaries", "chat", "mixed"]
#: what every row runs (the table's heading says so)
SPEC, THREADS, MAX_TOKENS = "ngram-simple", 2, 64


async def measure(
    cfg_off: EngineConfig,
    cfg_on: EngineConfig,
    n: int,
    n_requests: int,
    max_tokens: int,
    repeats: int,
    prompts: Sequence[str | list[int]] | None,
    fresh: bool = False,
) -> list[dict[str, float]]:
    """Per repeat and side (``off``, ``on``): steps, the native ms and host µs per step,
    busy seconds and tokens; drafted and accepted tokens (``drafted``: the on-side's; any two
    configurations can be compared); ``ratio``, the on-side's tokens per busy second ÷ the
    off-side's. ``fresh``: new engines for every repeat, so that what a draft policy learned
    in one repeat does not carry into the next (as it does in a server that runs for hours)."""
    if fresh:
        return [
            row
            for rep in range(repeats)
            for row in await _measure(cfg_off, cfg_on, n, n_requests, max_tokens, [rep], prompts)
        ]
    return await _measure(cfg_off, cfg_on, n, n_requests, max_tokens, range(repeats), prompts)


async def _measure(
    cfg_off: EngineConfig,
    cfg_on: EngineConfig,
    n: int,
    n_requests: int,
    max_tokens: int,
    repeats: Sequence[int],
    prompts: Sequence[str | list[int]] | None,
) -> list[dict[str, float]]:
    """The repeats ``repeats`` (their indices choose the requests) on one pair of engines."""

    async def load(results: dict[str, BenchResult], side: str, e: Engine, first: int) -> None:
        results[side] = await load_engine(e, n, n_requests, max_tokens, prompts, first=first)

    with Runtime() as runtime:
        off, on = Engine(cfg_off, runtime=runtime), Engine(cfg_on, runtime=runtime)
        async with off, on:
            for e in (off, on):
                await warm_up(e, prompts)
            reps = []
            for rep in repeats:
                before = [
                    (e.metrics.steps, e.metrics.step_seconds, e.metrics.host_seconds) for e in (off, on)
                ]
                results: dict[str, BenchResult] = {}
                async with anyio.create_task_group() as tg:
                    for side, e in (("off", off), ("on", on)):
                        tg.start_soon(load, results, side, e, rep * n_requests)
                row: dict[str, float] = {"drafted": results["on"].drafted, "accepted": results["on"].accepted}
                row["drafted_off"], row["accepted_off"] = results["off"].drafted, results["off"].accepted
                for side, e, (steps, native, host) in zip(("off", "on"), (off, on), before, strict=True):
                    k = e.metrics.steps - steps
                    native, host = e.metrics.step_seconds - native, e.metrics.host_seconds - host
                    row[f"steps_{side}"] = k
                    row[f"native_ms_{side}"] = native / k * 1e3
                    row[f"host_us_{side}"] = host / k * 1e6
                    row[f"busy_s_{side}"] = native + host
                    row[f"tokens_{side}"] = results[side].tokens
                row["ratio"] = (row["tokens_on"] / row["busy_s_on"]) / (row["tokens_off"] / row["busy_s_off"])
                reps.append(row)
            return reps


def spread(values: list[float]) -> tuple[float, float, float]:
    """(median, min, max)."""
    return statistics.median(values), min(values), max(values)


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "## Speculation on ÷ off on one thread",
        "",
        "`python benchmarks/paired.py` (each row's command and machine below; `gemma-3-270m-q4_k_m.gguf`, "
        "2 threads, 64 greedy tokens a request, end-of-generation ignored, `--spec ngram-simple` with "
        "the engine's defaults): speculation off and on as two engines on one native thread, serving "
        "the same closed-loop load at once, their steps taking turns, so that the machine's drift "
        "falls on both alike. `on ÷ off` is tokens per busy second (native steps + the event loop "
        "planning and applying them; the rest of the loop on neither side, which understates what "
        "drafting saves), ramp and tail included: the median of the repeats [min, max]. `drafted / "
        "accepted` are the on-side's, in all repeats together. Rows of different runs may come "
        "from different machines of the same name: the native ms per step tell them apart. See "
        "the script's docstring.",
        "",
        "| prompts | N | requests a repeat | repeats | on ÷ off | spread | native ms / step, off / on | steps, off / on | drafted / accepted |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        med, lo, hi = r["ratio"]
        lines.append(
            f"| {r['prompts']}{' (fresh engines)' if r.get('fresh') else ''} | {r['n']} | {r['requests']} | {len(r['repeats'])} | **{med:.3f}** [{lo:.3f}, {hi:.3f}] "
            f"| {hi - lo:.3f} | {r['native_ms_off']:.1f} / {r['native_ms_on']:.1f} | {r['steps_off']} / {r['steps_on']} "
            f"| {r['drafted']} / {r['accepted']}{' (drafted nothing)' if not r['drafted'] else ''} |"
        )
    lines += ["", "Runs:", ""]
    lines += [
        f"- {ran}: `{command}`" for ran, command in dict.fromkeys((r["ran"], r["command"]) for r in rows)
    ]
    return "\n".join(lines) + "\n"


def readme_table(rows: list[dict[str, Any]]) -> list[str]:
    """The README's summary: on ÷ off per prompt set and N, the median [min, max]."""
    ns = sorted({r["n"] for r in rows})
    by = {(r["prompts"], r["n"]): r for r in rows}
    lines = [
        "| prompts | " + " | ".join(f"N = {n}" for n in ns) + " |",
        "|---|" + "---:|" * len(ns),
    ]
    for name in dict.fromkeys(r["prompts"] for r in rows):
        cells = []
        for n in ns:
            r = by.get((name, n))
            med, lo, hi = r["ratio"] if r else (0, 0, 0)
            cells.append(
                f"**{med:.2f}** [{lo:.2f}, {hi:.2f}]{' †' if not r['drafted'] else ''}" if r else "not run"
            )
        lines.append(
            f"| {name}{' (tuned on for one choice only: BENCHMARKS.md)' if name == 'heldout' else ''} | "
            + " | ".join(cells)
            + " |"
        )
    return lines


async def main(args: argparse.Namespace) -> int:
    kept = json.loads(Path(args.json).read_text()) if Path(args.json).exists() else []
    rows = {(r["prompts"], r["n"], r.get("fresh", False)): r for r in kept}  # (measured again: replaced)
    for name in args.sets.split(","):
        prompts = load_prompts(name)
        for n in (int(x) for x in args.streams.split(",")):
            cfg = {
                side: EngineConfig(
                    model=str(default_model_path()),
                    speculative=engine_speculative(spec, n),
                    n_seq=n,
                    threads=THREADS,
                )
                for side, spec in (("off", "none"), ("on", SPEC))
            }
            n_req = args.requests or 4 * default_requests(n)
            reps = await measure(
                cfg["off"], cfg["on"], n, n_req, MAX_TOKENS, args.repeats, prompts, args.fresh
            )
            med = {k: statistics.median(r[k] for r in reps) for k in reps[0]}
            row = rows[name, n, args.fresh] = {
                "prompts": name,
                "n": n,
                "fresh": args.fresh,
                "requests": n_req,
                "ratio": spread([r["ratio"] for r in reps]),
                "native_ms_off": med["native_ms_off"],
                "native_ms_on": med["native_ms_on"],
                "steps_off": int(med["steps_off"]),
                "steps_on": int(med["steps_on"]),
                "drafted": sum(int(r["drafted"]) for r in reps),
                "accepted": sum(int(r["accepted"]) for r in reps),
                "ran": args.ran,
                "command": f"python benchmarks/paired.py {shlex.join(sys.argv[1:])}",
                "repeats": reps,
            }
            med_r, lo, hi = row["ratio"]
            print(
                f"{name:<10} N={n:<3} on ÷ off {med_r:.3f} [{lo:.3f}, {hi:.3f}]  "
                f"steps {row['steps_off']} / {row['steps_on']}  drafted {row['drafted']} accepted {row['accepted']}",
                flush=True,
            )
            ordered = sorted(
                rows.values(), key=lambda r: (SETS.index(r["prompts"]), r["n"], r.get("fresh", False))
            )
            Path(args.json).write_text(
                json.dumps(ordered, indent=2)
            )  # (after every row: a long run keeps its rows)
            Path(args.markdown).write_text(markdown(ordered))
            if Path(args.json) == RESULTS / "paired.json":  # (the published rows)
                update_readme(
                    readme_table([r for r in ordered if not r.get("fresh")]),
                    ROOT / "README.md",
                    "paired-table",
                )
    return 0


if __name__ == "__main__":
    from engine.bench import machine_info

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sets", default=",".join(SETS))
    ap.add_argument("--streams", default="1,4,16")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--requests", type=int, help="requests per repeat (default 16N, at least 32)")
    ap.add_argument(
        "--fresh", action="store_true", help="new engines for every repeat (rows apart from the others)"
    )
    ap.add_argument("--json", default=str(RESULTS / "paired.json"), help="rows kept and measured (merged)")
    ap.add_argument("--markdown", default=str(RESULTS / "paired.md"))
    args = ap.parse_args()
    info = machine_info()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    args.ran = (
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {info['cpu']}, {info['cores']} cores, "
        f"commit {commit.stdout.strip() or '?'}"
    )
    sys.exit(anyio.run(main, args))
