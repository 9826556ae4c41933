"""What the engine's tests share: an engine config over the test models, the drafter
parity table, checks that wait for the engine (it acts between steps), one-token rows
of many sequences decoded together at the context level, and the process's resident memory."""

from __future__ import annotations

import ctypes
import gc
import random
import resource
from collections.abc import Callable
from pathlib import Path

import anyio
import numpy as np
import pytest

from engine import Engine, EngineConfig, SpeculativeConfig
from engine.session import Batch, Context, ContextConfig, Model


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


class OneTokenRows:
    """``n_seq`` sequences with random ``hist``-token histories in one unified KV cache;
    calling it with some of them decodes each one's next token in one batch and returns
    their logits (the rows are removed again, so any subset can follow)."""

    def __init__(self, model: Model, n_seq: int, hist: int, seed: int, **context: object) -> None:
        rng = np.random.default_rng(seed)
        histories = [rng.integers(10, model.n_vocab, hist).tolist() for _ in range(n_seq)]
        self.tokens = rng.integers(10, model.n_vocab, n_seq).tolist()
        self.hist = hist
        config = ContextConfig(n_ctx=32 * n_seq, n_seq=n_seq, n_batch=512, kv_unified=True, **context)  # type: ignore[arg-type]
        self.ctx = Context.create(model, config)
        for s in range(n_seq):
            b = Batch()
            b.add_sequence(histories[s], 0, s, logits="none")
            self.ctx.decode(b)

    def __call__(self, seqs: range) -> np.ndarray:
        b = Batch()
        for s in seqs:
            b.add(self.tokens[s], self.hist, s, True)
        self.ctx.decode(b)
        got = self.ctx.logits.copy()
        for s in seqs:
            self.ctx.kv_remove(s, self.hist, None)
        return got


def rss_mib() -> float:
    """Resident set size after returning freed heap memory to the system (glibc keeps freed
    chunks otherwise, which hides whether memory is really held)."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20
