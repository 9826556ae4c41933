"""Load benchmark: N concurrent streams through the engine, speculation on and off, against
the raw batched-decode throughput of the same model measured in the same run.

The raw figure is llama.cpp decoding one token for each of N sequences per call, with no
scheduling, sampling or drafting: the ceiling the engine's no-speculation throughput is
compared with (their ratio is the engine's overhead).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import multiprocessing
import multiprocessing.connection
import os
import platform
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import anyio

from ..scheduler import Engine, EngineConfig, SamplingParams
from ..session import Batch, Context, ContextConfig, Model, Runtime
from ..workloads import (
    COPY_PROMPTS,
    PROMPT_SETS,
    PROMPTS,
    SHARED_PROMPTS,
    SHARED_SYSTEM,
    load_prompts,
    prompt_of,
)

__all__ = [
    "BURST_S",
    "Send",
    "BenchResult",
    "KeptEngines",
    "COPY_PROMPTS",
    "PROMPTS",
    "PROMPT_SETS",
    "SHARED_PROMPTS",
    "SHARED_SYSTEM",
    "closed_loop",
    "default_requests",
    "load_engine",
    "load_prompts",
    "machine_info",
    "measure_raw",
    "percentile",
    "raw_decode_throughput",
    "run_http_load",
    "run_load",
    "warm_up",
]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


@dataclass
class BenchResult:
    """One load run (see :func:`closed_loop`). Throughput is measured in the steady window,
    where every stream runs with its requests' ends spread out (the ramp at the start and
    the tail, where fewer than N streams run, are out); the whole run is reported as well.
    Latencies are those of the full-length requests."""

    n_streams: int
    speculative: str
    requests: int
    tokens: int
    seconds: float
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0
    occupancy: float = 0.0  #: batch occupancy in the steady window
    raw_tokens_per_s: float | None = None
    steady_tokens: int = 0
    steady_seconds: float = 0.0
    prefix_cache: bool = True  #: prompts reused what the KV cache held (llama-server: cache_prompt)
    prompt_tokens: int = 0  #: prompt tokens of every request (warm-up excluded)
    cached_tokens: int = 0  #: of those, read from the prefix cache instead of prefilled

    @property
    def variant(self) -> str:
        """What ran: the speculative type, and whether prompts were cached."""
        return self.speculative if self.prefix_cache else f"{self.speculative} no-cache"

    @property
    def tokens_per_s(self) -> float:
        """Steady-state throughput (the whole run's when no steady window was seen)."""
        if self.steady_seconds > 0 and self.steady_tokens > 0:
            return self.steady_tokens / self.steady_seconds
        return self.whole_run_tokens_per_s

    @property
    def whole_run_tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def decode_steps(self) -> int:
        """Verifications that produced tokens: each emits 1 + its accepted drafts."""
        return self.tokens - self.accepted

    @property
    def mean_acceptance_length(self) -> float:
        return 1 + self.accepted / self.decode_steps if self.decode_steps else 0.0

    def record(self, tokens: int, ttft: float | None, itl: list[float], e2e: float) -> None:
        """One finished request."""
        self.requests += 1
        self.tokens += tokens
        if ttft is not None:
            self.ttft.append(ttft)
        self.itl += itl
        self.e2e.append(e2e)

    def as_dict(self) -> dict[str, Any]:
        return {
            "n_streams": self.n_streams,
            "speculative": self.speculative,
            "prefix_cache": self.prefix_cache,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "requests": self.requests,
            "tokens": self.tokens,
            "seconds": round(self.seconds, 3),
            "tokens_per_s": round(self.tokens_per_s, 2),
            "steady_seconds": round(self.steady_seconds, 3),
            "whole_run_tokens_per_s": round(self.whole_run_tokens_per_s, 2),
            "requests_per_s": round(self.requests_per_s, 3),
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_acceptance_length": round(self.mean_acceptance_length, 3),
            "batch_occupancy": round(self.occupancy, 3),
            **{f"ttft_p{int(q * 100)}": round(percentile(self.ttft, q), 4) for q in (0.5, 0.9, 0.99)},
            **{f"itl_p{int(q * 100)}": round(percentile(self.itl, q), 4) for q in (0.5, 0.9, 0.99)},
            **{f"e2e_p{int(q * 100)}": round(percentile(self.e2e, q), 4) for q in (0.5, 0.9, 0.99)},
            "raw_decode_tokens_per_s": None
            if self.raw_tokens_per_s is None
            else round(self.raw_tokens_per_s, 2),
        }


def raw_decode_throughput(
    model: Model, n_parallel: int, n_tokens: int = 32, threads: int | None = None, prompt_len: int = 16
) -> float:
    """Tokens/s of llama.cpp decoding one token for each of ``n_parallel`` sequences per
    call (after a short prompt each), with no scheduling: the decode ceiling."""
    ctx = Context.create(
        model,
        ContextConfig(
            n_ctx=(prompt_len + n_tokens + 8) * n_parallel,
            n_seq=n_parallel,
            n_batch=max(512, n_parallel),
            threads=threads,
        ),
        n_outputs_max=n_parallel,
        n_outputs_max_per_seq=1,
    )
    tok = model.tokenize("The", add_special=False)[0]
    for s in range(n_parallel):
        b = Batch()
        b.add_sequence([tok] * prompt_len, 0, s, logits="last")
        ctx.decode(b)
    step = Batch()
    for s in range(n_parallel):
        step.add(tok, 0, s, True)
    # warm up once, then time
    t0 = 0.0
    for i in range(n_tokens + 1):
        if i == 1:
            t0 = time.perf_counter()
        step.pos = [prompt_len + i] * n_parallel
        ctx.decode(step)
    return n_parallel * n_tokens / (time.perf_counter() - t0)


def default_requests(n_streams: int) -> int:
    """Requests per load run: enough for a steady window of about two request lengths
    after the ramp (:func:`closed_loop`)."""
    return max(4 * n_streams, 8)


#: a server that streams one verification's tokens as separate events sends them within
#: this many seconds: they count as one arrival, whose gap their tokens share
BURST_S = 0.002

#: one request of a load run: ``send(i, max_tokens)`` streams request ``i``'s tokens, a
#: list of token ids per delta
Send = Callable[[int, int], AsyncIterator[list[int]]]


async def closed_loop(
    n_streams: int,
    n_requests: int | None,
    max_tokens: int,
    send: Send,
    progress: Callable[[int], None] | None = None,
    duration: float | None = None,
    counters: Callable[[], tuple[int, float]] | None = None,
) -> BenchResult:
    """``n_streams`` clients, each sending its next request when the last one ends:
    ``n_requests`` in all, or as many as start within ``duration`` seconds.

    Clients that all start together and send requests of one length finish together, and
    go on in lock-step waves (every prompt arrives at once, into an empty cache): not the
    steady state of a server. So the first request of client k asks for (k + 1) / N of
    ``max_tokens`` (a ramp, not in the latency figures): from then on the streams' requests
    end evenly spread. The steady window runs from the end of the last ramp request until a
    client finds nothing left to send. ``counters()`` (steps, summed batch occupancy), when
    given, is read at both ends of the window. ``progress(tokens)`` is called as each
    request ends."""
    if (n_requests is None) == (duration is None):
        raise ValueError("give a request count or a duration")
    result = BenchResult(n_streams, "", 0, 0, 0.0)
    counter = iter(range(n_requests if n_requests is not None else 1 << 62))
    streamed = 0  # tokens received so far, by every client
    ramping = n_streams
    marks: dict[str, tuple[float, int, int, float]] = {}  # (time, tokens, steps, occupancy)

    def mark(name: str) -> None:
        if name not in marks:
            steps, occupancy = counters() if counters else (0, 0.0)
            marks[name] = (time.perf_counter(), streamed, steps, occupancy)

    start = time.perf_counter()
    deadline = start + duration if duration is not None else float("inf")

    async def client(k: int) -> None:
        nonlocal streamed, ramping
        ramp = n_streams > 1
        while True:
            i = next(counter, None)
            if i is None or time.perf_counter() >= deadline:
                mark("end")  # a stream has nothing left to send: the tail begins
                return
            want = -(-max_tokens * (k + 1) // n_streams) if ramp else max_tokens
            t0 = time.perf_counter()
            bursts: list[list[float]] = []  # [time, tokens]: arrivals within BURST_S are one
            async for ids in send(i, want):
                now = time.perf_counter()
                if ids:
                    if bursts and now - bursts[-1][0] < BURST_S:
                        bursts[-1] = [now, bursts[-1][1] + len(ids)]
                    else:
                        bursts.append([now, len(ids)])
                    streamed += len(ids)
            n = int(sum(b[1] for b in bursts))
            first = bursts[0][0] - t0 if bursts else None
            itl = [(b[0] - a[0]) / b[1] for a, b in itertools.pairwise(bursts)]
            if ramp:
                result.requests += 1
                result.tokens += n
                ramping -= 1
                if ramping == 0:
                    mark("begin")
            else:
                result.record(n, first, itl, time.perf_counter() - t0)
                if n_streams == 1:
                    mark("begin")
            ramp = False
            if progress is not None:
                progress(n)

    async with anyio.create_task_group() as clients:
        for k in range(n_streams):
            clients.start_soon(client, k)
    result.seconds = time.perf_counter() - start
    if "begin" in marks and "end" in marks and marks["end"][0] > marks["begin"][0]:
        (t0, tok0, steps0, occ0), (t1, tok1, steps1, occ1) = marks["begin"], marks["end"]
        result.steady_seconds, result.steady_tokens = t1 - t0, tok1 - tok0
        result.occupancy = (occ1 - occ0) / (steps1 - steps0) if steps1 > steps0 else 0.0
    return result


async def run_load(
    config: EngineConfig,
    n_streams: int,
    n_requests: int | None,
    max_tokens: int,
    prompts: Sequence[str | list[int]] | None = None,
    progress: Callable[[int], None] | None = None,
    duration: float | None = None,
    outputs: dict[int, list[int]] | None = None,
) -> BenchResult:
    """:func:`load_engine` on a fresh engine: its own load from start to end."""
    async with Engine(config) as engine:
        await warm_up(engine, prompts)
        return await load_engine(
            engine, n_streams, n_requests, max_tokens, prompts, progress, duration, outputs
        )


class KeptEngines:
    """Engines kept open across loads, one per configuration, each in a process of its own and
    warmed up once (``engine bench --interleave``): runs of variants that alternate on them
    pair closely in time, without a fresh engine's start (loading, calibrating) in every run.

    Not in this process: each engine's native thread leads its own OpenMP team, and libgomp
    stops spinning at barriers once a process holds more of its threads than there are CPUs,
    so an idle engine beside the one measured slowed it by a fifth (BENCHMARKS.md). The
    processes are spawned: a script that uses this guards its main code with
    ``if __name__ == "__main__"``."""

    def __init__(self, prompts: Sequence[str | list[int]] | None = None) -> None:
        self._prompts = list(prompts or PROMPTS)
        self._workers: dict[EngineConfig, tuple[BaseProcess, Connection]] = {}

    async def __aenter__(self) -> KeptEngines:
        return self

    async def __aexit__(self, *exc: object) -> None:
        for process, conn in self._workers.values():
            with contextlib.suppress(OSError):
                conn.send(None)
            await anyio.to_thread.run_sync(process.join, 60)
            if process.is_alive():
                process.kill()
        self._workers.clear()

    async def load(
        self, config: EngineConfig, n_streams: int, n_requests: int, max_tokens: int, first: int = 0
    ) -> BenchResult:
        """:func:`load_engine` on ``config``'s engine (started on first use)."""
        if config not in self._workers:
            spawn = multiprocessing.get_context("spawn")
            ours, theirs = spawn.Pipe()
            worker = spawn.Process(target=_kept_engine, args=(config, self._prompts, theirs), daemon=True)
            worker.start()
            self._workers[config] = (worker, ours)
        process, conn = self._workers[config]
        conn.send((n_streams, n_requests, max_tokens, first))
        ok, value = await anyio.to_thread.run_sync(_receive, conn, process)
        if not ok:
            raise RuntimeError(f"kept engine failed: {value}")
        result: BenchResult = value
        return result


def _receive(conn: Connection, process: BaseProcess) -> tuple[bool, Any]:
    """What a :class:`KeptEngines` process answers, or why it never will."""
    if conn in multiprocessing.connection.wait([conn, process.sentinel]):
        return conn.recv()  # type: ignore[no-any-return]
    return False, f"its process ended (exit code {process.exitcode})"


def _kept_engine(config: EngineConfig, prompts: list[str | list[int]], conn: Connection) -> None:
    """A :class:`KeptEngines` process: one engine, a load per request on ``conn``."""

    async def serve() -> None:
        async with Engine(config) as engine:
            await warm_up(engine, prompts)
            while (job := await anyio.to_thread.run_sync(conn.recv)) is not None:
                n_streams, n_requests, max_tokens, first = job
                try:
                    result = await load_engine(
                        engine, n_streams, n_requests, max_tokens, prompts, first=first
                    )
                except Exception as e:  # (the parent raises it)
                    conn.send((False, repr(e)))
                else:
                    conn.send((True, result))

    anyio.run(serve)


async def warm_up(engine: Engine, prompts: Sequence[str | list[int]] | None = None) -> None:
    """One short request, not measured: the first of a shape allocates."""
    await engine.generate((prompts or PROMPTS)[0], SamplingParams(max_tokens=4))


async def load_engine(
    engine: Engine,
    n_streams: int,
    n_requests: int | None,
    max_tokens: int,
    prompts: Sequence[str | list[int]] | None = None,
    progress: Callable[[int], None] | None = None,
    duration: float | None = None,
    outputs: dict[int, list[int]] | None = None,
    first: int = 0,
) -> BenchResult:
    """:func:`closed_loop` through a running engine: request ``i`` sends ``prompt_of(prompts,
    first + i)`` (text or token ids), greedy, end-of-generation ignored; ``outputs[i]`` gets
    its tokens. The result counts only this load's drafts and prompt tokens."""
    prompts = prompts or PROMPTS
    m = engine.metrics
    drafted0, accepted0, prompt0, cached0 = m.drafted, m.accepted, m.prompt_tokens, m.cached_tokens

    async def send(i: int, max_tokens: int) -> AsyncIterator[list[int]]:
        ids: list[int] = []
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        async for delta in engine.stream(prompt_of(prompts, first + i), params):
            ids += delta.token_ids
            yield delta.token_ids
        if outputs is not None:
            outputs[i] = ids

    result = await closed_loop(
        n_streams,
        n_requests,
        max_tokens,
        send,
        progress,
        duration,
        counters=lambda: (m.steps, m.occupancy_sum),
    )
    result.speculative = engine.config.spec.type
    result.prefix_cache = engine.prefix_cache
    result.drafted = m.drafted - drafted0
    result.accepted = m.accepted - accepted0
    result.prompt_tokens = m.prompt_tokens - prompt0
    result.cached_tokens = m.cached_tokens - cached0
    return result


def _draft_counts(usage: dict[str, Any], timings: dict[str, Any]) -> tuple[int, int] | None:
    """A request's (drafted, accepted) tokens: our ``usage.speculative`` or llama-server's
    ``timings``; None when the chunk has neither."""
    if "speculative" in usage:
        spec = usage["speculative"]
        return int(spec.get("drafted_tokens", 0)), int(spec.get("accepted_tokens", 0))
    if "draft_n" in timings:
        return int(timings["draft_n"]), int(timings.get("draft_n_accepted", 0))
    return None


async def run_http_load(
    url: str,
    n_streams: int,
    n_requests: int | None,
    max_tokens: int,
    prompts: Sequence[str | list[int]] | None = None,
    progress: Callable[[int], None] | None = None,
    duration: float | None = None,
    api_key: str | None = None,
    model: str | None = None,
) -> BenchResult:
    """:func:`closed_loop` against any OpenAI-compatible server at ``url`` (``.../v1``):
    streamed ``/completions``, greedy, end-of-generation ignored (``ignore_eos``, which vLLM,
    llama-server and ours accept). Tokens are counted from ``usage`` (per chunk where the
    server sends ``continuous_usage_stats``, as ours and vLLM do; else one per chunk with
    text, completed by the final ``usage``). Drafted/accepted tokens come from ours'
    ``usage.speculative`` or llama-server's ``timings``."""
    import httpx  # (the bench extra's; only this client needs it)

    prompts = prompts or PROMPTS
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    # a new connection per request: llama-server (cpp-httplib) closes kept-alive
    # connections after a few requests, which a pooled client sees as a disconnect
    limits = httpx.Limits(max_connections=n_streams + 1, max_keepalive_connections=0)
    spec = {"drafted": 0, "accepted": 0}
    async with httpx.AsyncClient(
        base_url=url.rstrip("/"), headers=headers, timeout=600, limits=limits
    ) as http:
        if model is None:
            listing = await http.get("/models")
            listing.raise_for_status()
            model = str(listing.json()["data"][0]["id"])

        async def send(i: int, want: int) -> AsyncIterator[list[int]]:
            body = {
                "model": model,
                "prompt": prompt_of(prompts, i),
                "max_tokens": want,
                "temperature": 0.0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            }
            seen = 0
            drafts = (0, 0)  # (drafted, accepted) as the request's last chunks report them
            async with http.stream("POST", "/completions", json=body) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    raise RuntimeError(f"{url}: HTTP {resp.status_code}: {resp.text[:300]}")
                async for line in resp.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    usage = chunk.get("usage") or {}
                    text = any(c.get("text") for c in chunk.get("choices") or ())
                    total = usage.get("completion_tokens")
                    new = total - seen if total is not None else int(text)
                    if new > 0:
                        seen += new
                        yield [0] * new
                    if not chunk.get("choices") or chunk["choices"][0].get("finish_reason"):
                        drafts = _draft_counts(usage, chunk.get("timings") or {}) or drafts
            spec["drafted"] += drafts[0]
            spec["accepted"] += drafts[1]

        async for _ in send(0, 4):  # warm-up
            pass
        spec["drafted"] = spec["accepted"] = 0
        result = await closed_loop(n_streams, n_requests, max_tokens, send, progress, duration)
    result.speculative = "http"
    result.drafted, result.accepted = spec["drafted"], spec["accepted"]
    return result


def machine_info() -> dict[str, Any]:
    """What the figures were measured on: CPU model, cores, OS, Python."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "system": platform.platform(),
        "python": platform.python_version(),
    }


def measure_raw(model_path: str, n_values: list[int], threads: int | None) -> dict[int, float]:
    with Runtime() as rt:
        model = Model.load(rt, model_path)
        return {n: raw_decode_throughput(model, n, threads=threads) for n in n_values}
