"""Load scenarios beyond steady streams: multi-turn conversations (what the prefix cache and
prefix-aware routing save) and overload with long and short requests (what preemption buys)."""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import anyio

from ..scheduler import Engine, EngineConfig, SamplingParams
from ..workloads import (
    PROMPTS,
    SHARED_SYSTEM,
    TOPICS,
)
from .load import percentile

__all__ = [
    "OverloadResult",
    "TurnStats",
    "run_conversations",
    "run_http_conversations",
    "run_overload",
]


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
