"""A draft model on a real pair: Qwen2.5-Coder-1.5B-Instruct (``coder``) drafted by
Qwen2.5-Coder-0.5B-Instruct (``coder-draft``), both Q4_K_M, on the ``code`` prompt set:
BENCHMARKS.md "Draft model on a real pair".

    pip install -e ".[bench]"
    ./benchmarks/build_reference.sh               # llama-server from the pinned tree
    python benchmarks/draft_pair.py --streams 1,4 --repeats 3
    python benchmarks/draft_pair.py --streams 16 --repeats 1   # (runs of other N are kept)
    python benchmarks/draft_pair.py --render      # the section from the JSON kept

At each N, interleaved (one repeat = every variant once): llama-server with no drafting and
with ``--spec-type draft-simple`` (``--spec-draft-n-max`` = ``--n-draft``), our engine with no
drafting, with the adaptive policy (its defaults) and with ``draft_policy="fixed"`` at
``--n-draft``. Greedy, end-of-generation ignored. Then the cost curve that decides it: one
target decode of R rows (one sequence) ÷ one row, and one draft-model token ÷ one target
row, measured here; what the same arithmetic predicts for a memory-bound device, where a
few rows cost what one does.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import statistics
import time
from pathlib import Path
from typing import Any

from side_by_side import ROOT, Setup, run_ours_config, run_server, write_benchmarks

from engine import EngineConfig
from engine.bench import BenchResult, machine_info
from engine.models import NAMED_MODELS, fetch
from engine.scheduler.params import engine_speculative
from engine.session import Batch, Context, ContextConfig, Model, Runtime
from engine.workloads import load_prompts

RESULTS = ROOT / "benchmarks" / "results"
JSON = RESULTS / "draft_pair.json"
SECTION = RESULTS / "draft_pair.md"
#: (name, side, speculative, policy)
VARIANTS = [
    ("server, no drafting", "server", "none", None),
    ("server, draft-simple", "server", "draft-simple", None),
    ("ours, no drafting", "ours", "none", None),
    ("ours, adaptive", "ours", "draft", "adaptive"),
    ("ours, fixed", "ours", "draft", "fixed"),
]


def cost_curve(target: str, draft: str, threads: int, rows: list[int], repeats: int = 5) -> dict[str, Any]:
    """Seconds of one target decode of R rows that all need logits (one sequence, after a
    64-token context), the median of ``repeats``; and of one draft-model token."""
    with Runtime() as runtime:

        def timer(path: str) -> Any:
            ctx = Context.create(
                Model.load(runtime, path), ContextConfig(n_ctx=512, n_batch=512, threads=threads)
            )
            ctx.decode(_rows(64, 0, logits=False))

            def time_rows(r: int) -> float:
                times = []
                for _ in range(repeats + 1):  # (the first run of a shape allocates)
                    t0 = time.perf_counter()
                    ctx.decode(_rows(r, 64))
                    times.append(time.perf_counter() - t0)
                    ctx.kv_remove(0, 64)
                return statistics.median(times[1:])

            return time_rows

        target_time = timer(target)
        seconds = {r: target_time(r) for r in rows}
        draft_token = timer(draft)(1)
    return {"target_seconds": seconds, "draft_token_seconds": draft_token}


def _rows(n: int, pos: int, logits: bool = True) -> Batch:
    b = Batch()
    for i in range(n):
        b.add(1 + i % 100, pos + i, 0, logits)
    return b


def predicted_speedup(acceptance: float, k: int, verify: float, draft: float) -> float:
    """Tokens per unit time with ``k``-token drafts accepted token by token at rate
    ``acceptance`` ÷ without drafting: a step verifies k+1 rows (``verify`` times one row)
    after k draft tokens (``draft`` times one target row each)."""
    tokens = sum(acceptance**i for i in range(k + 1))
    return tokens / (verify + k * draft)


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    target, draft = (str(fetch(NAMED_MODELS[n])) for n in ("coder", "coder-draft"))
    with Runtime() as runtime:
        vocab = Model.load(runtime, target, vocab_only=True)
        prompts = [vocab.tokenize(p, add_special=True) for p in load_prompts("code")]
    runs: list[dict[str, Any]] = []
    for n in args.streams:
        s = Setup(target, prompts, args.max_tokens, args.threads, args.n_ctx, args.n_draft, 0, draft)
        requests = s.requests(n, args.requests or max(6, 2 * n))
        for rep in range(args.repeats):
            for name, side, spec, policy in VARIANTS:
                print(f"N={n} repeat {rep + 1}/{args.repeats}: {name} ...", end=" ", flush=True)
                if side == "server":
                    result, _, _ = await run_server(s, n, spec, requests)
                else:
                    config = EngineConfig(
                        model=target,
                        draft_model=draft if spec != "none" else None,
                        # fixed: --n-draft tokens, as llama-server; adaptive: the engine's defaults
                        speculative=engine_speculative(spec, n, args.n_draft if policy == "fixed" else None),
                        draft_policy=policy or "adaptive",
                        n_seq=n,
                        n_ctx=args.n_ctx,
                        threads=args.threads,
                        prefix_cache=False,
                    )
                    result, _ = await run_ours_config(config, s, n, requests)
                print(
                    f"{result.tokens_per_s:.2f} tok/s, drafted {result.drafted}, accepted {result.accepted}",
                    flush=True,
                )
                runs.append({"n": n, "variant": name, "repeat": rep, **_result(result)})
    curve = cost_curve(target, draft, args.threads, [1, 2, 3, 4, 5, 8, 16, 32, 64])
    return {
        "machine": machine_info(),
        "date": datetime.date.today().isoformat(),
        "commands": ["python benchmarks/draft_pair.py " + " ".join(args.argv)],
        "settings": {
            "max_tokens": args.max_tokens,
            "n_draft": args.n_draft,
            "threads": args.threads,
            "prompts": "code",
        },
        "runs": runs,
        "cost": curve,
    }


def _result(r: BenchResult) -> dict[str, Any]:
    return {
        "tokens_per_s": r.tokens_per_s,
        "tokens": r.tokens,
        "seconds": r.seconds,
        "drafted": r.drafted,
        "accepted": r.accepted,
        "requests": r.requests,
    }


def render(report: dict[str, Any]) -> str:
    st = report["settings"]
    by: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for r in report["runs"]:
        by.setdefault((r["n"], r["variant"]), []).append(r)
    ns = sorted({n for n, _ in by})
    names = [v[0] for v in VARIANTS]
    lines = [
        "## Draft model on a real pair",
        "",
        f"Qwen2.5-Coder-1.5B-Instruct drafted by Qwen2.5-Coder-0.5B-Instruct (both Q4_K_M; `--model coder "
        f"--draft coder-draft`), the `code` prompt set, {st['max_tokens']} greedy tokens per request, "
        f"end-of-generation ignored, 2N requests (at least 6) at N streams, {st['threads']} threads, no prefix reuse on "
        f"either side. {report['machine']['cpu']}, {report['machine']['cores']} cores, {report['date']}. "
        f"llama-server: the pinned tree's, `--spec-type draft-simple --spec-draft-n-max {st['n_draft']}`; "
        f'ours fixed: `draft_policy="fixed"` at {st["n_draft"]} tokens; ours adaptive: the engine\'s '
        "defaults (up to 16 tokens, each sequence drafting what its measured cost says pays). "
        "Tokens/s medians of the interleaved repeats; ratios ÷ the same side's no-drafting run, "
        "paired by repeat: median [min, max].",
        "",
        *(f"    {c}" for c in report["commands"]),
        "",
        "| N | variant | tok/s | ÷ no drafting | drafted | accepted |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for n in ns:
        for name in names:
            runs = by.get((n, name))
            if not runs:
                continue
            base = by[(n, "server, no drafting" if name.startswith("server") else "ours, no drafting")]
            tps = statistics.median(r["tokens_per_s"] for r in runs)
            ratios = sorted(a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(runs, base, strict=True))
            ratio = (
                "" if runs is base else f"{statistics.median(ratios):.2f} [{ratios[0]:.2f}, {ratios[-1]:.2f}]"
            )
            drafted = sum(r["drafted"] for r in runs)
            accepted = sum(r["accepted"] for r in runs)
            acc = f"{accepted:,} ({100 * accepted / drafted:.0f} %)" if drafted else "0"
            lines.append(f"| {n} | {name} | {tps:.2f} | {ratio} | {drafted:,} | {acc} |")
    for n in ns:
        idle = by.get((n, "ours, adaptive"), [])
        if idle and not sum(r["drafted"] for r in idle):
            off = [r["tokens_per_s"] for r in by[(n, "ours, no drafting")]]
            noise = (
                f": the no-drafting runs alone went from {min(off):.2f} to {max(off):.2f} tok/s"
                if len(off) > 1
                else ""
            )
            lines += [
                "",
                f"At N = {n} the adaptive policy drafted nothing: its ratio is speculation's idle cost "
                f"(a draft model loaded, the policy pricing every step) plus this machine's noise{noise}.",
            ]
    cost = report["cost"]
    one = cost["target_seconds"]["1"]
    lines += [
        "",
        "Repeats per N: "
        + ", ".join(f"{n}: {len(by[(n, names[0])])}" for n in ns)
        + "; drafted and accepted are totals over the repeats.",
        "",
        "What a step costs here (one target decode of R rows of one sequence ÷ one row, median of 5; "
        "one draft-model token ÷ one target row):",
        "",
        "| R | " + " | ".join(cost["target_seconds"]) + " | draft token |",
        "|---|" + "---:|" * (len(cost["target_seconds"]) + 1),
        "| ÷ 1 row | "
        + " | ".join(f"{t / one:.2f}" for t in cost["target_seconds"].values())
        + f" | {cost['draft_token_seconds'] / one:.2f} |",
        "",
    ]
    k = st["n_draft"]
    fixed = [r for r in report["runs"] if r["variant"] == "ours, fixed" and r["n"] == 1]
    if fixed and sum(r["drafted"] for r in fixed):
        # the per-token acceptance that gives the accepted length measured with k-token drafts
        mean_accepted = sum(r["accepted"] for r in fixed) / (
            sum(r["tokens"] for r in fixed) - sum(r["accepted"] for r in fixed)
        )
        alpha = _per_token_acceptance(mean_accepted, k)
        base = [r for r in report["runs"] if r["variant"] == "ours, no drafting" and r["n"] == 1]
        measured = statistics.median(
            a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(fixed, base, strict=True)
        )
        here = predicted_speedup(
            alpha, k, cost["target_seconds"][str(k + 1)] / one, cost["draft_token_seconds"] / one
        )
        # memory-bound: k+1 rows cost one row; a draft token costs its weights' share of the target's
        weights = 491_400_064 / 1_117_320_768
        bound = predicted_speedup(alpha, k, 1.0, weights)
        lines += [
            f"At one stream, {k}-token drafts were accepted {mean_accepted:.2f} tokens per step on average, "
            f"a per-token acceptance of {alpha:.2f}. With the costs above a step of {k} drafts makes "
            f"{sum(alpha**i for i in range(k + 1)):.2f} tokens for "
            f"{cost['target_seconds'][str(k + 1)] / one:.2f} + {k} × {cost['draft_token_seconds'] / one:.2f} "
            f"one-row steps: predicted {here:.2f}x of no drafting; measured {measured:.2f}x (the N = 1 fixed row: "
            "the prediction leaves out the draft model reading every prompt and history it skipped, and "
            "the draft call's own sampling, so it is an upper bound). "
            f"On a memory-bound device (a GPU at small batches), where {k + 1} rows cost what one does "
            f"and a draft token costs its weights' share of the target's ({weights:.2f}), the same "
            f"acceptance predicts {bound:.2f}x: there this pair pays, and the adaptive policy, which "
            "prices drafts with the costs it measures on the machine it runs on, drafts.",
            "",
        ]
    return "\n".join(lines)


def _per_token_acceptance(mean_accepted: float, k: int) -> float:
    """The per-token rate a whose expected accepted length with k-token drafts,
    a + a^2 + ... + a^k, equals ``mean_accepted`` (bisection)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(mid**i for i in range(1, k + 1)) < mean_accepted else (lo, mid)
    return lo


def main() -> None:
    import sys

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", default="1,4,16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--requests", type=int, default=None, help="requests per N (default 2N, at least 6)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--n-draft", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-ctx", type=int, default=1024)
    ap.add_argument("--render", action="store_true", help="only write the section from the JSON kept")
    args = ap.parse_args()
    args.argv = sys.argv[1:]
    args.streams = [int(x) for x in args.streams.split(",")]
    if not args.render:
        report = asyncio.run(measure(args))
        if JSON.exists():  # keep the runs of the other N (a section measured in parts)
            old = json.loads(JSON.read_text())
            report["runs"] = [r for r in old["runs"] if r["n"] not in args.streams] + report["runs"]
            report["commands"] = [c for c in old["commands"] if c not in report["commands"]] + report[
                "commands"
            ]
        JSON.write_text(json.dumps(report, indent=1) + "\n")
    SECTION.write_text(render(json.loads(JSON.read_text())) + "\n")
    write_benchmarks()
    print(Path(SECTION).read_text())


if __name__ == "__main__":
    main()
