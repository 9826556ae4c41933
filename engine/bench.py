"""Load benchmark: N concurrent streams through the engine, speculation on and off, against
the raw batched-decode throughput of the same model measured in the same run.

The raw figure is llama.cpp decoding one token for each of N sequences per call, with no
scheduling, sampling or drafting: the ceiling the engine's no-speculation throughput is
compared with (their ratio is the engine's overhead).
"""

from __future__ import annotations

import itertools
import json
import os
import platform
import random
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

from .scheduler import Engine, EngineConfig, SamplingParams
from .session import Batch, Context, ContextConfig, Model, Runtime
from .workloads import (
    COPY_PROMPTS,
    PROMPT_SETS,
    PROMPTS,
    SHARED_PROMPTS,
    SHARED_SYSTEM,
    TOPICS,
    load_prompts,
    prompt_of,
)

__all__ = [
    "median_spread",
    "medians",
    "paired_ratio",
    "reuse_ratios",
    "speedups",
    "COPY_PROMPTS",
    "PROMPTS",
    "PROMPT_SETS",
    "SHARED_PROMPTS",
    "SHARED_SYSTEM",
    "BenchResult",
    "TurnStats",
    "closed_loop",
    "default_requests",
    "load_prompts",
    "machine_info",
    "plot",
    "measure_raw",
    "percentile",
    "raw_decode_throughput",
    "OverloadResult",
    "run_conversations",
    "run_overload",
    "run_http_load",
    "run_load",
    "summarize",
    "summarize_overload",
    "summarize_turns",
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
    """:func:`closed_loop` through one engine: request ``i`` sends ``prompt_of(prompts,
    i)`` (text or token ids), greedy, end-of-generation ignored;
    ``outputs[i]`` gets its tokens."""
    prompts = prompts or PROMPTS
    async with Engine(config) as engine:
        # warm-up: one short request, not measured
        await engine.generate(prompts[0], SamplingParams(max_tokens=4))
        m = engine.metrics
        drafted0, accepted0, prompt0, cached0 = m.drafted, m.accepted, m.prompt_tokens, m.cached_tokens

        async def send(i: int, max_tokens: int) -> AsyncIterator[list[int]]:
            ids: list[int] = []
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            async for delta in engine.stream(prompt_of(prompts, i), params):
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
        result.speculative = config.spec.type
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


@dataclass
class TurnStats:
    """One turn of every conversation (:func:`run_conversations`)."""

    turn: int
    prefix_cache: bool
    prompt_tokens: list[int] = field(default_factory=list)
    cached_tokens: list[int] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    #: over HTTP to a cluster: the turns served by the replica that served their
    #: conversation's first turn (``x-engine-replica``), and the replicas that served this turn
    on_first_replica: int = 0
    replicas: set[str] = field(default_factory=set)

    @property
    def prefilled(self) -> float:
        """Mean prompt tokens actually read per request."""
        return (sum(self.prompt_tokens) - sum(self.cached_tokens)) / max(len(self.prompt_tokens), 1)

    @property
    def cached_share(self) -> float:
        return sum(self.cached_tokens) / sum(self.prompt_tokens) if sum(self.prompt_tokens) else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "turn": self.turn,
            "prefix_cache": self.prefix_cache,
            "prompt_tokens_mean": round(sum(self.prompt_tokens) / max(len(self.prompt_tokens), 1), 1),
            "prefilled_mean": round(self.prefilled, 1),
            "cached_share": round(self.cached_share, 4),
            "ttft_p50": round(percentile(self.ttft, 0.5), 4),
            "ttft_p90": round(percentile(self.ttft, 0.9), 4),
            **(
                {"on_first_replica": self.on_first_replica, "replicas": len(self.replicas)}
                if self.replicas
                else {}
            ),
        }


async def run_conversations(
    config: EngineConfig,
    conversations: int = 8,
    turns: int = 6,
    max_tokens: int = 32,
    system: str | None = SHARED_SYSTEM,
) -> list[TurnStats]:
    """``conversations`` chats at once, each with the ``system`` message first; each turn
    sends the whole conversation again in the model's chat template (as OpenAI-style clients
    do) with a new user message, greedy."""
    stats: list[TurnStats] = []
    async with Engine(config) as engine:
        await engine.generate(PROMPTS[0], SamplingParams(max_tokens=4))  # warm-up
        stats = [TurnStats(t + 1, engine.prefix_cache) for t in range(turns)]

        async def chat(c: int) -> None:
            messages = [{"role": "system", "content": system}] if system else []
            for t in range(turns):
                topic = TOPICS[(c + 3 * t) % len(TOPICS)]
                messages.append(
                    {"role": "user", "content": f"Customer {c + 1}, turn {t + 1}: tell me about {topic}."}
                )
                out = await engine.generate(messages, SamplingParams(max_tokens=max_tokens, temperature=0))
                messages.append({"role": "assistant", "content": out.text})
                s = stats[t]
                s.prompt_tokens.append(out.metrics.prompt_tokens)
                s.cached_tokens.append(out.metrics.cached_tokens)
                if out.metrics.ttft is not None:
                    s.ttft.append(out.metrics.ttft)

        async with anyio.create_task_group() as tg:
            for c in range(conversations):
                tg.start_soon(chat, c)
    return stats


async def run_http_conversations(
    url: str,
    conversations: int = 8,
    turns: int = 6,
    max_tokens: int = 32,
    system: str | None = SHARED_SYSTEM,
    api_key: str | None = None,
    model: str | None = None,
    think: float = 0.0,
) -> list[TurnStats]:
    """:func:`run_conversations` against an OpenAI-compatible server at ``url``: streamed
    chat completions, TTFT measured by the client (to the first content), cached tokens from
    ``usage``, and where a cluster says which replica served a turn (``x-engine-replica``)
    whether it is the one that served the conversation's first turn. ``think``: a user
    reads each reply for up to that many seconds (uniform, seeded per conversation)
    before the next turn."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    stats = [TurnStats(t + 1, True) for t in range(turns)]
    limits = httpx.Limits(max_connections=conversations + 1, max_keepalive_connections=0)
    async with httpx.AsyncClient(
        base_url=url.rstrip("/"), headers=headers, timeout=600, limits=limits
    ) as http:
        if model is None:
            model = str((await http.get("/models")).json()["data"][0]["id"])

        async def turn(messages: list[dict[str, str]], s: TurnStats) -> tuple[str, str | None]:
            body = {
                "model": model,
                "messages": messages,
                "max_tokens": max_tokens,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            text, t0, first = "", time.perf_counter(), None
            async with http.stream("POST", "/chat/completions", json=body) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"{url}: HTTP {r.status_code}: {(await r.aread())[:300]!r}")
                replica = r.headers.get("x-engine-replica")
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    for c in chunk.get("choices") or ():
                        piece = (c.get("delta") or {}).get("content")
                        if piece:
                            first = first or time.perf_counter()
                            text += piece
                    if usage := chunk.get("usage"):
                        s.prompt_tokens.append(usage["prompt_tokens"])
                        s.cached_tokens.append(
                            (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                        )
            if first is not None:
                s.ttft.append(first - t0)
            return text, replica

        async def chat(c: int) -> None:
            messages = [{"role": "system", "content": system}] if system else []
            home = None
            pauses = random.Random(c)
            for t in range(turns):
                if t and think:
                    await anyio.sleep(pauses.uniform(0, think))
                topic = TOPICS[(c + 3 * t) % len(TOPICS)]
                messages.append(
                    {"role": "user", "content": f"Customer {c + 1}, turn {t + 1}: tell me about {topic}."}
                )
                text, replica = await turn(messages, stats[t])
                messages.append({"role": "assistant", "content": text})
                if replica is not None:
                    home = home or replica
                    stats[t].replicas.add(replica)
                    stats[t].on_first_replica += replica == home

        async with anyio.create_task_group() as tg:
            for c in range(conversations):
                tg.start_soon(chat, c)
    return stats


def summarize_turns(stats: list[TurnStats]) -> str:
    """Per turn: prompt tokens sent, tokens actually prefilled, the cached share, TTFT."""
    routed = any(s.replicas for s in stats)
    head = f"{'turn':>4} {'cache':>5} {'prompt tok':>10} {'prefilled':>9} {'cached':>7} {'TTFT p50 s':>10}"
    head += f" {'TTFT p90 s':>10}" + (f" {'same replica':>12}" if routed else "")
    lines = [head, "-" * len(head)]
    for s in stats:
        d = s.as_dict()
        line = (
            f"{s.turn:>4} {'on' if s.prefix_cache else 'off':>5} {d['prompt_tokens_mean']:10.1f} "
            f"{s.prefilled:9.1f} {s.cached_share:7.1%} {d['ttft_p50']:10.3f} {d['ttft_p90']:10.3f}"
        )
        if routed:
            line += f" {s.on_first_replica:>5}/{len(s.prompt_tokens):<6}"
        lines.append(line)
    return "\n".join(lines)


@dataclass
class OverloadResult:
    """A load of long and short requests on too few slots (:func:`run_overload`)."""

    preemption: bool
    seconds: float = 0.0
    tokens: int = 0
    short_ttft: list[float] = field(default_factory=list)
    long_ttft: list[float] = field(default_factory=list)
    preemptions: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "preemption": self.preemption,
            "seconds": round(self.seconds, 3),
            "tokens": self.tokens,
            "tokens_per_s": round(self.tokens_per_s, 2),
            "preemptions": self.preemptions,
            **{
                f"short_ttft_p{int(q * 100)}": round(percentile(self.short_ttft, q), 3)
                for q in (0.5, 0.9, 0.99)
            },
            **{
                f"long_ttft_p{int(q * 100)}": round(percentile(self.long_ttft, q), 3)
                for q in (0.5, 0.9, 0.99)
            },
        }


async def run_overload(
    config: EngineConfig,
    clients: int = 32,
    long_clients: int = 8,
    long_tokens: int = 512,
    short_tokens: int = 16,
    rounds: int = 2,
) -> OverloadResult:
    """``clients`` closed-loop clients on ``config.n_seq`` slots, each sending ``rounds``
    requests: ``long_clients`` of them long generations, the rest short ones (greedy, end
    of generation ignored). Reports the TTFT of each kind and the throughput of the run."""
    result = OverloadResult(config.preemption)
    async with Engine(config) as engine:
        await engine.generate(PROMPTS[0], SamplingParams(max_tokens=4))  # warm-up
        preempted0 = engine.metrics.preemptions

        async def client(k: int) -> None:
            long = k < long_clients
            for i in range(rounds):
                prompt = PROMPTS[(k + i) % len(PROMPTS)]
                params = SamplingParams(max_tokens=long_tokens if long else short_tokens, ignore_eos=True)
                out = await engine.generate(prompt, params)
                result.tokens += out.metrics.completion_tokens
                if out.metrics.ttft is not None:
                    (result.long_ttft if long else result.short_ttft).append(out.metrics.ttft)

        start = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for k in range(clients):
                tg.start_soon(client, (k * 5) % clients)  # long and short clients interleaved
        result.seconds = time.perf_counter() - start
        result.preemptions = engine.metrics.preemptions - preempted0
    return result


def summarize_overload(results: list[OverloadResult]) -> str:
    """Each run, then preemption on against off (medians of interleaved pairs)."""
    head = (
        f"{'preemption':>10} {'tok/s':>7} {'preempted':>9} {'short TTFT p50/90/99 s':>23} "
        f"{'long TTFT p50/90/99 s':>22}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(
            f"{'on' if r.preemption else 'off':>10} {r.tokens_per_s:7.1f} {r.preemptions:9d} "
            f"{_p3(r.short_ttft, 1, '.2f'):>23} {_p3(r.long_ttft, 1, '.2f'):>22}"
        )
    on = [r for r in results if r.preemption]
    off = [r for r in results if not r.preemption]
    if on and off:

        def med(xs: list[float]) -> str:
            m, lo, hi = median_spread(xs) or (float("nan"),) * 3
            return f"{m:.2f}x [{lo:.2f}, {hi:.2f}]"

        pairs = list(zip(on, off, strict=False))
        ttft = [percentile(b.short_ttft, 0.99) / percentile(a.short_ttft, 0.99) for a, b in pairs]
        tput = [a.tokens_per_s / b.tokens_per_s for a, b in pairs if b.tokens_per_s]
        lines += [
            "",
            f"preemption on vs off ({len(pairs)} interleaved pairs, median [min, max]): short requests' "
            f"TTFT p99 {med(ttft)} sooner; throughput {med(tput)}",
        ]
    return "\n".join(lines)


def _p3(values: list[float], scale: float, fmt: str) -> str:
    return "/".join(format(scale * percentile(values, q), fmt) for q in (0.5, 0.9, 0.99))


def medians(results: list[BenchResult]) -> list[BenchResult]:
    """One run per (N, variant): the run with the median throughput of its repeats."""
    groups: dict[tuple[int, str], list[BenchResult]] = {}
    for r in results:
        groups.setdefault((r.n_streams, r.variant), []).append(r)
    return [sorted(g, key=lambda r: r.tokens_per_s)[(len(g) - 1) // 2] for g in groups.values()]


def speedups(
    results: list[BenchResult], reference: str = "none"
) -> list[tuple[int, str, float, float, float]]:
    """(N, variant, median, min, max) of each speculative type's throughput ÷ ``reference``'s
    with the same prefix cache setting, paired run by run in the order they ran (interleaved
    repeats: A, B, A, B, ...)."""
    out = []
    for n in sorted({r.n_streams for r in results}):
        for variant in dict.fromkeys(r.variant for r in results if r.speculative != reference):
            runs = [r for r in results if r.n_streams == n and r.variant == variant]
            ref = [
                r
                for r in results
                if r.n_streams == n
                and r.speculative == reference
                and runs
                and r.prefix_cache == runs[0].prefix_cache
            ]
            ratio = paired_ratio(runs, ref)
            if ratio is not None:
                out.append((n, variant, *ratio))
    return out


def reuse_ratios(
    results: list[BenchResult],
) -> list[tuple[int, str, tuple[float, float, float], tuple[float, float, float]]]:
    """(N, speculative type, throughput ratio, TTFT p50 ratio) of prefix cache on against
    off, each a (median, min, max) over runs paired in the order they ran; the TTFT ratio
    is off ÷ on (how many times sooner the first token comes)."""
    out = []
    for n in sorted({r.n_streams for r in results}):
        for spec in dict.fromkeys(r.speculative for r in results):
            on = [r for r in results if (r.n_streams, r.speculative, r.prefix_cache) == (n, spec, True)]
            off = [r for r in results if (r.n_streams, r.speculative, r.prefix_cache) == (n, spec, False)]
            tput = paired_ratio(on, off)
            ttft = _paired(off, on, lambda r: percentile(r.ttft, 0.5))
            if tput is not None and ttft is not None:
                out.append((n, spec, tput, ttft))
    return out


def _paired(
    a: Sequence[BenchResult], b: Sequence[BenchResult], value: Callable[[BenchResult], float]
) -> tuple[float, float, float] | None:
    return median_spread([value(x) / value(y) for x, y in zip(a, b, strict=False) if value(y) > 0])


def median_spread(values: Sequence[float]) -> tuple[float, float, float] | None:
    """(median, min, max) of repeated measurements (the lower median of an even count)."""
    v = sorted(values)
    return (v[(len(v) - 1) // 2], v[0], v[-1]) if v else None


def paired_ratio(a: Sequence[BenchResult], b: Sequence[BenchResult]) -> tuple[float, float, float] | None:
    """Median, min and max of ``a[i]`` ÷ ``b[i]`` throughput, runs paired in the order they
    ran (None when no pair has a throughput to divide by)."""
    return _paired(a, b, lambda r: r.tokens_per_s)


def summarize(results: list[BenchResult]) -> str:
    """A table (medians of repeats): steady-state tok/s, the raw decode ceiling and the ratio
    to it, acceptance, occupancy, latencies; then speculation on ÷ off per N."""
    head = (
        f"{'N':>4} {'spec':>23} {'tok/s':>8} {'raw tok/s':>10} {'ratio':>6} {'req/s':>6} {'cached':>6} {'drafted':>8} "
        f"{'accept':>7} {'acc.len':>7} {'occup':>6} {'TTFT p50/90/99 s':>18} {'ITL p50/90/99 ms':>18} "
        f"{'e2e p50/90/99 s':>18}"
    )
    lines = [head, "-" * len(head)]
    for r in medians(results):
        raw = r.raw_tokens_per_s
        ratio = f"{r.tokens_per_s / raw:6.2f}" if raw else "     -"
        lines.append(
            f"{r.n_streams:>4} {r.variant:>23} {r.tokens_per_s:8.1f} "
            f"{(raw or float('nan')):10.1f} {ratio} {r.requests_per_s:6.2f} "
            f"{r.cached_tokens / r.prompt_tokens if r.prompt_tokens else 0:6.0%} {r.drafted:8d} "
            f"{r.acceptance_rate:7.1%} {r.mean_acceptance_length:7.2f} {r.occupancy:6.2f} "
            f"{_p3(r.ttft, 1, '.2f'):>18} {_p3(r.itl, 1000, '.0f'):>18} {_p3(r.e2e, 1, '.2f'):>18}"
        )
    ups = speedups(results)
    if ups:
        repeats = max(sum(1 for r in results if (r.n_streams, r.variant) == (n, s)) for n, s, *_ in ups)
        lines += [
            "",
            f"speculation on ÷ off, steady state (median of {repeats} interleaved repeats [min, max]):",
        ]
        for n, spec, med, lo, hi in ups:
            drafted = sum(r.drafted for r in results if (r.n_streams, r.variant) == (n, spec))
            note = "" if drafted else "  (drafted nothing)"
            lines.append(f"  N={n:<3} {spec:>23}: {med:5.2f}x  [{lo:.2f}, {hi:.2f}]{note}")
    reuse = reuse_ratios(results)
    if reuse:
        lines += ["", "prefix cache on ÷ off (median of interleaved repeats [min, max]):"]
        for n, spec, (tm, tlo, thi), (fm, flo, fhi) in reuse:
            lines.append(
                f"  N={n:<3} {spec:>14}: throughput {tm:5.2f}x [{tlo:.2f}, {thi:.2f}], "
                f"TTFT p50 {fm:5.2f}x sooner [{flo:.2f}, {fhi:.2f}]"
            )
    return "\n".join(lines)


def plot(results: list[BenchResult], path: str | Path, title: str = "") -> None:
    """Throughput and p90 latencies against N, one line per speculative type (and the raw
    decode ceiling), as a PNG. Needs matplotlib (the ``demo`` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = medians(results)
    specs = list(dict.fromkeys(r.variant for r in results))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5), constrained_layout=True)
    panels: list[tuple[str, Callable[[BenchResult], float]]] = [
        ("output tokens/s", lambda r: r.tokens_per_s),
        ("time to first token p90 (s)", lambda r: percentile(r.ttft, 0.9)),
        ("inter-token latency p90 (ms)", lambda r: 1000 * percentile(r.itl, 0.9)),
    ]
    for ax, (label, value) in zip(axes, panels, strict=True):
        for spec in specs:
            rows = sorted((r for r in results if r.variant == spec), key=lambda r: r.n_streams)
            name = "no speculation" if spec == "none" else spec
            ax.plot([r.n_streams for r in rows], [value(r) for r in rows], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streams N")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    raw = sorted({(r.n_streams, r.raw_tokens_per_s) for r in results if r.raw_tokens_per_s})
    if raw:
        axes[0].plot(
            [n for n, _ in raw],
            [t for _, t in raw],
            "k--",
            marker="x",
            label="raw batched decode (llama.cpp)",
        )
    axes[0].legend(fontsize=8)
    for ax in axes:
        ticks = sorted({r.n_streams for r in results})
        ax.set_xticks(ticks, [str(t) for t in ticks])
    if title:
        fig.suptitle(title)
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
