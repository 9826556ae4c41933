"""Prefix reuse and preemption, measured: our engine with its prefix cache on and off and
llama-server with ``cache_prompt: true`` on a shared-prefix workload, then multi-turn chats
that resend the whole conversation, then an overload of long and short requests with
preemption on and off. Writes ``benchmarks/results/prefix_reuse.md`` and ``.json``, and
puts the section at the end of BENCHMARKS.md (``side_by_side.py`` keeps it there).

    python benchmarks/prefix_reuse.py               # everything (about an hour on 2 cores)
    python benchmarks/prefix_reuse.py --streams 8 --repeats 1 --skip-chat --skip-overload
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import logging
import os
import shlex
import sys
from pathlib import Path

from side_by_side import REF_BIN, ROOT, Setup, portable, run_ours, run_server, write_benchmarks

from engine import EngineConfig
from engine.bench import (
    SHARED_PROMPTS,
    BenchResult,
    OverloadResult,
    TurnStats,
    default_requests,
    machine_info,
    median_spread,
    percentile,
    run_conversations,
    run_overload,
    summarize_overload,
)
from engine.scheduler.params import default_model_path
from engine.session import Model, Runtime

RESULTS = ROOT / "benchmarks" / "results"


def _med(values: list[float]) -> tuple[float, float, float]:
    return median_spread(values) or (float("nan"),) * 3


def _mid(runs: list[BenchResult]) -> BenchResult:
    """The run with the median throughput."""
    return sorted(runs, key=lambda x: x.tokens_per_s)[(len(runs) - 1) // 2]


def _fmt(m: tuple[float, float, float]) -> str:
    return f"**{m[0]:.2f}** [{m[1]:.2f}, {m[2]:.2f}]"


async def shared_prefix(
    s: Setup, n_values: list[int], repeats: int
) -> tuple[list[str], list[dict], list[str]]:
    """Per N, ``repeats`` interleaved rounds of: llama-server (cache_prompt), ours with the
    prefix cache, ours without."""
    rows, lines, commands = [], [], []
    for n in n_values:
        requests = s.requests(n, default_requests(n))
        runs: dict[str, list[BenchResult]] = {"server": [], "on": [], "off": []}
        for rep in range(repeats):
            print(
                f"shared prefix N={n} repeat {rep + 1}/{repeats}: llama-server, ours on, ours off", flush=True
            )
            srv, _, cmd = await run_server(s, n, "none", requests, cache_prompt=True)
            if rep == 0:
                commands.append(cmd)
            runs["server"].append(srv)
            runs["on"].append((await run_ours(s, n, "none", requests, prefix_cache=True))[0])
            runs["off"].append((await run_ours(s, n, "none", requests, prefix_cache=False))[0])
        on, off, srv_runs = runs["on"], runs["off"], runs["server"]
        ttft = [percentile(b.ttft, 0.5) / percentile(a.ttft, 0.5) for a, b in zip(on, off, strict=True)]
        tput = [a.tokens_per_s / b.tokens_per_s for a, b in zip(on, off, strict=True)]
        vs_srv = [a.tokens_per_s / b.tokens_per_s for a, b in zip(on, srv_runs, strict=True)]
        vs_srv_ttft = [
            percentile(b.ttft, 0.5) / percentile(a.ttft, 0.5) for a, b in zip(on, srv_runs, strict=True)
        ]
        m_on, m_off, m_srv = _mid(on), _mid(off), _mid(srv_runs)
        cached = m_on.cached_tokens / m_on.prompt_tokens if m_on.prompt_tokens else 0.0
        lines.append(
            f"| {n} | {m_off.tokens_per_s:.1f} | {m_on.tokens_per_s:.1f} | {m_srv.tokens_per_s:.1f} "
            f"| {percentile(m_off.ttft, 0.5):.2f} / {percentile(m_off.ttft, 0.9):.2f} "
            f"| {percentile(m_on.ttft, 0.5):.2f} / {percentile(m_on.ttft, 0.9):.2f} "
            f"| {percentile(m_srv.ttft, 0.5):.2f} / {percentile(m_srv.ttft, 0.9):.2f} | {cached:.0%} "
            f"| {_fmt(_med(ttft))} | {_fmt(_med(tput))} | {_fmt(_med(vs_srv))} | {_fmt(_med(vs_srv_ttft))} |"
        )
        rows.append(
            {
                "n": n,
                "ours_on": [r.as_dict() for r in on],
                "ours_off": [r.as_dict() for r in off],
                "llama_server_cache_prompt": [r.as_dict() for r in srv_runs],
                "ttft_p50_off_over_on": _med(ttft),
                "throughput_on_over_off": _med(tput),
                "throughput_on_over_server": _med(vs_srv),
                "ttft_p50_server_over_on": _med(vs_srv_ttft),
            }
        )
    head = [
        "| N | tok/s, reuse off | tok/s, reuse on | tok/s, llama-server | TTFT p50 / p90 s, off "
        "| TTFT p50 / p90 s, on | TTFT p50 / p90 s, server | prompt tokens cached (on) "
        "| TTFT p50 off ÷ on | tok/s on ÷ off | tok/s on ÷ server | TTFT p50 server ÷ on |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    return head + lines, rows, commands


def chat_table(stats: list[TurnStats]) -> list[str]:
    lines = [
        "| turn | prompt tokens sent | prefilled, cache on | cached, on | prefilled, cache off "
        "| TTFT p50 s, on | TTFT p50 s, off |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    on = {s.turn: s for s in stats if s.prefix_cache}
    off = {s.turn: s for s in stats if not s.prefix_cache}
    for t in sorted(on):
        a, b = on[t], off.get(t)
        sent = sum(a.prompt_tokens) / max(len(a.prompt_tokens), 1)
        lines.append(
            f"| {t} | {sent:.0f} | {a.prefilled:.0f} | {a.cached_share:.0%} "
            f"| {b.prefilled if b else float('nan'):.0f} | {percentile(a.ttft, 0.5):.3f} "
            f"| {percentile(b.ttft, 0.5) if b else float('nan'):.3f} |"
        )
    return lines


def overload_table(results: list[OverloadResult]) -> list[str]:
    lines = [
        "| preemption | tok/s | preemptions | short TTFT p50 / p90 / p99 s | long TTFT p50 / p90 / p99 s |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {'on' if r.preemption else 'off'} | {r.tokens_per_s:.1f} | {r.preemptions} | "
            + " / ".join(f"{percentile(r.short_ttft, q):.2f}" for q in (0.5, 0.9, 0.99))
            + " | "
            + " / ".join(f"{percentile(r.long_ttft, q):.2f}" for q in (0.5, 0.9, 0.99))
            + " |"
        )
    return lines


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="GGUF (default: Gemma 3 270M from the demo extra)")
    ap.add_argument("--streams", default="1,8,32")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats of every row")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--n-ctx", type=int, default=2048, help="context per sequence")
    ap.add_argument("--skip-chat", action="store_true")
    ap.add_argument("--skip-overload", action="store_true")
    ap.add_argument("--out", default=str(RESULTS / "prefix_reuse.md"))
    args = ap.parse_args()
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING)
    if not (REF_BIN / "llama-server").exists():
        sys.exit("build the reference tools first: ./benchmarks/build_reference.sh")
    model = str(args.model or default_model_path())
    with Runtime() as rt:
        m = Model.load(rt, model)
        prompts = [m.tokenize(p, add_special=True) for p in SHARED_PROMPTS]
    s = Setup(model, prompts, args.max_tokens, args.threads, args.n_ctx, 3, 4)
    n_values = [int(x) for x in args.streams.split(",")]
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    machine = machine_info()
    command = "python benchmarks/prefix_reuse.py " + shlex.join(sys.argv[1:])
    report: dict = {"date": date, "machine": machine, "model": Path(model).name, "command": command}

    table, rows, commands = await shared_prefix(s, n_values, args.repeats)
    report["shared_prefix"] = rows
    md = [
        "## Prefix reuse and preemption",
        "",
        f"Measured {date} on {machine.get('cpu', '?')} ({machine.get('cores', '?')} cores), model "
        f"`{Path(model).name}`, {args.threads} threads, greedy, no speculation; one process at a time. "
        f"Ratios are medians of {args.repeats} interleaved repeats [min, max].",
        "",
        "**Shared prefix**: a ~1,000-token system prompt (`engine.bench.SHARED_SYSTEM`) "
        f"and distinct short questions (192 in all, none repeated) ({len(prompts[0])} tokens per prompt with BOS), {args.max_tokens} "
        "tokens out (end-of-generation ignored), N closed-loop clients, 4N requests (at least 8), the "
        "throughput of the steady window. Ours with `EngineConfig(prefix_cache=True)` (the default) and "
        '`False`; llama-server with `"cache_prompt": true` and its default slot choice (the most similar '
        "slot's prompt), the same `-np N` slots, `--swa-full`, no host prompt cache (`--cache-ram 0`). "
        "The cached share counts every request: each client's first request finds nothing cached (N of the 4N).",
        "",
        *table,
    ]
    if not args.skip_chat:
        stats: list[TurnStats] = []
        for cache in (True, False):
            print(f"chat: 8 conversations x 6 turns, prefix cache {'on' if cache else 'off'}", flush=True)
            cfg = EngineConfig(
                model=model, n_seq=8, n_ctx=args.n_ctx, threads=args.threads, prefix_cache=cache
            )
            stats += await run_conversations(cfg, 8, 6, 32)
        report["chat"] = [t.as_dict() for t in stats]
        md += [
            "",
            "**Multi-turn chat**: 8 conversations at once on 8 slots, 6 turns each, every turn sending the "
            "whole conversation again in the model's chat template (as OpenAI-style clients do): the system "
            "prompt above, the turns so far and a new user message, 32 tokens per reply. Prompt tokens actually prefilled per request, mean over the "
            "8 conversations (`python -m engine bench --chat --prefix-cache on,off --max-tokens 32 "
            f"--n-ctx {args.n_ctx}`):",
            "",
            *chat_table(stats),
        ]
    if not args.skip_overload:
        results: list[OverloadResult] = []
        for rep in range(args.repeats):
            for preemption in (True, False):
                print(f"overload repeat {rep + 1}/{args.repeats}: preemption {preemption}", flush=True)
                cfg = EngineConfig(
                    model=model, n_seq=4, n_ctx=args.n_ctx, threads=args.threads, preemption=preemption
                )
                results.append(await run_overload(cfg, 32, 8, 512, 16))
        report["overload"] = [r.as_dict() for r in results]
        summary = summarize_overload(results).splitlines()[-1]
        md += [
            "",
            "**Overload**: 4 slots, 32 closed-loop clients sending 2 requests each: 8 of them long "
            "(512 tokens), 24 short (16 tokens), greedy. Preemption with the default time slice "
            "(`EngineConfig(time_slice=5.0)`: a request that held its slot 5 s while others wait is "
            "swapped out to host memory and resumed later) against none "
            "(`python -m engine bench --overload --repeats 3`):",
            "",
            *overload_table(results),
            "",
            summary.strip(),
        ]
    md += ["", "Commands:", "", f"    {command}", *[f"    {portable(c, model)}" for c in commands], ""]
    Path(args.out).write_text("\n".join(md))
    Path(args.out).with_suffix(".json").write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    if Path(args.out).resolve() == RESULTS / "prefix_reuse.md":  # a part of BENCHMARKS.md
        write_benchmarks()
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
