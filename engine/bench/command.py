"""``python -m engine bench``: the load test of the command line (its arguments are parsed
in :mod:`engine.cli`), its console report, JSON and plot."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import itertools
import json
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio

from ..models import resolve_model
from ..scheduler import EngineConfig
from ..scheduler.params import default_model_path
from .load import (
    BenchResult,
    KeptEngines,
    default_requests,
    load_prompts,
    machine_info,
    measure_raw,
    run_http_load,
    run_load,
)
from .report import plot, speedups, summarize, summarize_overload, summarize_turns
from .scenarios import run_conversations, run_http_conversations, run_overload

__all__ = ["bench"]

#: the engine a run serves from: (args, speculative type, n_seq, prefix cache)
EngineConfigOf = Callable[..., EngineConfig]


def _echo(args: argparse.Namespace) -> Callable[..., None]:
    """Where the command's report goes: the stream its caller gives (``args.stdout``; the
    command line's is its standard output), never this process's stdout by default."""
    return functools.partial(print, file=args.stdout, flush=True)


def _progress(total: int | None, desc: str) -> tuple[Callable[[int], None] | None, Callable[[], None]]:
    """A progress bar on stderr: (called per finished request, close)."""
    try:
        from tqdm import tqdm
    except ImportError:  # the demo extra brings tqdm; without it, no bar
        return None, lambda: None
    bar = tqdm(total=total, desc=desc, unit="req", file=sys.stderr, leave=False, dynamic_ncols=True)

    def tick(_tokens: int) -> None:
        bar.update(1)

    return tick, bar.close


async def bench(args: argparse.Namespace, engine_config: EngineConfigOf) -> int:
    """``python -m engine bench``: the load test ``args`` describes; ``engine_config(args,
    spec, n_seq, prefix_cache)`` is the engine each run serves from."""
    echo = _echo(args)
    n_values = [int(x) for x in args.streams.split(",")]
    specs = args.spec.split(",")
    prompts = load_prompts(args.prompts)
    if args.interleave and args.duration:
        raise SystemExit("--interleave takes --requests, not --duration")
    if args.url:
        model = str(args.model or "")
    else:  # (a name as every command takes it: fetched, then its path)
        model = str(resolve_model(args.model) if args.model else default_model_path())
    args.model = model
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    caches = {"on": [True], "off": [False], "on,off": [True, False], "off,on": [False, True]}.get(
        args.prefix_cache
    )
    if caches is None or (args.no_prefix_cache and args.prefix_cache != "on"):
        raise SystemExit("--prefix-cache takes on, off or on,off (and replaces --no-prefix-cache)")
    if args.no_prefix_cache:
        caches = [False]
    if args.chat:
        echo(f"model: {model}")
        return await _bench_chat(args, engine_config, specs[0], caches, model, out)
    if args.overload:
        echo(f"model: {model}")
        return await _bench_overload(args, engine_config, specs[0], model, out)
    if args.url:
        return await _bench_url(args, n_values, prompts, out)
    echo(f"model: {model}\nraw batched decode (llama.cpp, no scheduling) at N = {n_values} ...")
    raw = await anyio.to_thread.run_sync(measure_raw, model, n_values, args.threads)
    results: list[BenchResult] = []
    for n in n_values:
        async with KeptEngines(prompts) as kept:  # (--interleave: each variant's engine, this N)
            for rep in range(args.repeats):
                # interleaved A, B, B, A, ...: the machine drifts, and a fixed order would
                # favour whichever side always runs first
                variants = list(itertools.product(specs, caches))
                for spec, cache in variants if rep % 2 == 0 else reversed(variants):
                    n_req = None if args.duration else (args.requests or default_requests(n))
                    what = f"{args.duration:g} s" if args.duration else f"{n_req} requests"
                    label = f" repeat {rep + 1}/{args.repeats}" if args.repeats > 1 else ""
                    name = spec if cache else f"{spec} no-cache"
                    echo(f"engine: {name:>23} N={n:<3} {what} x {args.max_tokens} tokens{label} ...")
                    config = engine_config(args, spec, args.n_seq or n, cache)
                    if args.interleave and n_req is not None:  # (in its own process: no progress bar)
                        r = await kept.load(config, n, n_req, args.max_tokens, first=rep * n_req)
                    else:
                        tick, close = _progress(n_req, f"{name} N={n}")
                        r = await run_load(
                            config, n, n_req, args.max_tokens, prompts, progress=tick, duration=args.duration
                        )
                        close()
                    r.raw_tokens_per_s = raw[n]
                    results.append(r)
    echo()
    echo(summarize(results))
    _write_report(
        args,
        model,
        out / "bench.json",
        settings={
            "streams": n_values,
            "speculative": specs,
            "prefix_cache": caches,
            "prompts": args.prompts,
            "max_tokens": args.max_tokens,
            "requests": args.requests,
            "repeats": args.repeats,
            "duration": args.duration,
            "interleave": args.interleave,
            "n_seq": args.n_seq,
            "n_draft": args.n_draft,
            "threads": args.threads,
        },
        results=[r.as_dict() for r in results],
        speedups=[
            {
                "n_streams": n,
                "speculative": spec,
                "median": round(m, 3),
                "min": round(lo, 3),
                "max": round(hi, 3),
            }
            for n, spec, m, lo, hi in speedups(results)
        ],
    )
    try:
        plot(
            results,
            out / "bench.png",
            title=f"{Path(model).name}, {args.prompts} prompts, {args.max_tokens} tokens",
        )
        echo(f"wrote {out / 'bench.png'}")
    except ImportError:
        echo("no plot: matplotlib is missing (pip install 'llama-spec-engine[demo]')")
    return 0


async def _bench_url(args: argparse.Namespace, n_values: list[int], prompts: list[Any], out: Path) -> int:
    """The same closed-loop load against an OpenAI-compatible server (ours, llama-server, vLLM)."""
    echo = _echo(args)
    echo(f"server: {args.url} (its own model and speculative settings)")
    results: list[BenchResult] = []
    for n in n_values:
        for rep in range(args.repeats):
            n_req = None if args.duration else (args.requests or default_requests(n))
            what = f"{args.duration:g} s" if args.duration else f"{n_req} requests"
            label = f" repeat {rep + 1}/{args.repeats}" if args.repeats > 1 else ""
            echo(f"http: N={n:<3} {what} x {args.max_tokens} tokens{label} ...")
            tick, close = _progress(n_req, f"http N={n}")
            r = await run_http_load(
                args.url,
                n,
                n_req,
                args.max_tokens,
                prompts,
                progress=tick,
                duration=args.duration,
                api_key=args.api_key,
                model=args.served_model,
            )
            close()
            results.append(r)
    echo()
    echo(summarize(results))
    _write_report(
        args,
        args.served_model or args.url,
        out / "bench-http.json",
        settings={
            "url": args.url,
            "streams": n_values,
            "prompts": args.prompts,
            "max_tokens": args.max_tokens,
        },
        results=[r.as_dict() for r in results],
    )
    try:
        plot(
            results,
            out / "bench-http.png",
            title=f"{args.url}, {args.prompts} prompts, {args.max_tokens} tokens",
        )
    except ImportError:
        pass
    return 0


async def _bench_chat(
    args: argparse.Namespace,
    engine_config: EngineConfigOf,
    spec: str,
    caches: list[bool],
    model: str,
    out: Path,
) -> int:
    echo = _echo(args)
    stats = []
    if args.url:  # a server or a cluster: its own model and cache settings
        echo(f"server: {args.url}: {args.conversations} conversations x {args.turns} turns ...")
        stats = await run_http_conversations(
            args.url,
            args.conversations,
            args.turns,
            args.max_tokens,
            api_key=args.api_key,
            model=args.served_model,
        )
        caches = []
    for cache in caches:
        echo(
            f"engine: {args.conversations} conversations x {args.turns} turns, whole conversation resent, "
            f"prefix cache {'on' if cache else 'off'} ...",
        )
        stats += await run_conversations(
            engine_config(args, spec, args.n_seq or args.conversations, cache),
            args.conversations,
            args.turns,
            args.max_tokens,
        )
    echo()
    echo(summarize_turns(stats))
    _write_report(args, model, out / "bench-chat.json", turns=[s.as_dict() for s in stats])
    return 0


async def _bench_overload(
    args: argparse.Namespace, engine_config: EngineConfigOf, spec: str, model: str, out: Path
) -> int:
    echo = _echo(args)
    n_seq = args.n_seq or 4
    results = []
    for rep in range(args.repeats):  # interleaved: on, off, off, on, ... (see above)
        for preemption in (True, False) if rep % 2 == 0 else (False, True):
            echo(
                f"engine: {args.clients} clients ({args.clients // 4} long: {args.long_tokens} tokens, the rest "
                f"{args.max_tokens}) on {n_seq} slots, preemption {'on' if preemption else 'off'}"
                f"{f' repeat {rep + 1}/{args.repeats}' if args.repeats > 1 else ''} ...",
            )
            config = dataclasses.replace(engine_config(args, spec, n_seq), preemption=preemption)
            results.append(
                await run_overload(config, args.clients, args.clients // 4, args.long_tokens, args.max_tokens)
            )
    echo()
    echo(summarize_overload(results))
    _write_report(args, model, out / "bench-overload.json", runs=[r.as_dict() for r in results])
    return 0


def _write_report(args: argparse.Namespace, model: str, path: Path, **fields: Any) -> None:
    """A bench run's JSON: when, on what, the command, then ``fields``."""
    echo = _echo(args)
    report = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "model": Path(model).name,
        "machine": machine_info(),
        "command": "python -m engine " + shlex.join(args.argv),
        **fields,
    }
    path.write_text(json.dumps(report, indent=2))
    echo(f"\nwrote {path}")
