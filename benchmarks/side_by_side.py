"""Side-by-side benchmark: our engine against llama.cpp's own tools and llama-cpp-python,
in one run, on the same machine, model, prompts (as token ids) and token counts.

1. raw decode ceiling: ``llama-batched-bench`` (the pinned tree's, see build_reference.sh)
   at the same batch sizes: text-generation tokens/s with no scheduling at all;
2. ``llama-server`` (same tree) with ``-np N`` and the same speculative settings, driven
   by N concurrent streaming HTTP clients;
3. our engine with N concurrent streams;
4. llama-cpp-python (PyPI, in its own virtual environment) answering the same requests one
   after another: what Python users have today.

Greedy everywhere, end-of-generation ignored, every request ``--max-tokens`` long. As a
correctness cross-check, our greedy tokens and llama-server's must match exactly with
speculation off and one stream (identical batch shapes); at higher N the agreement rate is
reported (llama.cpp is not batch-invariant on quantized models).

    pip install -e ".[demo]" httpx
    ./benchmarks/build_reference.sh            # llama-server, llama-batched-bench
    python benchmarks/side_by_side.py --setup-llama-cpp-python
    python benchmarks/side_by_side.py          # writes BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from side_by_side_report import plot_speculation, report, speculation_table, update_readme

from engine import EngineConfig, SpeculativeConfig
from engine.bench import (
    BenchResult,
    Send,
    closed_loop,
    default_requests,
    load_prompts,
    machine_info,
    medians,
    paired_ratio,
    run_load,
    speedups,
)
from engine.cli import DEFAULT_N_DRAFT, DEFAULT_NGRAM_N
from engine.scheduler.params import default_model_path
from engine.session import Model, Runtime
from engine.workloads import prompt_of

#: each request's generated tokens (None: not run)
Outputs = list[list[int] | None]

ROOT = Path(__file__).resolve().parent.parent
REF_BIN = ROOT / "build" / "reference" / "bin"
LCP_VENV = ROOT / "build" / "llama-cpp-python-venv"
LCP_VERSION = "0.3.36"  # the release whose source distribution pins our llama.cpp
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


#: the sections other scripts write, in the order BENCHMARKS.md ends with them
PARTS = [
    ROOT / "benchmarks" / "results" / name
    for name in (
        "prompt_sets.md",  # (benchmarks/prompt_sets.py)
        "paired.md",  # (benchmarks/paired.py)
        "draft_pair.md",  # (benchmarks/draft_pair.py)
        "idle_cost.md",  # (benchmarks/idle_cost.py)
        "idle_cost_gemma.md",  # (benchmarks/idle_cost.py --streams '' --real gemma:64)
        "idle_cost_coder.md",  # (benchmarks/idle_cost.py --streams '' --real coder:1,4)
        "speculation_notes.md",  # (written by hand)
        "prefix_reuse.md",
        "http.md",
        "http_overhead.md",
        "scale_out.md",
        "deterministic.md",  # (benchmarks/deterministic.py)
    )  # (http_serving.py --sides inproc,ours)
]


def write_benchmarks(head: str | None = None) -> None:
    """BENCHMARKS.md: this script's part (``head``, or what the file holds before the first
    other section), then every part in :data:`PARTS` that exists."""
    bench = ROOT / "BENCHMARKS.md"
    if head is None:
        head = bench.read_text()
        for part in PARTS:
            if part.exists():
                heading = part.read_text().split("\n", 1)[0]
                head = head.split("\n" + heading + "\n", 1)[0]
    parts = [part.read_text().strip("\n") for part in PARTS if part.exists()]
    bench.write_text("\n\n".join([head.rstrip("\n"), *parts]) + "\n")
    print(f"wrote {bench}")


@dataclass
class Setup:
    model: str
    prompts: list[list[int]]  # token ids, BOS included
    max_tokens: int
    threads: int
    n_ctx: int  # per sequence
    n_draft: int
    ngram_n: int
    draft: str | None = None  #: a draft model's path (``--spec-type draft-simple``)

    def requests(self, n: int, per_n: int) -> list[list[int]]:
        """The prompts of a load's requests, in the order every side sends them."""
        return [prompt_of(self.prompts, i) for i in range(max(n, per_n))]


# --- 1. llama-batched-bench -----------------------------------------------------------
def raw_ceiling(s: Setup, n_values: list[int], repeats: int = 3) -> tuple[dict[int, float], str]:
    pp = round(sum(len(p) for p in s.prompts) / len(s.prompts))
    cmd = [
        str(REF_BIN / "llama-batched-bench"),
        "-m", s.model,
        "-c", str(max(n_values) * (pp + s.max_tokens + 16)),
        "-b", "512", "-ub", "512",
        "-npp", str(pp), "-ntg", str(s.max_tokens), "-npl", ",".join(map(str, n_values)),
        "-t", str(s.threads), "-tb", str(s.threads),
        "--output-format", "jsonl",
    ]  # fmt: skip
    best: dict[int, float] = {}
    for _ in range(repeats):  # a ceiling: the best of a few runs (this machine is noisy)
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        for r in (json.loads(line) for line in out.splitlines() if line.startswith("{")):
            best[int(r["pl"])] = max(best.get(int(r["pl"]), 0.0), float(r["speed_tg"]))
    return best, shlex.join(cmd)


# --- 2. llama-server ------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def server_command(s: Setup, n: int, spec: str, port: int) -> list[str]:
    cmd = [
        str(REF_BIN / "llama-server"),
        "-m", s.model, "--host", "127.0.0.1", "--port", str(port),
        "-np", str(n), "-c", str(n * s.n_ctx), "-b", "512", "-ub", "512",
        "-t", str(s.threads), "-tb", str(s.threads),
        # the KV layout our engine picks (one buffer up to 16 sequences), no prompt cache;
        # a full-size sliding-window cache as llama_context_default_params() has (the
        # server's smaller one pads attention differently, which flips near-ties)
        "-kvu" if n <= 16 else "-no-kvu", "--swa-full", "--cache-ram", "0", "--no-ui",
    ]  # fmt: skip
    if spec != "none":
        cmd += ["--spec-type", spec, "--spec-draft-n-max", str(s.n_draft)]
        if s.draft is not None:
            cmd += ["--model-draft", s.draft, "-td", str(s.threads), "-tbd", str(s.threads)]
        if spec == "ngram-simple":
            cmd += [
                "--spec-ngram-simple-size-n", str(s.ngram_n),
                "--spec-ngram-simple-size-m", str(s.n_draft),
                "--spec-ngram-simple-min-hits", "1",
            ]  # fmt: skip
    return cmd


def _server_send(
    client: httpx.AsyncClient,
    requests: list[list[int]],
    outputs: Outputs,
    stats: dict[str, int],
    cache_prompt: bool = False,
) -> Send:
    async def send(i: int, max_tokens: int) -> AsyncIterator[list[int]]:
        body = {
            "prompt": requests[i],
            "n_predict": max_tokens,
            "temperature": 0.0,
            "top_k": 1,
            "ignore_eos": True,
            "cache_prompt": cache_prompt,
            "stream": True,
            "return_tokens": True,
        }
        tokens: list[int] = []
        timings: dict[str, Any] = {}
        async with client.stream("POST", "/completion", json=body) as resp:
            resp.raise_for_status()
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                chunk = json.loads(line[6:])
                new = chunk.get("tokens") or []
                tokens += new
                timings = chunk.get("timings") or timings
                yield new  # (one verification's tokens come as back-to-back events: one burst)
        outputs[i] = tokens
        stats["drafted"] += int(timings.get("draft_n", 0))
        stats["accepted"] += int(timings.get("draft_n_accepted", 0))

    return send


@contextlib.asynccontextmanager
async def server_process(cmd: list[str], port: int, log_name: str) -> AsyncIterator[str]:
    """A server process (its output in build/reference/LOG_NAME), up once ``/health``
    answers: its base URL; stopped with SIGINT on the way out."""
    log = open(ROOT / "build" / "reference" / log_name, "w")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            for _ in range(600):
                with contextlib.suppress(httpx.TransportError):
                    if (await client.get("/health")).status_code == 200:
                        break
                if proc.poll() is not None:
                    raise RuntimeError(f"{cmd[0]} exited ({proc.returncode}); see {log.name}")
                await asyncio.sleep(0.2)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


async def run_server(
    s: Setup, n: int, spec: str, requests: list[list[int]], cache_prompt: bool = False
) -> tuple[BenchResult, Outputs, str]:
    """llama-server with ``-np N``, driven by the same closed loop as our engine
    (``cache_prompt``: each slot keeps its prompt for the next request to reuse)."""
    port = _free_port()
    cmd = server_command(s, n, spec, port)
    async with server_process(cmd, port, f"server-{spec}-{n}.log") as url:
        # a new connection per request: llama-server (cpp-httplib) closes kept-alive
        # connections after a few requests, which a pooled client sees as a disconnect
        limits = httpx.Limits(max_connections=n + 1, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
            outputs: list[list[int] | None] = [None] * len(requests)
            stats = {"drafted": 0, "accepted": 0}
            send = _server_send(client, requests, outputs, stats, cache_prompt)
            async for _ in send(0, 4):  # warm-up
                pass
            outputs[0], stats["drafted"], stats["accepted"] = None, 0, 0
            result = await closed_loop(n, len(requests), s.max_tokens, send)
            result.speculative, result.prefix_cache = spec, cache_prompt
            result.drafted, result.accepted = stats["drafted"], stats["accepted"]
    return result, outputs, shlex.join(cmd)


# --- 3. our engine --------------------------------------------------------------------
async def run_ours(
    s: Setup, n: int, spec: str, requests: list[list[int]], prefix_cache: bool = False
) -> tuple[BenchResult, Outputs]:
    config = EngineConfig(
        model=s.model,
        speculative=SpeculativeConfig(
            spec, n_seq=n, n_draft_max=s.n_draft, ngram_size_n=s.ngram_n, ngram_size_m=s.n_draft
        ),
        n_seq=n,
        n_ctx=s.n_ctx,
        threads=s.threads,
        prefix_cache=prefix_cache,  # llama-server here: "cache_prompt" as given
    )
    return await run_ours_config(config, s, n, requests)


async def run_ours_config(
    config: EngineConfig, s: Setup, n: int, requests: list[list[int]]
) -> tuple[BenchResult, Outputs]:
    """Our engine as ``config`` says, under the load the server gets."""
    outputs: dict[int, list[int]] = {}
    # run_load sends request i prompt_of(s.prompts, i): requests[i], as the server got it
    result = await run_load(config, n, len(requests), s.max_tokens, s.prompts, outputs=outputs)
    return result, [outputs.get(i) for i in range(len(requests))]


# --- 4. llama-cpp-python --------------------------------------------------------------
def setup_llama_cpp_python() -> None:
    """A separate virtual environment with llama-cpp-python from PyPI (compiles its own
    copy of the same llama.cpp; AMX off as in our build)."""
    subprocess.run([sys.executable, "-m", "venv", str(LCP_VENV)], check=True)
    env = dict(
        os.environ, CMAKE_ARGS=f"-DGGML_NATIVE=ON -DCMAKE_C_FLAGS='{NO_AMX}' -DCMAKE_CXX_FLAGS='{NO_AMX}'"
    )
    subprocess.run(
        [str(LCP_VENV / "bin" / "pip"), "install", "--no-cache-dir", f"llama-cpp-python=={LCP_VERSION}"],
        check=True,
        env=env,
    )


def llama_cpp_python_ready() -> bool:
    python = LCP_VENV / "bin" / "python"
    return (
        python.exists()
        and subprocess.run([str(python), "-c", "import llama_cpp"], capture_output=True).returncode == 0
    )


def run_llama_cpp_python(s: Setup, spec: str, requests: list[list[int]]) -> tuple[BenchResult, Outputs, str]:
    job = {
        "model": s.model,
        "prompts": requests,
        "max_tokens": s.max_tokens,
        "threads": s.threads,
        "n_ctx": s.n_ctx,
    }
    worker = Path(__file__).parent / "llama_cpp_python_worker.py"
    cmd = [str(LCP_VENV / "bin" / "python"), str(worker)]
    done = subprocess.run(cmd, input=json.dumps(job), capture_output=True, text=True, check=True)
    data = json.loads(done.stdout)
    result = BenchResult(1, spec, 0, 0, float(data["seconds"]))
    for r in data["requests"]:
        result.record(len(r["tokens"]), r["ttft"], r["itl"], r["e2e"])
    return result, [r["tokens"] for r in data["requests"]], f"llama-cpp-python {data['version']}"


# --- measurement ----------------------------------------------------------------------
def portable(command: str, model: str) -> str:
    """A command as committed: paths relative to the repository, the model by file name."""
    return command.replace(model, Path(model).name).replace(str(ROOT) + "/", "")


def agreement(a: Outputs, b: Outputs) -> float:
    """Share of requests whose tokens agree (over the shorter one: the closed loop's ramp
    requests may have different lengths on the two sides)."""
    pairs = [(x, y) for x, y in zip(a, b, strict=True) if x is not None and y is not None]
    same = [x[: min(len(x), len(y))] == y[: min(len(x), len(y))] for x, y in pairs]
    return sum(same) / len(same) if same else float("nan")


async def measure(
    s: Setup, n_values: list[int], specs: list[str], per_n: int | None, repeats: int
) -> dict[str, Any]:
    """One prompt set: the raw ceiling, then per N, ``repeats`` interleaved rounds of every
    speculative type on the server and on ours (server A, ours A, server B, ours B, ...)."""
    print(f"raw ceiling: llama-batched-bench at N = {n_values}", flush=True)
    raw, raw_cmd = raw_ceiling(s, n_values)
    commands = [raw_cmd]
    ours_runs: list[BenchResult] = []
    srv_runs: list[BenchResult] = []
    agree: dict[tuple[int, str], float] = {}
    lcp: dict[str, BenchResult] = {}
    with_lcp = llama_cpp_python_ready()
    lcp_agreement, lcp_out = float("nan"), Outputs()
    if not with_lcp:
        print("no llama-cpp-python (run with --setup-llama-cpp-python first): its column stays empty")
    elif "none" in specs:
        print("llama-cpp-python: one request after another", flush=True)
        lcp["none"], lcp_out, version = run_llama_cpp_python(s, "none", s.requests(1, per_n or 8))
        commands.append(f"{version} (benchmarks/llama_cpp_python_worker.py), Llama.generate, temp 0")
    for n in n_values:
        requests = s.requests(n, per_n or default_requests(n))
        for rep in range(repeats):
            for spec in specs:
                print(f"{spec:>13} N={n:<3} repeat {rep + 1}/{repeats}: llama-server ...", flush=True)
                srv, srv_out, cmd = await run_server(s, n, spec, requests)
                if rep == 0:
                    commands.append(cmd)
                ours, ours_out = await run_ours(s, n, spec, requests)
                srv.raw_tokens_per_s = ours.raw_tokens_per_s = raw.get(n)
                srv_runs.append(srv)
                ours_runs.append(ours)
                if rep == 0:
                    agree[(n, spec)] = agreement(ours_out, srv_out)
                    if n == 1 and spec == "none" and with_lcp:
                        lcp_agreement = agreement(ours_out, lcp_out)
                print(
                    f"{spec:>13} N={n:<3} ours {ours.tokens_per_s:7.1f} tok/s, llama-server "
                    f"{srv.tokens_per_s:7.1f}, raw {raw.get(n, 0):7.1f}",
                    flush=True,
                )
    ours_med = {(r.n_streams, r.speculative): r for r in medians(ours_runs)}
    srv_med = {(r.n_streams, r.speculative): r for r in medians(srv_runs)}
    rows = []
    nan = (float("nan"),) * 3
    for n in n_values:
        for spec in specs:
            ours = [r for r in ours_runs if (r.n_streams, r.speculative) == (n, spec)]
            srv = [r for r in srv_runs if (r.n_streams, r.speculative) == (n, spec)]
            rows.append(
                {
                    "n": n,
                    "spec": spec,
                    "ours": ours_med[(n, spec)],
                    "server": srv_med[(n, spec)],
                    "lcp": lcp.get(spec),
                    "raw": raw.get(n),
                    "agreement": agree[(n, spec)],
                    "vs_server": paired_ratio(ours, srv) or nan,
                    "vs_server_whole": paired_ratio(ours, srv, whole=True) or nan,
                }
            )
    return {
        "rows": rows,
        "commands": commands,
        "agreement_n1": agree.get((1, "none"), float("nan")),
        "agreement_lcp": lcp_agreement,
        "speedups_ours": _by_type(speedups(ours_runs)),
        "speedups_server": _by_type(speedups(srv_runs)),
        "speedups_ours_whole": _by_type(speedups(ours_runs, whole=True)),
        "speedups_server_whole": _by_type(speedups(srv_runs, whole=True)),
        "repeats": repeats,
    }


def _by_type(
    ratios: list[tuple[int, str, float, float, float]],
) -> list[tuple[int, str, float, float, float]]:
    """Speedups keyed by speculative type: every run here has prefix reuse off, which
    :meth:`BenchResult.variant` spells out ("ngram-simple no-cache")."""
    return [(n, variant.removesuffix(" no-cache"), *ratio) for n, variant, *ratio in ratios]


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="GGUF (default: Gemma 3 270M from the demo extra)")
    ap.add_argument("--streams", default="1,4,16,64")
    ap.add_argument("--spec", default="none,ngram-simple")
    ap.add_argument("--requests", type=int, help="requests per N (default 4N, at least 8)")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats of every row")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument(
        "--prompts",
        default="mixed,copy",
        help="comma-separated prompt sets or files (as python -m engine bench)",
    )
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--n-ctx", type=int, default=1024, help="context per sequence")
    ap.add_argument("--n-draft", type=int, default=DEFAULT_N_DRAFT)
    ap.add_argument("--ngram-n", type=int, default=DEFAULT_NGRAM_N)
    ap.add_argument("--out", default=str(ROOT / "BENCHMARKS.md"))
    ap.add_argument("--json", default=str(ROOT / "benchmarks" / "side_by_side.json"))
    ap.add_argument("--setup-llama-cpp-python", action="store_true", help="create its venv, then exit")
    args = ap.parse_args()
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING)
    if args.setup_llama_cpp_python:
        setup_llama_cpp_python()
        return 0
    if not (REF_BIN / "llama-server").exists():
        sys.exit("build the reference tools first: ./benchmarks/build_reference.sh")
    model = str(args.model or default_model_path())
    n_values = [int(x) for x in args.streams.split(",")]
    specs = args.spec.split(",")
    sections = []
    for prompt_set in args.prompts.split(","):
        with Runtime() as rt:
            m = Model.load(rt, model)
            prompts = [m.tokenize(p, add_special=True) for p in load_prompts(prompt_set)]
        s = Setup(model, prompts, args.max_tokens, args.threads, args.n_ctx, args.n_draft, args.ngram_n)
        print(f"--- {prompt_set} prompts", flush=True)
        sections.append(
            {"prompts": prompt_set, **await measure(s, n_values, specs, args.requests, args.repeats)}
        )
    meta = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine_info(),
        "model": Path(model).name,
        "threads": args.threads,
        "requests": args.requests or "4N (at least 8)",
        "repeats": args.repeats,
        "max_tokens": args.max_tokens,
        "command": "python benchmarks/side_by_side.py " + shlex.join(sys.argv[1:]),
        "commands": [portable(c, model) for sec in sections for c in sec["commands"]],
    }
    Path(args.json).write_text(  # (first: the figures outlive a fault in the report)
        json.dumps(
            {
                **meta,
                "sections": [
                    {
                        "prompts": sec["prompts"],
                        "agreement_n1": sec["agreement_n1"],
                        "agreement_llama_cpp_python": sec["agreement_lcp"],
                        "speculation_ours": sec["speedups_ours"],
                        "speculation_server": sec["speedups_server"],
                        "speculation_ours_whole_run": sec["speedups_ours_whole"],
                        "speculation_server_whole_run": sec["speedups_server_whole"],
                        "rows": [
                            {
                                "n": r["n"],
                                "spec": r["spec"],
                                "agreement": r["agreement"],
                                "ours_vs_server": r["vs_server"],
                                "ours_vs_server_whole_run": r["vs_server_whole"],
                                "raw_tokens_per_s": r["raw"],
                                "ours": r["ours"].as_dict(),
                                "llama_server": r["server"].as_dict(),
                                "llama_cpp_python": r["lcp"].as_dict() if r["lcp"] else None,
                            }
                            for r in sec["rows"]
                        ],
                    }
                    for sec in sections
                ],
            },
            indent=2,
        )
    )
    table = speculation_table(sections)
    published = Path(args.out).resolve() == ROOT / "BENCHMARKS.md"  # (a trial run elsewhere: no plot)
    text = report(sections, meta, table, plot=published)
    if published:
        write_benchmarks(text)
    else:
        Path(args.out).write_text(text)
    if published:  # (a trial run elsewhere leaves them be)
        update_readme(table, ROOT / "README.md")
        try:
            plot_speculation(sections, ROOT / "benchmarks" / "results" / "speculation.png")
        except ImportError:
            print("no plot: matplotlib is missing (pip install -e '.[demo]')")
    print(f"wrote {args.out} and {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
