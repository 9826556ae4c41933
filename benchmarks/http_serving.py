"""Serving over HTTP, measured: our server (``python -m engine serve``) against llama-server's
``/v1`` endpoints, both driven by the same OpenAI-client load (``engine.bench.run_http_load``,
what ``python -m engine bench --url`` runs), and against the same engine in-process (the
HTTP layer's overhead). Writes ``benchmarks/results/http.md`` and ``.json`` and puts the
section into BENCHMARKS.md.

    ./benchmarks/build_reference.sh             # llama-server
    python benchmarks/http_serving.py           # N = 1, 4, 16, 64, 3 interleaved repeats
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import logging
import math
import os
import pickle
import shlex
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from side_by_side import (
    PARTS,
    REF_BIN,
    ROOT,
    Setup,
    _free_port,
    portable,
    server_command,
    server_process,
    write_benchmarks,
)

from engine import EngineConfig
from engine.bench import (
    PROMPTS,
    BenchResult,
    default_requests,
    machine_info,
    median_spread,
    percentile,
    run_http_load,
    run_load,
)
from engine.scheduler.params import default_model_path

RESULTS = ROOT / "benchmarks" / "results"


def ours_command(s: Setup, n: int, port: int) -> list[str]:
    return [
        sys.executable, "-m", "engine", "serve", "--model", s.model, "--port", str(port),
        "--spec", "none", "--n-seq", str(n), "--n-ctx", str(s.n_ctx), "--threads", str(s.threads),
    ]  # fmt: skip


SIDES = ("inproc", "ours", "server")


async def measure(
    s: Setup, n: int, prompts: list[str], requests: int, sides: list[str]
) -> dict[str, BenchResult]:
    """One interleaved round at N: in-process, our server, llama-server (those in ``sides``).
    Every load runs in a fresh client process of its own, so no side inherits another's
    process state (the in-process engine's, or a previous run's)."""
    out = {}
    load = {"n": n, "requests": requests, "max_tokens": s.max_tokens, "prompts": prompts}
    if "inproc" in sides:
        config = {"model": s.model, "n_seq": n, "n_ctx": s.n_ctx, "threads": s.threads}
        out["inproc"] = await _in_child({**load, "engine": config})
    for side, command in (
        ("ours", ours_command),
        ("server", lambda s, n, port: server_command(s, n, "none", port)),
    ):
        if side in sides:
            port = _free_port()
            async with server_process(command(s, n, port), port, f"http-{side}-{n}.log") as url:
                out[side] = await _in_child({**load, "url": f"{url}/v1"})
    return out


async def _in_child(job: dict[str, Any]) -> BenchResult:
    """Run one load (``url``: over HTTP; ``engine``: in-process) in a child process."""
    with tempfile.TemporaryDirectory() as tmp:
        spec, result = Path(tmp) / "job.json", Path(tmp) / "result.pickle"
        spec.write_text(json.dumps(job))
        cmd = [sys.executable, __file__, "--child", str(spec), str(result)]
        proc = await asyncio.create_subprocess_exec(*cmd)
        if await proc.wait() != 0:
            raise RuntimeError(f"the load process failed ({proc.returncode})")
        loaded: BenchResult = pickle.loads(result.read_bytes())
        return loaded


async def _child(spec: Path, result: Path) -> None:
    job = json.loads(spec.read_text())
    n, requests, max_tokens, prompts = job["n"], job["requests"], job["max_tokens"], job["prompts"]
    if "url" in job:
        r = await run_http_load(job["url"], n, requests, max_tokens, prompts)
    else:
        r = await run_load(EngineConfig(**job["engine"]), n, requests, max_tokens, prompts)
    result.write_bytes(pickle.dumps(r))


def _fmt(m: tuple[float, float, float] | None) -> str:
    return "-" if m is None else f"**{m[0]:.2f}** [{m[1]:.2f}, {m[2]:.2f}]"


def _mid(values: list[float]) -> float:
    m = median_spread(values)
    return m[0] if m else float("nan")


Round = dict[str, BenchResult]


def _col(rs: list[Round], side: str, f: Callable[[BenchResult], float]) -> float:
    """The median over the rounds of ``f`` of one side (nan when it did not run)."""
    return _mid([f(r[side]) for r in rs]) if side in rs[0] else float("nan")


def _ratio(rs: list[Round], a: str, b: str) -> str:
    """Throughput of ``a`` ÷ ``b`` per round: median [min, max]."""
    ok = a in rs[0] and b in rs[0]
    return _fmt(median_spread([r[a].tokens_per_s / r[b].tokens_per_s for r in rs]) if ok else None)


def _n(value: float, fmt: str) -> str:
    return "-" if math.isnan(value) else format(value, fmt)


def _tps(r: BenchResult) -> float:
    return r.tokens_per_s


def _ttft(r: BenchResult) -> float:
    return percentile(r.ttft, 0.5)


def _itl(r: BenchResult) -> float:
    return 1000 * percentile(r.itl, 0.5)


async def main() -> int:
    if sys.argv[1:2] == ["--child"]:
        await _child(Path(sys.argv[2]), Path(sys.argv[3]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="GGUF (default: Gemma 3 270M from the demo extra)")
    ap.add_argument("--streams", default="1,4,16,64")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--n-ctx", type=int, default=1024, help="context per sequence")
    ap.add_argument("--sides", default=",".join(SIDES), help=f"which of {', '.join(SIDES)} to run")
    ap.add_argument("--out", default=str(RESULTS / "http.md"))
    args = ap.parse_args()
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING)
    if not (REF_BIN / "llama-server").exists():
        sys.exit("build the reference tools first: ./benchmarks/build_reference.sh")
    model = str(args.model or default_model_path())
    s = Setup(model, [], args.max_tokens, args.threads, args.n_ctx, 3, 4)
    prompts = list(PROMPTS)
    n_values = [int(x) for x in args.streams.split(",")]
    runs: dict[int, list[dict[str, BenchResult]]] = {n: [] for n in n_values}
    for rep in range(args.repeats):  # interleaved: every N, every side, then again
        for n in n_values:
            print(
                f"N={n} repeat {rep + 1}/{args.repeats}: in-process, ours over HTTP, llama-server", flush=True
            )
            r = await measure(s, n, prompts, default_requests(n), args.sides.split(","))
            runs[n].append(r)
            print(
                "   " + ", ".join(f"{k} {v.tokens_per_s:.1f} tok/s" for k, v in r.items()),
                flush=True,
            )
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    machine = machine_info()
    command = "python benchmarks/http_serving.py " + shlex.join(sys.argv[1:])
    rows, table = [], []
    for n in n_values:
        rs = runs[n]
        table.append(
            f"| {n} | {_n(_col(rs, 'inproc', _tps), '.1f')} | {_n(_col(rs, 'ours', _tps), '.1f')} | "
            f"{_ratio(rs, 'ours', 'inproc')} | {_n(_col(rs, 'server', _tps), '.1f')} | {_ratio(rs, 'ours', 'server')} | "
            f"{_n(_col(rs, 'ours', _ttft), '.3f')} / {_n(_col(rs, 'server', _ttft), '.3f')} | "
            f"{_n(_col(rs, 'ours', _itl), '.0f')} / {_n(_col(rs, 'server', _itl), '.0f')} |"
        )
        rows.append({"n_streams": n, "runs": [{k: v.as_dict() for k, v in r.items()} for r in rs]})
    sides = args.sides.split(",")
    md = [
        "## Serving over HTTP" if "server" in sides else f"### Serving over HTTP: {', '.join(sides)} only",
        "",
        f"Measured {date} on {machine.get('cpu', '?')} ({machine.get('cores', '?')} cores), model "
        f"`{Path(model).name}`, {args.threads} threads, greedy, no speculation on either side, prefix "
        "reuse at each side's default (ours: the prefix cache; llama-server: `cache_prompt`, per slot); one "
        f"process at a time. N closed-loop clients, 4N requests (at least 8) of {args.max_tokens} tokens "
        "(end-of-generation ignored), mixed prompts sent as text to `/v1/completions` (streamed) by the same "
        "client (`engine.bench.run_http_load`, a new connection per request; every load in a fresh client "
        f"process); throughput of the steady window. Ratios are medians of {args.repeats} interleaved repeats "
        "[min, max]. In-process: the same "
        "engine and load through `engine.stream`, no HTTP.",
        "",
        "| N | in-process tok/s | our server tok/s | ours HTTP ÷ in-process | llama-server tok/s | "
        "ours ÷ llama-server | TTFT p50 s, ours / server | ITL p50 ms, ours / server |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
        *table,
        "",
        "Commands (per N; the server processes are started fresh for every run):",
        "",
        f"    {command}",
        f"    {portable(shlex.join(['python', *ours_command(s, 64, 8000)[1:]]), model)}",
        f"    {portable(shlex.join(server_command(s, 64, 'none', 8080)), model)}",
        "    python -m engine bench --url http://127.0.0.1:8000/v1 --streams 64",
        "",
    ]
    Path(args.out).write_text("\n".join(md))
    report = {"date": date, "machine": machine, "model": Path(model).name, "command": command, "rows": rows}
    Path(args.out).with_suffix(".json").write_text(json.dumps(report, indent=2))
    print("\n".join(md))
    if Path(args.out).resolve() in PARTS:  # a part of BENCHMARKS.md
        write_benchmarks()
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
