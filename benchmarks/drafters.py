"""Speculation on ÷ off for every drafter, on the tiny test models: whatever the drafts are
worth, turning speculation on must not make the engine slower.

Each scenario pairs a target with a drafter whose drafts are right always, sometimes or
almost never (on the tiny random-weight models of ``tests/models``, written on first use):

- ``draft``: a classic draft model; ``llama-soft-sharp`` drafts ``llama-soft``'s greedy
  tokens (always right), ``walk-llama-cycle6`` walks another permutation (almost never);
- ``eagle3``: ``walk-llama-eagle3``, whose first draft token is right and the rest are not;
- ``dflash``: ``walk-llama-dflash-oracle`` (the first token right) and ``walk-llama-dflash``
  (random weights: almost never right);
- ``mtp``: ``walk-qwen35-mtp`` (every draft right) and ``qwen35-mtp`` (random: almost never);
- ``ngram-simple`` (the engine's default n-gram settings) on ``walk-llama``, whose walk never
  repeats a 4-token key: nothing to draft, what speculation on costs when it finds nothing.

N closed-loop streams (``engine.bench.closed_loop``), greedy, interleaved repeats (off, on,
on, off, ...: a side that always ran first would be favoured while the machine drifts) on one
engine per side kept open across them (``engine.bench.KeptEngines``: each pair of runs is
close in time); prints the median ratio [min, max] per scenario and N, and writes JSON. A tiny
target generates a 64-token request in about 0.1 s, so a run sends 16N requests (at least 32):
with ``engine.bench``'s 4N the steady window lasted well under a second and one burst of
machine noise moved a run by 20 %.

    python benchmarks/drafters.py [--streams 1,4,16] [--repeats 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import anyio

from engine import EngineConfig, SpeculativeConfig
from engine.bench import BenchResult, KeptEngines, default_requests, run_load, speedups
from engine.cli import DEFAULT_N_DRAFT, DEFAULT_NGRAM_N

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.models.make_models import build_all  # noqa: E402

#: (name, target, spec type, draft model or None for MTP, what the drafts are worth)
SCENARIOS = [
    ("draft, always right", "llama-soft", "draft", "llama-soft-sharp"),
    ("draft, almost never", "walk-llama", "draft", "walk-llama-cycle6"),
    ("eagle3, first right", "walk-llama", "eagle3", "walk-llama-eagle3"),
    ("dflash, first right", "walk-llama", "dflash", "walk-llama-dflash-oracle"),
    ("dflash, almost never", "walk-llama", "dflash", "walk-llama-dflash"),
    ("mtp, always right", "walk-qwen35-mtp", "mtp", None),
    ("mtp, almost never", "qwen35-mtp", "mtp", None),
    ("n-gram, nothing to draft", "walk-llama", "ngram-simple", None),
]


def config(
    paths: dict[str, Path], target: str, spec: str, draft: str | None, n: int, args: argparse.Namespace
) -> EngineConfig:
    return EngineConfig(
        model=paths[target],
        draft_model=paths[draft] if draft and spec != "none" else None,
        speculative=SpeculativeConfig(
            spec, n_seq=n, n_draft_max=args.n_draft, ngram_size_n=DEFAULT_NGRAM_N, ngram_size_m=args.n_draft
        ),
        n_seq=n,
        n_ctx=512,
        threads=args.threads,
    )


async def main(args: argparse.Namespace) -> int:
    paths = build_all(ROOT / "tests" / "models" / ".generated")
    prompts = [[1] + [100 + 37 * i + j for j in range(12)] for i in range(8)]  # token ids
    report = []
    only = args.only.split(";") if args.only else None
    for name, target, spec, draft in SCENARIOS:
        if only is not None and name not in only:
            continue
        for n in [int(x) for x in args.streams.split(",")]:
            runs: list[BenchResult] = []
            n_req = args.requests or 4 * default_requests(n)  # (16N, at least 32)
            async with KeptEngines(prompts) as kept:  # (one engine per side, unless --fresh-engines)
                for rep in range(args.repeats):
                    for s in ("none", spec) if rep % 2 == 0 else (spec, "none"):
                        cfg = config(paths, target, s, draft, n, args)
                        if args.fresh_engines:
                            runs.append(await run_load(cfg, n, n_req, args.max_tokens, prompts))
                        else:
                            runs.append(await kept.load(cfg, n, n_req, args.max_tokens, first=rep * n_req))
            ((_, _, med, lo, hi),) = speedups(runs)
            on = [r for r in runs if r.speculative != "none"]
            drafted, accepted = sum(r.drafted for r in on), sum(r.accepted for r in on)
            row = {
                "scenario": name,
                "n": n,
                "median": med,
                "min": lo,
                "max": hi,
                "drafted": drafted,
                "accepted": accepted,
            }
            report.append(row)
            rate = f"{accepted / drafted:.0%}" if drafted else "drafted nothing"
            print(
                f"{name:<22} N={n:<3} on ÷ off {med:5.2f}x [{lo:.2f}, {hi:.2f}]  accepted {rate}", flush=True
            )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    if args.markdown:
        Path(args.markdown).write_text(markdown(report, args))
    return 0


def markdown(report: list[dict[str, object]], args: argparse.Namespace) -> str:
    lines = [
        "# Drafters on the tiny models: speculation on ÷ off",
        "",
        f"`python benchmarks/drafters.py {' '.join(sys.argv[1:])}`: {args.threads} threads, "
        f"{args.max_tokens} tokens per request, greedy, {args.requests or '16N (at least 32)'} requests per N, "
        f"median of {args.repeats} interleaved repeats [min, max]"
        + (
            ", each on a fresh engine"
            if args.fresh_engines
            else " on one engine per side, each in a process of its own, kept across the repeats"
        )
        + ". The tiny targets decode a step "
        "in 1–4 ms, so a drafter's own work (its decode of the batch, the target's hidden states "
        "it reads) weighs as much as the target itself: the draft policy measures it at start "
        "and online, a draft model catches up only when it drafts, and a hidden-state drafter "
        "is no longer fed once its drafts cannot pay for that (`DrafterGate`). Most rows "
        "therefore draft nothing in the steady window; the ratio is then what speculation on "
        "costs. drafted / accepted count the whole load (after a 4-token warm-up request), ramp included.",
        "",
        "| scenario | N | on ÷ off | drafted / accepted |",
        "|---|---:|---:|---:|",
    ]
    for r in report:
        lines.append(
            f"| {r['scenario']} | {r['n']} | **{r['median']:.2f}** [{r['min']:.2f}, {r['max']:.2f}] | "
            f"{r['drafted']} / {r['accepted']} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", default="1,4,16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--requests", type=int, help="requests per N (default 16N, at least 32)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--n-draft", type=int, default=DEFAULT_N_DRAFT)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument(
        "--fresh-engines",
        action="store_true",
        help="a fresh engine for every run (before 2026-12-07), not one per side kept across the repeats",
    )
    ap.add_argument(
        "--json", help="default: benchmarks/results/drafters.json (a run of every scenario and N)"
    )
    ap.add_argument(
        "--markdown", help="default: benchmarks/results/drafters.md (a run of every scenario and N)"
    )
    ap.add_argument(
        "--only", help="scenario names separated by ; (default: all; writes no results file unless asked)"
    )
    args = ap.parse_args()
    if not args.only and args.streams == ap.get_default("streams"):  # (not a partial run)
        args.json = args.json or str(ROOT / "benchmarks" / "results" / "drafters.json")
        args.markdown = args.markdown or str(ROOT / "benchmarks" / "results" / "drafters.md")
    sys.exit(anyio.run(main, args))
