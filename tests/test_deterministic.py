"""Deterministic serving (``EngineConfig(deterministic=True)``): a request's tokens do not
depend on what else the engine batches with it.

Two layers. The kernels: with ``batch_invariant`` a context computes a row's logits bit for
bit alike alone and beside 1-63 other rows, and a prompt's rows alike as one chunk and one
token at a time (vendor/patches/0010), for each CPU kernel family the tiny models reach:
F32 weights (tinyBLAS), Q8_0 (tinyBLAS's quantized kernel, as Gemma 3's layers and output)
and Q4_0 (repacked weights: gemm and gemv), with flash attention's one-row KV split and
64-row tiles in the same batches. Without it the same rows differ: the tests check that
too, so they keep measuring what the option removes. Then the engine: outputs served
together (n-gram drafts, the prefix cache, a draft model, preemption) equal each prompt's
output served alone.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from pathlib import Path

import numpy as np
import pytest

from engine import Engine, EngineConfig, SamplingParams
from engine.session import Batch, Context, ContextConfig, InvalidConfigError
from engine.session.checkpoint import unpack
from tests.conftest import ModelCache
from tests.helpers import OneTokenRows, config

KERNEL_MODELS = ["llama", "llama-q8", "llama-q4"]


def _rows_alone_and_batched(m, invariant: bool) -> list[bool]:  # type: ignore[no-untyped-def]
    """For n in 1..64: do n sequences' one-token rows, decoded together, give the logits
    each gave alone? (64 sequences of 12 tokens in one unified cache: 768 cells, so a lone
    row takes flash attention's KV split, and 64 rows its tiles.)"""
    n_seq = 64
    step = OneTokenRows(m, n_seq, hist=12, seed=7, batch_invariant=invariant)
    alone = np.concatenate([step(range(s, s + 1)) for s in range(n_seq)])
    return [bool(np.array_equal(step(range(n)), alone[:n])) for n in range(1, n_seq + 1)]


@pytest.mark.parametrize("name", KERNEL_MODELS)
def test_a_row_gives_the_same_logits_alone_and_in_batches_of_every_size(
    models: ModelCache, name: str
) -> None:
    m = models(name)
    same = _rows_alone_and_batched(m, invariant=True)
    assert all(same), (
        f"batch sizes whose rows differ from alone: {[n + 1 for n, ok in enumerate(same) if not ok]}"
    )
    assert not all(_rows_alone_and_batched(m, invariant=False)), (
        "the normal path no longer varies by batch size"
    )


def _chunk_and_one_by_one(m, invariant: bool) -> bool:  # type: ignore[no-untyped-def]
    """A 70-token prompt decoded as one chunk (every row's logits) against the same tokens
    decoded one at a time in another sequence."""
    tokens = np.random.default_rng(3).integers(10, m.n_vocab, 70).tolist()
    ctx = Context.create(
        m, ContextConfig(n_ctx=512, n_seq=2, n_batch=128, kv_unified=True, batch_invariant=invariant)
    )
    b = Batch()
    b.add_sequence(tokens, 0, 0, logits="all")
    ctx.decode(b)
    chunk = ctx.logits.copy()
    rows = []
    for i, t in enumerate(tokens):
        b = Batch()
        b.add(t, i, 1, True)
        ctx.decode(b)
        rows.append(ctx.logits.copy())
    return bool(np.array_equal(chunk, np.concatenate(rows)))


@pytest.mark.parametrize("name", KERNEL_MODELS)
def test_a_prompt_chunk_gives_the_logits_of_one_token_decodes(models: ModelCache, name: str) -> None:
    m = models(name)
    assert _chunk_and_one_by_one(m, invariant=True)
    assert not _chunk_and_one_by_one(m, invariant=False), "the normal path no longer varies by batch size"


# --- the engine ---------------------------------------------------------------------------

GREEDY = SamplingParams(max_tokens=40, ignore_eos=True)
NGRAM = {
    "spec_extra": {"ngram_size_n": 2, "ngram_size_m": 4}
}  # short keys: the prompts repeat short segments


def _prompts(n: int, seed: int) -> list[list[int]]:
    """Random prompts of 4-40 tokens, every fourth sharing the previous one's start (the
    prefix cache reuses it)."""
    rng = random.Random(seed)
    out: list[list[int]] = []
    for i in range(n):
        head = out[-1][:4] if i % 4 == 3 else []
        out.append(head + [rng.randrange(10, 250) for _ in range(rng.randrange(4, 36))])
    return out


async def _solo(
    cfg: EngineConfig, prompts: list[list[int]], params: SamplingParams = GREEDY
) -> list[list[int]]:
    """Each prompt alone: one sequence, no drafts, no prefix reuse."""
    solo = dataclasses.replace(cfg, n_seq=1, speculative="none", draft_model=None, prefix_cache=False)
    async with Engine(solo) as engine:
        return [(await engine.generate(p, params)).token_ids for p in prompts]


async def _together(
    engine: Engine, prompts: list[list[int]], params: SamplingParams = GREEDY
) -> list[list[int]]:
    outs = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("deterministic", [True, False])
async def test_outputs_served_together_equal_their_solo_runs(
    model_paths: dict[str, Path], deterministic: bool
) -> None:
    """48 prompts on 16 sequences, a draft model drafting every step and the prefix cache on
    (twice: the second round reuses the first's prefixes), against each prompt alone.
    Without the option some differ: a random tiny model has near-ties that the batch's
    rounding flips. (A random model never repeats its prompt, so n-gram drafts are checked
    on a walk model below, and on Gemma 3 in BENCHMARKS.md.)"""
    cfg = config(
        model_paths, "llama", "llama-soft", "draft", 16, deterministic=deterministic, draft_policy="fixed"
    )
    prompts = _prompts(48, seed=5)
    solo = await _solo(cfg, prompts)
    async with Engine(cfg) as engine:
        rounds = [await _together(engine, prompts) for _ in range(2)]
        assert engine.metrics.drafted > 0 and engine.metrics.prefix_hits > 0
    same = [sum(a == b for a, b in zip(r, solo, strict=True)) for r in rounds]
    if deterministic:
        assert same == [48, 48]
    else:
        assert min(same) < 48, "no output changed with its batch: the test no longer shows the variance"


#: (name, target, draft, speculative type): random tiny targets, whose near-ties the batch
#: shape flips without the option, except n-gram's
DRAFTERS = [
    ("ngram", "walk-llama-cycle6", None, "ngram-simple"),  # (its outputs cycle: n-grams match)
    ("draft", "llama", "llama-soft", "draft"),
    ("eagle3", "llama", "llama-eagle3", "eagle3"),
    ("dflash", "llama", "llama-dflash", "dflash"),
    ("mtp", "qwen35-mtp", None, "mtp"),
]


@pytest.mark.parametrize(("name", "target", "draft", "spec"), DRAFTERS, ids=[d[0] for d in DRAFTERS])
async def test_greedy_speculation_equals_no_speculation_token_for_token(
    model_paths: dict[str, Path], name: str, target: str, draft: str | None, spec: str
) -> None:
    """Every drafter, drafting on every step (the fixed policy) for 4 sequences at once: each
    output equals the prompt's output with no speculation, served alone."""
    extra = NGRAM if spec == "ngram-simple" else {}
    cfg = config(model_paths, target, draft, spec, 4, deterministic=True, draft_policy="fixed", **extra)
    prompts = _prompts(16, seed=9)
    solo = await _solo(cfg, prompts)
    async with Engine(cfg) as engine:
        together = await _together(engine, prompts)
        assert engine.metrics.drafted > 0
    assert together == solo


async def test_preempted_requests_equal_their_solo_runs(model_paths: dict[str, Path]) -> None:
    """Sequences swapped out and back in (to other slots) at almost every step."""
    cfg = config(model_paths, "llama", None, "ngram-simple", 2, deterministic=True, time_slice=0.01, **NGRAM)
    prompts = _prompts(8, seed=13)
    solo = await _solo(cfg, prompts)
    async with Engine(cfg) as engine:
        assert await _together(engine, prompts) == solo
        assert engine.metrics.preemptions >= 3


async def test_a_checkpoint_resumed_elsewhere_continues_as_the_solo_run(model_paths: dict[str, Path]) -> None:
    """Captured mid-flight beside other requests, resumed by another engine beside others:
    the tokens before and after equal the prompt's solo run."""
    cfg = config(model_paths, "llama", "llama-soft", "draft", 4, deterministic=True, draft_policy="fixed")
    prompt, *others = _prompts(7, seed=21)
    solo = (await _solo(cfg, [prompt]))[0]
    ids: list[int] = []
    ckpt = b""
    async with Engine(cfg) as engine:
        busy = [asyncio.ensure_future(engine.generate(p, GREEDY)) for p in others]
        async for delta in engine.stream(prompt, GREEDY, request_id="r"):
            ids.extend(delta.token_ids)
            if not ckpt and len(ids) >= 8:
                ckpt = await engine.checkpoint("r")
        await asyncio.gather(*busy)
    k = len(unpack(ckpt).meta["history"]) - unpack(ckpt).meta["n_prompt"] + 1  # tokens emitted when captured
    rest = SamplingParams(max_tokens=GREEDY.max_tokens - k, ignore_eos=True)
    async with Engine(cfg) as fresh:
        busy = [asyncio.ensure_future(fresh.generate(p, GREEDY)) for p in others[:3]]
        resumed = await fresh.generate("", rest, resume_from=ckpt)
        await asyncio.gather(*busy)
    assert ids == solo
    assert resumed.token_ids == solo[k:]


async def test_seeded_sampling_gives_the_same_tokens_under_any_concurrency(
    model_paths: dict[str, Path],
) -> None:
    """Each request's sampler is its own: a seed gives the same tokens alone and beside others."""
    cfg = config(model_paths, "llama-soft", None, "none", 8, deterministic=True)
    prompts = _prompts(16, seed=17)
    params = [
        SamplingParams(max_tokens=32, temperature=1.0, seed=100 + i, ignore_eos=True) for i in range(16)
    ]
    solo = dataclasses.replace(cfg, n_seq=1, prefix_cache=False)
    async with Engine(solo) as engine:
        alone = [(await engine.generate(p, sp)).token_ids for p, sp in zip(prompts, params, strict=True)]
    async with Engine(cfg) as engine:
        outs = await asyncio.gather(*(engine.generate(p, sp) for p, sp in zip(prompts, params, strict=True)))
    assert [o.token_ids for o in outs] == alone


def test_deterministic_takes_a_kv_stream_per_sequence_and_the_cpu(model_paths: dict[str, Path]) -> None:
    """A unified KV cache interleaves the sequences' cells, and attention sums a sequence's
    cells in cell order (see below): the option picks per-sequence streams and refuses a
    unified cache; its kernels are the CPU's, so it refuses GPU layers."""
    assert not config(model_paths, "llama", deterministic=True).unified_kv
    with pytest.raises(InvalidConfigError, match="kv_unified"):
        config(model_paths, "llama", deterministic=True, kv_unified=True)
    with pytest.raises(InvalidConfigError, match="n_gpu_layers"):
        config(model_paths, "llama", deterministic=True, n_gpu_layers=99)


def _logits_after_a_hole(m, unified: bool) -> tuple[np.ndarray, np.ndarray]:  # type: ignore[no-untyped-def]
    """A sequence's last 8 logits rows decoded one token at a time: first alone from cell 0,
    then after another sequence freed the cells before it, so that (in a unified cache) its
    later tokens land in cells below its earlier ones."""
    tokens = np.random.default_rng(5).integers(10, m.n_vocab, 24).tolist()

    def run(hole: bool) -> np.ndarray:
        ctx = Context.create(
            m, ContextConfig(n_ctx=256, n_seq=2, n_batch=64, kv_unified=unified, batch_invariant=True)
        )
        if hole:
            b = Batch()
            b.add_sequence(tokens[:16], 0, 1, logits="none")  # cells 0-15 (unified)
            ctx.decode(b)
        rows = []
        for i, t in enumerate(tokens):
            if hole and i == 12:
                ctx.kv_remove(1, 0, None)  # frees cells 0-15: the next tokens go there
            b = Batch()
            b.add(t, i, 0, True)
            ctx.decode(b)
            rows.append(ctx.logits.copy())
        return np.concatenate(rows[-8:])

    return run(False), run(True)


def test_a_sequence_whose_cells_are_out_of_order_attends_differently_in_a_unified_cache(
    models: ModelCache,
) -> None:
    """Why the option takes a KV stream per sequence: attention sums a sequence's cells in
    cell order, and in a unified cache that order depends on what other sequences freed.
    With a stream of its own the sequence's cells stay in position order."""
    m = models("llama")
    in_order, out_of_order = _logits_after_a_hole(m, unified=True)
    assert not np.array_equal(in_order, out_of_order)
    alone, after_hole = _logits_after_a_hole(m, unified=False)
    assert np.array_equal(alone, after_hole)
