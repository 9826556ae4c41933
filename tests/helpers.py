"""What the engine's tests share: an engine config over the test models, the drafter
parity table, and checks that wait for the engine (it acts between steps)."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest

from engine import Engine, EngineConfig, SpeculativeConfig


@pytest.fixture(name="anyio_backend", params=["asyncio", "trio"])
def both_backends(request: pytest.FixtureRequest) -> str:
    """The engine's tests run under asyncio and trio (a module that imports this fixture)."""
    return str(request.param)


def config(
    paths: dict[str, Path],
    target: str,
    draft: str | None = None,
    spec: str = "none",
    n_seq: int = 4,
    **kw: object,
) -> EngineConfig:
    n_draft = kw.pop("n_draft_max", 3)
    extra = kw.pop("spec_extra", {})
    return EngineConfig(
        model=paths[target],
        draft_model=paths[draft] if draft else None,
        speculative=SpeculativeConfig(spec, n_seq=n_seq, n_draft_max=n_draft, **extra),  # type: ignore[arg-type]
        n_seq=n_seq,
        n_ctx=kw.pop("n_ctx", 256),
        n_batch=kw.pop("n_batch", 256),
        threads=2,
        **kw,
    )  # type: ignore[arg-type]


async def assert_kv_accounted(engine: Engine, timeout: float = 5.0) -> None:
    """Once the engine is idle, every sequence's KV cache is empty or holds a cached sequence
    the prefix index knows (the sequence of a request that ended, kept for reuse). Polled: a
    request's result reaches its caller before the step that clears its slot runs, and the
    caller may read the cache first; a sequence left behind stays and fails the check."""
    scheduler = engine._scheduler
    assert scheduler is not None
    wrong: list[tuple[int, int, dict[int, int]]] = []
    with anyio.move_on_after(timeout):
        while True:
            positions = await engine.kv_positions()
            held = scheduler.slots.cache.held() if scheduler.slots.cache is not None else {}
            wrong = [
                (seq, pos, held)
                for seq, pos in enumerate(positions)
                if not (pos >= held[seq] - 1 if seq in held else pos == -1)
            ]
            if not wrong:
                return
            await anyio.sleep(0.01)
    assert not wrong, wrong


async def wait_until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    """Poll ``condition`` until it holds (the engine acts between steps)."""
    with anyio.fail_after(timeout):
        while not condition():
            await anyio.sleep(0.002)


def mixed_requests(n: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        ([rng.randrange(1000, 20000) for _ in range(rng.randrange(2, 120))], rng.randrange(1, 33))
        for _ in range(n)
    ]


# every target is a walk model (greedy margins of ~8 nats): outputs compare in full
PARITY = [
    ("none", "walk-llama", None, "none", {}),
    ("draft", "walk-llama", "llama", "draft", {}),  # a random draft: mostly rejected
    ("draft-self", "walk-llama", "walk-llama", "draft", {}),  # always accepted
    ("eagle3", "walk-llama", "walk-llama-eagle3", "eagle3", {}),  # first token always right
    ("dflash", "walk-llama", "walk-llama-dflash-oracle", "dflash", {}),  # first token always right
    ("mtp", "walk-qwen35-mtp", None, "mtp", {}),  # always right
    ("ngram", "walk-llama-cycle6", None, "ngram-simple", {"ngram_size_n": 2, "ngram_size_m": 4}),
]
