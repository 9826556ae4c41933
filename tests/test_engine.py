"""The async engine on the real extension and tiny models."""

from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path

import pytest

from engine import (
    Engine,
    EngineConfig,
    QueueFullError,
    RequestError,
    SamplingParams,
    SpeculativeConfig,
)
from engine.session import InvalidArgumentError, InvalidConfigError, PromptTooLongError, StateError
from engine.session.checkpoint import unpack
from tests.conftest import ModelCache
from tests.spec_loop import greedy_plain, greedy_plain_margins, tie_safe_prefix

pytestmark = pytest.mark.timeout(600)

GREEDY = SamplingParams(max_tokens=24)


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


def mixed_requests(n: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        ([rng.randrange(1000, 20000) for _ in range(rng.randrange(2, 120))], rng.randrange(1, 33))
        for _ in range(n)
    ]


PARITY = [
    ("none", "llama", None, "none", {}),
    ("draft", "llama", "llama", "draft", {}),
    ("eagle3", "walk-llama", "walk-llama-eagle3", "eagle3", {}),
    ("dflash", "llama", "llama-dflash", "dflash", {}),
    ("mtp", "walk-qwen35-mtp", None, "mtp", {}),
    ("ngram", "walk-llama-cycle6", None, "ngram-simple", {"ngram_size_n": 2, "ngram_size_m": 4}),
]


@pytest.mark.slow
@pytest.mark.parametrize("n_seq", [4, 8])
@pytest.mark.parametrize("name,target,draft,spec,extra", PARITY, ids=[p[0] for p in PARITY])
async def test_64_concurrent_greedy_requests_equal_solo_plain_decoding(
    model_paths: dict[str, Path],
    models: ModelCache,
    name: str,
    target: str,
    draft: str | None,
    spec: str,
    extra: dict[str, int],
    n_seq: int,
) -> None:
    requests = mixed_requests(64, seed=n_seq)
    tm = models(target, mtp=spec == "mtp")
    expected = [greedy_plain_margins(tm, p, n) for p, n in requests]
    # "fixed": always draft n_draft_max, so the rejection and rollback paths run every step
    cfg = config(model_paths, target, draft, spec, n_seq, spec_extra=extra, draft_policy="fixed")
    async with Engine(cfg) as engine:
        outs = await asyncio.gather(*(engine.generate(p, SamplingParams(max_tokens=n)) for p, n in requests))
        exact = 0
        for (prompt, n), out, (exp, margins) in zip(requests, outs, expected, strict=True):
            k = tie_safe_prefix(margins)  # random weights: compare up to the first near-tie
            assert out.token_ids[:k] == exp[:k], (name, len(prompt), n)
            exact += k == n and out.token_ids == exp
            assert out.finish_reason == "length"
            assert out.metrics.completion_tokens == n
        assert exact >= 40, exact  # most requests are compared in full
        m = engine.metrics
        assert m.max_decode_calls_per_step == 1  # every step verified all sequences in ONE decode
        assert m.max_draft_calls_per_step <= 1
        if spec in ("draft", "ngram-simple") or name in ("eagle3", "mtp"):
            assert m.accepted > 0, name
        assert m.batch_occupancy > 0.5


def _chi2_p_value(a: list[int], b: list[int]) -> float:
    """Two-sample chi-square homogeneity test; p via the Wilson-Hilferty approximation."""
    import math

    na, nb = sum(a), sum(b)
    stat, dof = 0.0, -1
    for x, y in zip(a, b, strict=True):
        tot = x + y
        if tot == 0:
            continue
        ea, eb = tot * na / (na + nb), tot * nb / (na + nb)
        stat += (x - ea) ** 2 / ea + (y - eb) ** 2 / eb
        dof += 1
    if dof <= 0:
        return 1.0
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def _histograms(x: list[int], y: list[int]) -> tuple[list[int], list[int]]:
    from collections import Counter

    cx, cy = Counter(x), Counter(y)
    common = [t for t in set(cx) | set(cy) if cx[t] + cy[t] >= 10]
    hx = [cx[t] for t in common] + [sum(v for t, v in cx.items() if t not in common)]
    hy = [cy[t] for t in common] + [sum(v for t, v in cy.items() if t not in common)]
    return hx, hy


@pytest.mark.slow
async def test_sampling_is_lossless(model_paths: dict[str, Path]) -> None:
    """At temperature 1 the first tokens have the same distribution with and without drafts."""
    n, prompt = 400, [1000, 2000, 3000, 4000]
    samples = {}
    for spec in ("none", "draft"):
        cfg = config(model_paths, "llama-soft", "llama-soft" if spec == "draft" else None, spec, 8)
        async with Engine(cfg) as engine:
            outs = await asyncio.gather(
                *(
                    engine.generate(prompt, SamplingParams(max_tokens=3, temperature=1.0, seed=i))
                    for i in range(n)
                )
            )
            samples[spec] = [o.token_ids for o in outs]
            if spec == "draft":
                assert engine.metrics.accepted > 0 and engine.metrics.accepted < engine.metrics.drafted
    for pos in range(3):
        hx, hy = _histograms([s[pos] for s in samples["none"]], [s[pos] for s in samples["draft"]])
        assert len(hx) >= 3  # the test has something to compare
        assert _chi2_p_value(hx, hy) > 1e-3, (pos, hx, hy)
    # and the samples are not all equal: temperature 1 really samples
    assert len({tuple(s) for s in samples["none"]}) > 20


async def test_cancelled_streams_leave_no_trace(model_paths: dict[str, Path], models: ModelCache) -> None:
    requests = mixed_requests(32, seed=7)
    tm = models("walk-llama")
    expected = [greedy_plain(tm, p, n) for p, n in requests]
    rng = random.Random(3)
    cancel_after = {i: rng.randrange(0, 6) for i in rng.sample(range(32), 16)}
    async with Engine(config(model_paths, "walk-llama", "walk-llama-eagle3", "eagle3", 4)) as engine:

        async def consume(i: int) -> list[int] | None:
            prompt, n = requests[i]
            ids: list[int] = []
            async for delta in engine.stream(prompt, SamplingParams(max_tokens=n)):
                ids.extend(delta.token_ids)
                if i in cancel_after and len(ids) >= cancel_after[i]:
                    return None  # leaving the loop early aborts the request
            return ids

        async def cancel_task(i: int) -> list[int] | None:
            task = asyncio.create_task(consume(i))
            if i in cancel_after and cancel_after[i] % 2:
                await asyncio.sleep(0.001 * cancel_after[i])
                task.cancel()
            try:
                return await task
            except asyncio.CancelledError:
                return None

        results = await asyncio.gather(*(cancel_task(i) for i in range(32)))
        for i, got in enumerate(results):
            if i not in cancel_after:
                assert got == expected[i], i
        for _ in range(200):
            if engine.slots_in_use() == 0:
                break
            await asyncio.sleep(0.01)
        assert engine.slots_in_use() == 0
        assert await engine.kv_positions() == [-1] * 4
        # and the engine still serves
        out = await engine.generate(requests[0][0], SamplingParams(max_tokens=requests[0][1]))
        assert out.token_ids == expected[0]


@pytest.mark.parametrize("policy", ["adaptive", "fixed"])
async def test_checkpoint_and_resume(model_paths: dict[str, Path], models: ModelCache, policy: str) -> None:
    cfg = config(model_paths, "walk-llama", "walk-llama-eagle3", "eagle3", 4, draft_policy=policy)
    prompt = models("walk-llama").tokenize("The quick brown fox")
    n_total = 40
    async with Engine(cfg) as engine:
        others = [
            asyncio.create_task(engine.generate(p, SamplingParams(max_tokens=n)))
            for p, n in mixed_requests(3, seed=11)
        ]
        ids: list[int] = []
        ckpt = b""
        async for delta in engine.stream(prompt, SamplingParams(max_tokens=n_total), request_id="r"):
            ids.extend(delta.token_ids)
            if not ckpt and len(ids) >= 8:
                # other sequences are mid-flight: the capture waits for the step boundary
                ckpt = await engine.checkpoint("r")
        await asyncio.gather(*others)
        meta = unpack(ckpt).meta
        k = len(meta["history"]) - meta["n_prompt"] + 1  # tokens emitted when captured
        assert 8 <= k < n_total and ids[k - 1] == meta["last"]
        resumed = await engine.generate("", SamplingParams(max_tokens=n_total - k), resume_from=ckpt)
        assert resumed.token_ids == ids[k:]
        # corrupted and foreign checkpoints: typed errors, and the engine goes on
        broken = bytearray(ckpt)
        broken[len(broken) // 3] ^= 1
        with pytest.raises(StateError):
            await engine.generate("", GREEDY, resume_from=bytes(broken))
        with pytest.raises(StateError):
            await engine.generate("", GREEDY, resume_from=b"not a checkpoint")
        assert (await engine.generate(prompt, SamplingParams(max_tokens=n_total))).token_ids == ids
    async with Engine(cfg) as fresh:  # another Engine instance resumes it too
        resumed = await fresh.generate("", SamplingParams(max_tokens=n_total - k), resume_from=ckpt)
        assert resumed.token_ids == ids[k:]
    async with Engine(config(model_paths, "llama")) as foreign:
        with pytest.raises(StateError, match="another model"):
            await foreign.generate("", GREEDY, resume_from=ckpt)
        assert (await foreign.generate("hello", GREEDY)).finish_reason == "length"


async def test_resume_with_more_prompt_and_final_checkpoint(
    model_paths: dict[str, Path], models: ModelCache
) -> None:
    """Multi-turn reuse: the final state of turn 1 plus turn 2's tokens equals the full prompt."""
    tm = models("llama")
    turn1 = tm.tokenize("First turn")
    async with Engine(config(model_paths, "llama", "llama", "draft", 2)) as engine:
        out1 = await engine.generate(turn1, SamplingParams(max_tokens=10), checkpoint=True)
        assert out1.checkpoint is not None
        more = tm.tokenize(" and the second", add_special=False)
        out2 = await engine.generate(more, SamplingParams(max_tokens=10), resume_from=out1.checkpoint)
        meta = unpack(out1.checkpoint).meta
        full = [*meta["history"], meta["last"], *more]
        assert out2.token_ids == greedy_plain(tm, full, 10)
        assert out2.metrics.prompt_tokens == len(more)


async def test_event_loop_is_never_blocked(model_paths: dict[str, Path]) -> None:
    gaps: list[float] = []
    stop = asyncio.Event()

    async def ticker() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            await asyncio.sleep(0.002)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    async with Engine(config(model_paths, "walk-llama", "walk-llama-eagle3", "eagle3", 8)) as engine:
        task = asyncio.create_task(ticker())

        async def consume(prompt: list[int], n: int) -> int:
            count = 0
            async for d in engine.stream(prompt, SamplingParams(max_tokens=n)):
                count += len(d.token_ids)
            return count

        counts = await asyncio.gather(*(consume(p, 32) for p, _ in mixed_requests(16, seed=5)))
        stop.set()
        await task
    assert counts == [32] * 16
    assert engine.metrics.steps > 20
    assert max(gaps) < 0.1, max(gaps)


async def test_stop_strings_utf8_and_limits(model_paths: dict[str, Path], models: ModelCache) -> None:
    tm = models("walk-llama")
    prompt = tm.tokenize("The quick brown fox")
    async with Engine(config(model_paths, "walk-llama", max_queue=3, n_seq=2)) as engine:
        full = await engine.generate(prompt, SamplingParams(max_tokens=12))
        pieces = [tm.token_to_piece(t).decode() for t in full.token_ids]
        # a stop string that starts inside token 3 and ends inside token 4
        stop = pieces[3][-2:] + pieces[4][:2]
        cut = full.text.index(stop)
        out = await engine.generate(prompt, SamplingParams(max_tokens=12, stop=(stop,)))
        assert out.finish_reason == "stop" and out.text == full.text[:cut]
        deltas = [d async for d in engine.stream(prompt, SamplingParams(max_tokens=12, stop=(stop,)))]
        assert "".join(d.text for d in deltas) == full.text[:cut]
        assert deltas[-1].finish_reason == "stop"
        # stop token ids end generation without being emitted
        out = await engine.generate(
            prompt, SamplingParams(max_tokens=12, stop_token_ids=(full.token_ids[2],))
        )
        assert out.token_ids == full.token_ids[:2] and out.finish_reason == "stop"
        # chat messages use the model's template
        chat = await engine.generate([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=4))
        assert chat.metrics.prompt_tokens > 2
        # bad requests fail alone, with typed errors
        with pytest.raises(InvalidArgumentError):
            await engine.generate("", GREEDY)
        with pytest.raises(InvalidArgumentError):
            await engine.generate([tm.n_vocab + 1], GREEDY)
        with pytest.raises(PromptTooLongError):
            await engine.generate([1000] * 300, GREEDY)
        bad_prompts: list[object] = [
            [],
            None,
            42,
            [1.5],
            [True],
            ["hi"],
            [{"role": "user"}],
            [{"content": "no role"}],
            [{"role": 3, "content": "x"}],
            [{"role": "user", "content": ["not", "text"]}],
            [{"role": "user", "content": "x"}, 5],
        ]
        for bad_prompt in bad_prompts:
            with pytest.raises(InvalidArgumentError):
                await engine.generate(bad_prompt, GREEDY)  # type: ignore[arg-type]
        with pytest.raises(InvalidConfigError):
            EngineConfig(model=model_paths["walk-llama"], threads=0)
        for bad in ({"max_tokens": 0}, {"temperature": -1.0}, {"top_p": 0.0}, {"top_k": -1}, {"stop": ("",)}):
            with pytest.raises(InvalidConfigError):
                SamplingParams(**bad)  # type: ignore[arg-type]
        await engine.abort("no-such-request")  # a no-op
        # the wait queue is bounded: two running, three waiting, the next is refused
        long = SamplingParams(max_tokens=200, ignore_eos=True)
        running = [asyncio.create_task(engine.generate(prompt, long)) for _ in range(2)]
        while engine.slots_in_use() < 2:
            await asyncio.sleep(0.001)
        running += [asyncio.create_task(engine.generate(prompt, long)) for _ in range(3)]
        await asyncio.sleep(0.01)
        with pytest.raises(QueueFullError):
            await engine.generate(prompt, GREEDY)
        for t in running:
            t.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        assert (await engine.generate(prompt, SamplingParams(max_tokens=12))).token_ids == full.token_ids


async def test_utf8_deltas_are_whole_characters(model_paths: dict[str, Path]) -> None:
    async with Engine(config(model_paths, "llama")) as engine:
        for prompt, n in mixed_requests(12, seed=21):
            deltas = [d async for d in engine.stream(prompt, SamplingParams(max_tokens=n))]
            text = "".join(d.text for d in deltas)
            out_ids = [t for d in deltas for t in d.token_ids]
            assert len(out_ids) == n
            assert text == engine.model.detokenize(out_ids)  # streamed text == one-shot text


async def test_grammar_and_json_schema(model_paths: dict[str, Path]) -> None:
    async with Engine(config(model_paths, "llama", "llama", "draft", 4)) as engine:
        outs = await asyncio.gather(
            *(
                engine.generate(
                    [1000 + i, 2000], SamplingParams(max_tokens=8, grammar='root ::= "yes" | "no"')
                )
                for i in range(4)
            )
        )
        assert all(o.text in ("yes", "no") for o in outs), [o.text for o in outs]
        schema = {"type": "string", "enum": ["red", "green", "blue"]}
        out = await engine.generate([1000, 2000], SamplingParams(max_tokens=8, json_schema=schema))
        assert json.loads(out.text) in ("red", "green", "blue")
        # a malformed grammar fails its request only
        good = asyncio.create_task(engine.generate([1000, 2000], SamplingParams(max_tokens=16)))
        with pytest.raises(RequestError) as info:
            await engine.generate([1000, 2000], SamplingParams(max_tokens=8, grammar="root ::= ((("))
        assert isinstance(info.value.__cause__, InvalidArgumentError)
        # so does a malformed JSON schema, with the reason in the message
        for bad_schema, why in (
            ({"type": "nonsense"}, "unrecognized type"),
            ({"type": "object", "properties": 5}, "properties must be an object"),
            ({"$ref": "#/nowhere"}, "cannot resolve"),
            ("{not json", "parse error"),
        ):
            with pytest.raises(RequestError) as info:
                await engine.generate([1000, 2000], SamplingParams(max_tokens=8, json_schema=bad_schema))
            assert isinstance(info.value.__cause__, InvalidArgumentError) and why in str(info.value)
        assert (await good).metrics.completion_tokens == 16


async def test_context_end_finishes_with_length(model_paths: dict[str, Path]) -> None:
    async with Engine(
        config(model_paths, "walk-llama", "walk-llama-eagle3", "eagle3", 2, n_ctx=64)
    ) as engine:
        out = await engine.generate([1000] * 40, SamplingParams(max_tokens=100))
        assert out.finish_reason == "length" and 40 + len(out.token_ids) <= 64
        again = await engine.generate([1000] * 10, SamplingParams(max_tokens=5))
        assert again.metrics.completion_tokens == 5
