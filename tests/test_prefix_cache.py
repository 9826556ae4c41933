"""Prefix reuse: the radix index as pure logic, then the real engine (reuse on vs off gives
the same tokens and the same drafts, for every drafter), then the sliding-window cache patch
that keeps a cut-back sequence's window."""

from __future__ import annotations

import random
from pathlib import Path

import anyio
import numpy as np
import pytest

from engine import Engine, SamplingParams
from engine.scheduler.planner import SlotTable
from engine.scheduler.prefix import MIN_REUSE, PrefixCache, RadixTree, common_prefix
from engine.session import Batch, Context, ContextConfig
from tests.aio import Task, gather
from tests.conftest import ModelCache
from tests.helpers import PARITY, assert_kv_accounted, config, wait_until
from tests.models.make_models import GEMMA_SWA

pytestmark = pytest.mark.timeout(600)


# --- the index, pure ---------------------------------------------------------------------
def test_radix_tree_finds_the_longest_shared_prefix_like_brute_force() -> None:
    rng = random.Random(7)
    tree = RadixTree()
    held: dict[int, list[int]] = {}
    base = [rng.randrange(5) for _ in range(30)]
    for step in range(400):
        key = rng.randrange(12)
        if key in held and rng.random() < 0.4:
            tree.remove(key, held.pop(key))
        else:
            if key in held:
                tree.remove(key, held.pop(key))
            cut = rng.randrange(len(base) + 1)  # shared stems make the tree branch
            held[key] = base[:cut] + [rng.randrange(5) for _ in range(rng.randrange(8))]
            tree.insert(key, held[key])
        query = base[: rng.randrange(len(base) + 1)] + [rng.randrange(5) for _ in range(rng.randrange(6))]
        keys, n = tree.longest(query)
        best = max((common_prefix(t, query) for t in held.values()), default=0)
        assert n == best, step
        assert keys == {k for k, t in held.items() if common_prefix(t, query) == best} or not held


def test_removing_every_sequence_leaves_an_empty_tree() -> None:
    tree = RadixTree()
    seqs = {0: [1, 2, 3, 4], 1: [1, 2, 3], 2: [1, 2, 9], 3: [1, 2, 3, 4]}
    for k, t in seqs.items():
        tree.insert(k, t)
    assert tree.longest([1, 2, 3, 4, 5]) == ({0, 3}, 4)
    for k, t in seqs.items():
        tree.remove(k, t)
    assert not tree.root.children and not tree.root.keys


def test_a_cached_slot_is_taken_when_it_saves_enough() -> None:
    cache = PrefixCache()
    long_prompt = list(range(100))
    cache.put(3, long_prompt[:MIN_REUSE] + [999])
    cache.put(5, long_prompt[:4] + [998] * 20)
    # a short match, an empty slot free: the entry stays for a better match
    assert cache.take([0, 1, 2, 3, 7, 7, 7, 7, 7, 7], have_empty=True) is None
    # MIN_REUSE shared tokens: taken
    assert cache.take(long_prompt, have_empty=True) == (3, MIN_REUSE)
    assert 3 not in cache and len(cache) == 1
    # half the prompt or more: taken even when short
    assert cache.take([0, 1, 2, 3, 4, 5], have_empty=True) == (5, 4)
    # half of what the cached sequence holds: a short conversation's next turn
    cache.put(6, [5, 6, 7, 8, 9, 10])
    assert cache.take([5, 6, 7, 8, 50, 51, 52, 53, 54, 55, 56, 57, 58], have_empty=True) == (6, 4)


def test_the_whole_prompt_cached_still_decodes_its_last_token() -> None:
    cache = PrefixCache()
    cache.put(0, [1, 2, 3, 4, 5, 6])
    assert cache.take([1, 2, 3, 4], have_empty=False) == (0, 3)


def test_without_an_empty_slot_the_least_recently_cached_is_evicted() -> None:
    cache = PrefixCache()
    cache.put(0, [1, 1, 1])
    cache.put(1, [2, 2, 2])
    cache.put(2, [3, 3, 3])
    assert cache.take([9, 9], have_empty=False) == (0, 0)  # nothing shared: the oldest goes
    assert cache.take([2, 2, 7], have_empty=False) == (1, 2)  # a match wins over the LRU order
    assert cache.take([3, 5], have_empty=False) == (2, 1)


def test_slot_table_keeps_finished_sequences_cached_and_never_evicts_a_running_one() -> None:
    from engine.scheduler.request import RequestState
    from tests.test_scheduler_logic import make

    slots = SlotTable(2, prefix_cache=True)
    a, b, c = (make(x, RequestState.WAITING) for x in "abc")
    assert slots.allocate(a, [1, 2, 3]) == (0, 0, False, True)
    assert slots.allocate(b, [4, 5, 6]) == (1, 0, False, True)
    assert slots.allocate(c, [1, 2, 3]) is None  # both running
    assert slots.release(0, holds=[1, 2, 3, 10, 11]) is False  # cached, not cleared
    assert slots.n_free == 1
    assert slots.allocate(c, [1, 2, 3, 12]) == (0, 3, True, True)
    assert slots.release(1, holds=[4, 5]) is False
    assert slots.forget(1) and slots.n_free == 1 and slots.cache is not None and len(slots.cache) == 0
    assert not slots.forget(1)


# --- the real engine ---------------------------------------------------------------------
def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, 20000) for _ in range(40)]]


async def _serve(cfg: object, first: list[int]) -> list[tuple[list[int], int, int, int]]:
    """A conversation on one slot: every prefix length a later request can share with what
    the slot holds (the whole prompt, part of it, one token, a prompt ending inside the
    cached generation, one extending past it, nothing)."""
    out = []
    async with Engine(cfg) as engine:  # type: ignore[arg-type]

        async def ask(prompt: list[int]) -> list[int]:
            r = await engine.generate(prompt, SamplingParams(max_tokens=24, temperature=0))
            m = r.metrics
            out.append((r.token_ids, m.cached_tokens, m.drafted, m.accepted))
            return r.token_ids

        gen = await ask(first)
        await ask(first + gen[:7])  # ends inside the cached generation
        gen2 = await ask(first)  # the whole prompt is cached
        await ask(first + gen2 + [4242, 4243])  # a chat turn: everything before is cached
        await ask(first[:20] + [7000, 7001, 7002])
        await ask(first[:1] + [9000] * 5)
        await ask([8000, 8001, 8002])
    return out


@pytest.mark.slow
@pytest.mark.parametrize(("name", "target", "draft", "spec", "extra"), PARITY, ids=[p[0] for p in PARITY])
async def test_reuse_gives_the_tokens_and_drafts_of_a_cold_prefill(
    model_paths: dict[str, Path],
    name: str,
    target: str,
    draft: str | None,
    spec: str,
    extra: dict[str, int],
) -> None:
    first = _prompts(3)[0]
    runs = {}
    for reuse in (True, False):
        cfg = config(
            model_paths,
            target,
            draft,
            spec,
            n_seq=1,
            spec_extra=extra,
            draft_policy="fixed",
            prefix_cache=reuse,
        )
        runs[reuse] = await _serve(cfg, first)
    on, off = runs[True], runs[False]
    for i, (a, b) in enumerate(zip(on, off, strict=True)):
        assert a[0] == b[0], f"request {i}: tokens differ with reuse"
        assert a[2:] == b[2:], f"request {i}: drafted/accepted {a[2:]} with reuse, {b[2:]} without"
        assert b[1] == 0
    cached = [a[1] for a in on]
    if name == "mtp":  # a hybrid target's recurrent state cannot be cut back: reuse is off
        assert cached == [0] * len(on)
    else:
        assert cached == [0, 40 + 7 - 1, 39, 40 + len(on[2][0]) - 1, 20, 1, 0]


async def test_concurrent_requests_with_a_shared_prefix_equal_cold_ones(model_paths: dict[str, Path]) -> None:
    rng = random.Random(11)
    system = [rng.randrange(1000, 20000) for _ in range(48)]
    prompts = [system + [rng.randrange(1000, 20000) for _ in range(5)] for _ in range(12)]
    results = {}
    for reuse in (True, False):
        async with Engine(config(model_paths, "llama", n_seq=4, prefix_cache=reuse)) as engine:
            outs = await gather(
                *(engine.generate(p, SamplingParams(max_tokens=10, temperature=0)) for p in prompts)
            )
            results[reuse] = [o.token_ids for o in outs]
            hits, cached = engine.metrics.prefix_hits, [o.metrics.cached_tokens for o in outs]
            await wait_until(lambda: engine.slots_in_use() == 0)
        if reuse:
            assert hits == 8 and sorted(cached) == [0] * 4 + [48] * 8
    assert results[True] == results[False]


async def test_eviction_under_pressure_keeps_outputs_exact(model_paths: dict[str, Path]) -> None:
    rng = random.Random(5)
    stems = [[rng.randrange(1000, 20000) for _ in range(36)] for _ in range(5)]
    order = [0, 1, 2, 0, 3, 1, 4, 2, 0, 0]  # five stems over two slots
    results = {}
    for reuse in (True, False):
        async with Engine(config(model_paths, "llama", n_seq=2, prefix_cache=reuse)) as engine:
            outs = []
            for k, i in enumerate(order):
                r = await engine.generate(stems[i] + [100 + k], SamplingParams(max_tokens=6, temperature=0))
                outs.append((r.token_ids, r.metrics.cached_tokens))
            results[reuse] = outs
    assert [o[0] for o in results[True]] == [o[0] for o in results[False]]
    # stem 0 comes back twice after being evicted, and twice in a row (a hit)
    assert [o[1] for o in results[True]] == [0, 0, 0, 0, 0, 0, 0, 0, 0, 36]


async def test_a_cached_slot_rolled_back_by_a_stop_inside_drafts_reuses_exactly(
    model_paths: dict[str, Path],
) -> None:
    """Self-drafting accepts every draft: a stop token inside the drafts leaves the slot's KV
    cut back at the stop, and the next turn reuses exactly that."""
    first = _prompts(9)[0]
    results = {}
    for reuse in (True, False):
        cfg = config(
            model_paths, "llama", "llama", "draft", n_seq=1, draft_policy="fixed", prefix_cache=reuse
        )
        async with Engine(cfg) as engine:
            free = await engine.generate(first, SamplingParams(max_tokens=16, temperature=0))
            stop = free.token_ids[5]
            cut_before = engine.metrics.cut_tokens
            r1 = await engine.generate(
                first, SamplingParams(max_tokens=16, temperature=0, stop_token_ids=[stop])
            )
            cut = engine.metrics.cut_tokens - cut_before
            r2 = await engine.generate(
                first + r1.token_ids + [stop, 4242], SamplingParams(max_tokens=12, temperature=0)
            )
            results[reuse] = (r1.token_ids, r2.token_ids, r2.metrics.cached_tokens, cut, r1.finish_reason)
    on, off = results[True], results[False]
    assert on[:2] == off[:2]
    assert on[4] == "stop" and on[3] > 0, "the stop did not fall inside drafts"
    assert on[2] == len(first) + len(on[0])  # the prompt and what the caller saw


async def test_an_aborted_request_leaves_a_slot_the_next_one_reuses_exactly(
    model_paths: dict[str, Path],
) -> None:
    """Aborted mid-generation, perhaps while a step ran: the slot's KV may hold tokens past
    what the request saw; the next request cuts them off."""
    first = _prompts(13)[0]
    results = {}
    for reuse in (True, False):
        async with (
            Engine(config(model_paths, "llama", n_seq=1, prefix_cache=reuse)) as engine,
            anyio.create_task_group() as tg,
        ):
            victim = Task(tg, engine.generate, first, SamplingParams(max_tokens=300), request_id="v")
            requests = engine._scheduler.requests  # type: ignore[union-attr]
            await wait_until(lambda r=requests: "v" in r and len(r["v"].output_ids) > 3)  # type: ignore[misc]
            await engine.abort("v")
            seen = (await victim.result()).token_ids
            await wait_until(lambda: engine.slots_in_use() == 0)
            r = await engine.generate(first + seen[:2] + [77], SamplingParams(max_tokens=8, temperature=0))
            results[reuse] = (r.token_ids, r.metrics.cached_tokens)
            await assert_kv_accounted(engine)
    assert results[True][0] == results[False][0]
    assert results[True][1] == len(first) + 2


async def test_sliding_window_model_reuses_exactly_under_concurrency(model_paths: dict[str, Path]) -> None:
    """The tiny gemma3 attends over an 8-token window in 5 of its 6 layers: a prefix cut back
    far behind a cached sequence's end needs the window before the cut, which the (patched)
    cache keeps."""
    rng = random.Random(21)
    stems = [[rng.randrange(1000, 20000) for _ in range(30)] for _ in range(2)]
    prompts = [stems[i % 2] + [rng.randrange(1000, 20000) for _ in range(3)] for i in range(12)]
    results = {}
    for reuse in (True, False):
        async with Engine(config(model_paths, "gemma3-swa", n_seq=2, prefix_cache=reuse)) as engine:
            outs = []
            for i in range(0, len(prompts), 2):  # two at a time: their cells interleave
                pair = await gather(
                    *(
                        engine.generate(p, SamplingParams(max_tokens=20, temperature=0))
                        for p in prompts[i : i + 2]
                    )
                )
                outs += [(o.token_ids, o.metrics.cached_tokens, o.finish_reason) for o in pair]
            results[reuse] = outs
    assert [o[0] for o in results[True]] == [o[0] for o in results[False]]
    assert all(o[2] == "length" for o in results[True])  # no request failed a reuse
    assert [o[1] for o in results[True]] == [0, 0] + [30] * 10


def test_a_sliding_window_cache_keeps_hidden_cells_while_empty_ones_remain(models: ModelCache) -> None:
    """Patch 0004: without it, sequence 0's oldest cells (hidden by its window) are taken
    for new tokens while empty cells remain, and cutting it back loses the window before
    the cut (its positions 0..9 go; the cut below needs 5..11)."""
    model = models("gemma3-swa")
    rng = random.Random(0)
    a = [rng.randrange(1000, 20000) for _ in range(60)]
    b = [rng.randrange(1000, 20000) for _ in range(10)]
    cfg = ContextConfig(n_ctx=256, n_seq=2, n_batch=64, n_ubatch=64, kv_unified=True)

    def last_logits(ctx: Context, tokens: list[int], pos0: int, seq: int) -> np.ndarray:
        batch = Batch()
        batch.add_sequence(tokens, pos0, seq, logits="last")
        ctx.decode(batch)
        return np.array(ctx.logits[-1])

    ctx = Context.create(model, cfg)
    last_logits(ctx, b, 0, 1)  # cells 0..9
    last_logits(ctx, a[:40], 0, 0)  # cells 10..49
    ctx.kv_remove(1)  # the search for free cells starts at cell 0 again
    for p in range(40, 60):  # fills cells 0..9, then meets sequence 0's hidden cells
        last_logits(ctx, [a[p]], p, 0)
    assert ctx.seq_pos_min(0) == 0
    cut = 12
    assert cut - GEMMA_SWA + 1 > 0  # the window before the cut starts past position 0
    ctx.kv_remove(0, cut, None)
    got = last_logits(ctx, a[cut : cut + 1], cut, 0)
    ref_ctx = Context.create(model, cfg)
    ref = last_logits(ref_ctx, a[: cut + 1], 0, 0)
    assert float(np.abs(got - ref).max()) < 0.05
