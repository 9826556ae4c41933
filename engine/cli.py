"""Command line: ``python -m engine run|bench``. Errors are one line, not a traceback."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from pathlib import Path

import structlog

from .bench import PROMPTS, measure_raw, run_load, summarize
from .scheduler import Engine, EngineConfig, SamplingParams
from .scheduler.params import default_model_path
from .session import SessionError, SpeculativeConfig

__all__ = ["main"]


def _engine_config(args: argparse.Namespace, speculative: str, n_seq: int) -> EngineConfig:
    spec = SpeculativeConfig(
        speculative,
        n_seq=n_seq,
        n_draft_max=args.n_draft,
        ngram_size_n=args.ngram_n,
        ngram_size_m=args.n_draft,
    )
    return EngineConfig(
        model=args.model,
        draft_model=args.draft if spec.needs_draft_model else None,
        speculative=spec,
        n_seq=n_seq,
        n_ctx=args.n_ctx,
        threads=args.threads,
    )


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, help="target GGUF (default: Gemma 3 270M, from the demo extra)")
    p.add_argument("--draft", type=Path, help="draft GGUF for --spec draft / eagle3 / dflash")
    p.add_argument("--n-draft", type=int, default=6, help="most draft tokens per step (default 6)")
    p.add_argument("--ngram-n", type=int, default=3, help="n-gram key length for n-gram drafters (default 3)")
    p.add_argument("--n-ctx", type=int, default=1024, help="context per sequence (default 1024)")
    p.add_argument("--threads", type=int, help="CPU threads (default: all cores)")


async def _run(args: argparse.Namespace) -> int:
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    async with Engine(_engine_config(args, args.spec, 1)) as engine:
        final = None
        async for delta in engine.stream(
            prompt, SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
        ):
            sys.stdout.write(delta.text)
            sys.stdout.flush()
            final = delta
        m = engine.metrics
        print(
            f"\n\n[{args.spec}] finish={final.finish_reason if final else None} "
            f"tokens={m.generated_tokens} drafted={m.drafted} accepted={m.accepted} "
            f"acceptance={m.acceptance_rate:.1%} steps={m.steps}",
            file=sys.stderr,
        )
    return 0


async def _bench(args: argparse.Namespace) -> int:
    n_values = [int(x) for x in args.streams.split(",")]
    model = str(args.model or default_model_path())
    args.model = model
    print(f"model: {model}\nraw batched decode (llama.cpp, no scheduling) at N = {n_values} ...", flush=True)
    raw = await asyncio.to_thread(measure_raw, model, n_values, args.threads)
    results = []
    for spec in args.spec.split(","):
        for n in n_values:
            n_req = max(n, args.requests)
            print(f"engine: {spec:>14} N={n:<3} {n_req} requests x {args.max_tokens} tokens ...", flush=True)
            r = await run_load(_engine_config(args, spec, n), n, n_req, args.max_tokens, PROMPTS)
            r.raw_tokens_per_s = raw[n]
            results.append(r)
    print()
    print(summarize(results))
    if args.json:
        Path(args.json).write_text(json.dumps([r.as_dict() for r in results], indent=2))
        print(f"\nwrote {args.json}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m engine", description="Speculative-decoding serving engine on llama.cpp."
    )
    sub = ap.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="stream one completion to the terminal")
    run.add_argument("prompt", nargs="?", help="the prompt (default: read stdin)")
    run.add_argument("--spec", default="ngram-simple", help="speculative type (default ngram-simple)")
    run.add_argument("--max-tokens", type=int, default=256)
    run.add_argument("--temperature", type=float, default=0.0)
    _add_model_args(run)
    bench = sub.add_parser("bench", help="N concurrent streams, speculation on/off, vs raw decode")
    bench.add_argument("--streams", default="1,4,16,64", help="comma-separated N (default 1,4,16,64)")
    bench.add_argument(
        "--spec",
        default="none,ngram-simple",
        help="comma-separated speculative types (default none,ngram-simple)",
    )
    bench.add_argument("--requests", type=int, default=8, help="requests per N (at least N; default 8)")
    bench.add_argument("--max-tokens", type=int, default=48)
    bench.add_argument("--json", help="also write the results as JSON to this file")
    _add_model_args(bench)
    args = ap.parse_args(argv)
    if not logging.getLogger().handlers:
        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    try:
        return asyncio.run(_run(args) if args.command == "run" else _bench(args))
    except SessionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
