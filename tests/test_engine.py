"""The async engine on the real extension and tiny models."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import anyio
import pytest

from engine import (
    Engine,
    EngineConfig,
    QueueFullError,
    RequestError,
    SamplingParams,
)
from engine.scheduler.drafting import Drafting, StepCost
from engine.session import InvalidArgumentError, InvalidConfigError, PromptTooLongError, StateError
from engine.session.checkpoint import unpack
from tests.aio import Task, gather
from tests.conftest import ModelCache
from tests.helpers import PARITY, assert_kv_accounted, both_backends, config, mixed_requests, wait_until  # noqa: F401 - both backends
from tests.spec_loop import greedy_plain

pytestmark = pytest.mark.timeout(600)


GREEDY = SamplingParams(max_tokens=24)


@pytest.mark.slow
@pytest.mark.parametrize(("anyio_backend", "n_seq"), [("asyncio", 4), ("trio", 8)])
@pytest.mark.parametrize(("name", "target", "draft", "spec", "extra"), PARITY, ids=[p[0] for p in PARITY])
async def test_64_concurrent_greedy_requests_equal_solo_plain_decoding(
    model_paths: dict[str, Path],
    models: ModelCache,
    name: str,
    target: str,
    draft: str | None,
    spec: str,
    extra: dict[str, int],
    n_seq: int,
    anyio_backend: str,
) -> None:
    requests = mixed_requests(64, seed=n_seq)
    tm = models(target, mtp=spec == "mtp")
    expected = [greedy_plain(tm, p, n) for p, n in requests]
    # "fixed": always draft n_draft_max, so the rejection and rollback paths run every step
    cfg = config(model_paths, target, draft, spec, n_seq, spec_extra=extra, draft_policy="fixed")
    async with Engine(cfg) as engine:
        outs = await gather(*(engine.generate(p, SamplingParams(max_tokens=n)) for p, n in requests))
        for (prompt, n), out, exp in zip(requests, outs, expected, strict=True):
            assert out.token_ids == exp, (name, len(prompt), n)
            assert out.finish_reason == "length"
            assert out.metrics.completion_tokens == n
        m = engine.metrics
        assert m.max_decode_calls_per_step == 1  # every step verified all sequences in ONE decode
        assert m.max_draft_calls_per_step <= 1
        if name in ("draft-self", "mtp", "ngram"):
            assert m.accepted > 0.9 * m.drafted, (name, m.accepted, m.drafted)  # always right
        if name in ("eagle3", "dflash"):  # the oracles: the first draft token, never a later one
            assert len(m.accepted_per_position) == 1 and m.accepted > 0.25 * m.drafted, (name, m)
        if name == "draft":
            assert m.drafted > m.accepted, name  # drafts were rejected and rolled back
        assert m.batch_occupancy > 0.5


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
            async with anyio.create_task_group() as tg:
                task = Task(tg, consume, i)
                if i in cancel_after and cancel_after[i] % 2:
                    await anyio.sleep(0.001 * cancel_after[i])
                    task.cancel()
            return None if task.cancelled else await task.result()

        results = await gather(*(cancel_task(i) for i in range(32)))
        for i, got in enumerate(results):
            if i not in cancel_after:
                assert got == expected[i], i
        await wait_until(lambda: engine.slots_in_use() == 0)
        await assert_kv_accounted(engine)
        # and the engine still serves
        out = await engine.generate(requests[0][0], SamplingParams(max_tokens=requests[0][1]))
        assert out.token_ids == expected[0]


@pytest.mark.parametrize("policy", ["adaptive", "fixed"])
async def test_checkpoint_and_resume(model_paths: dict[str, Path], models: ModelCache, policy: str) -> None:
    cfg = config(model_paths, "walk-llama", "walk-llama-eagle3", "eagle3", 4, draft_policy=policy)
    prompt = models("walk-llama").tokenize("The quick brown fox")
    n_total = 40
    async with Engine(cfg) as engine, anyio.create_task_group() as tg:
        others = [
            Task(tg, engine.generate, p, SamplingParams(max_tokens=n)) for p, n in mixed_requests(3, seed=11)
        ]
        ids: list[int] = []
        ckpt = b""
        async for delta in engine.stream(prompt, SamplingParams(max_tokens=n_total), request_id="r"):
            ids.extend(delta.token_ids)
            if not ckpt and len(ids) >= 8:
                # other sequences are mid-flight: the capture waits for the step boundary
                ckpt = await engine.checkpoint("r")
        await gather(*(t.result() for t in others))
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
    stop = anyio.Event()

    async def ticker() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            await anyio.sleep(0.002)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    async def consume(engine: Engine, prompt: list[int], n: int) -> int:
        count = 0
        async for d in engine.stream(prompt, SamplingParams(max_tokens=n)):
            count += len(d.token_ids)
        return count

    cfg = config(model_paths, "walk-llama", "walk-llama-eagle3", "eagle3", 8)
    async with Engine(cfg) as engine, anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        counts = await gather(*(consume(engine, p, 32) for p, _ in mixed_requests(16, seed=5)))
        stop.set()
    assert counts == [32] * 16
    assert engine.metrics.steps > 20
    assert max(gaps) < 0.1, max(gaps)


@pytest.mark.anyio
async def test_a_caller_that_goes_on_at_once_is_in_the_next_step(model_paths: dict[str, Path]) -> None:
    """A caller whose request ended and who submits the next one at once (a client in a
    loop) gets its first token from the very next step, not one later: the step waits a
    few event-loop turns for it before it is planned. (Counted as the steps between the
    last request's end and the first token, as the caller reads them: under trio, which
    orders ready tasks at random, a caller now and then reads a token only after the next
    step ended, so one late reading of six is let pass; before, every one took 2.)"""
    gaps: list[int] = []
    prompts: list[str | list[int]] = [
        [1, 700, 800],
        [1, 900],
        "once upon a time",
        [1, 1000, 1100],
        "a cat",
        [1, 1200],
    ]
    async with Engine(config(model_paths, "walk-llama", n_seq=2)) as engine, anyio.create_task_group() as tg:
        busy = Task(tg, engine.generate, [1, 500, 600], SamplingParams(max_tokens=160, ignore_eos=True))
        await anyio.sleep(0)
        for prompt in [[1, 300], *prompts]:
            ended = engine.metrics.steps
            first = None
            async for delta in engine.stream(prompt, SamplingParams(max_tokens=3, ignore_eos=True)):
                if delta.token_ids and first is None:
                    first = engine.metrics.steps
            assert first is not None
            gaps.append(first - ended)
        assert (await busy.result()).finish_reason == "length"
    late = gaps[1:]  # (the first one's "end" is the engine's start)
    assert all(g >= 1 for g in late) and sum(g > 1 for g in late) <= 1, gaps


@pytest.mark.anyio
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
        # the session's rule, told before the engine starts: a batch holds a longest draft
        with pytest.raises(InvalidConfigError, match=r"n_batch 8 < n_draft_max \+ 1 = 17"):
            EngineConfig(model=model_paths["walk-llama"], n_batch=8, speculative="ngram-simple")
        for bad in ({"max_tokens": 0}, {"temperature": -1.0}, {"top_p": 0.0}, {"top_k": -1}, {"stop": ("",)}):
            with pytest.raises(InvalidConfigError):
                SamplingParams(**bad)  # type: ignore[arg-type]
        await engine.abort("no-such-request")  # a no-op
        # the wait queue is bounded: two running, three waiting, the next is refused
        long = SamplingParams(max_tokens=200, ignore_eos=True)
        async with anyio.create_task_group() as tg:
            for _ in range(2):
                tg.start_soon(engine.generate, prompt, long)
            await wait_until(lambda: engine.slots_in_use() == 2)
            for _ in range(3):
                tg.start_soon(engine.generate, prompt, long)
            await wait_until(lambda: engine.metrics.queue_depth == 3)
            with pytest.raises(QueueFullError):
                await engine.generate(prompt, GREEDY)
            tg.cancel_scope.cancel()
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
        outs = await gather(
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
        async with anyio.create_task_group() as tg:
            good = Task(tg, engine.generate, [1000, 2000], SamplingParams(max_tokens=16))
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
            assert (await good.result()).metrics.completion_tokens == 16


async def test_context_end_finishes_with_length(model_paths: dict[str, Path]) -> None:
    async with Engine(
        config(model_paths, "walk-llama", "walk-llama-eagle3", "eagle3", 2, n_ctx=64)
    ) as engine:
        out = await engine.generate([1000] * 40, SamplingParams(max_tokens=100))
        assert out.finish_reason == "length" and 40 + len(out.token_ids) <= 64
        again = await engine.generate([1000] * 10, SamplingParams(max_tokens=5))
        assert again.metrics.completion_tokens == 5


RESUME_SCRIPT = """
import json, sys
import anyio
from engine import Engine, EngineConfig, SamplingParams, SpeculativeConfig

async def main():
    target, draft, path = sys.argv[1:4]
    config = EngineConfig(model=target, draft_model=draft, speculative=SpeculativeConfig("eagle3", n_draft_max=3),
                          n_seq=4, n_ctx=256, n_batch=256, threads=2)
    async with Engine(config) as engine:
        out = await engine.generate([5000, 5001], SamplingParams(max_tokens=12), resume_from=open(path, "rb").read())
    print(json.dumps(out.token_ids))

anyio.run(main)
"""


async def test_a_checkpoint_resumes_in_another_process(
    model_paths: dict[str, Path], models: ModelCache, tmp_path: Path
) -> None:
    import subprocess
    import sys

    cfg = config(model_paths, "walk-llama", "walk-llama-eagle3", "eagle3", 4)
    prompt = [1000, 2000, 3000]
    async with Engine(cfg) as engine:
        first = await engine.generate(prompt, SamplingParams(max_tokens=9), checkpoint=True)
        assert first.checkpoint is not None
        here = await engine.generate(
            [5000, 5001], SamplingParams(max_tokens=12), resume_from=first.checkpoint
        )
    path = tmp_path / "turn1.ckpt"
    path.write_bytes(first.checkpoint)
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            RESUME_SCRIPT,
            str(model_paths["walk-llama"]),
            str(model_paths["walk-llama-eagle3"]),
            str(path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert run.returncode == 0, run.stderr
    there = json.loads(run.stdout)
    assert there == here.token_ids
    assert there == greedy_plain(models("walk-llama"), [*prompt, *first.token_ids, 5000, 5001], 12)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_drafting_with_per_sequence_kv_streams_stays_one_decode(
    model_paths: dict[str, Path], models: ModelCache, anyio_backend: str
) -> None:
    """n_seq > 16: per-sequence KV streams. The adaptive policy gives every decoding
    sequence the same draft length (one pass), drafts when that pays (the MTP oracle does
    on a machine where a row costs next to nothing; on this one its head costs more than
    the tiny target, and the policy rightly drafts nothing), and greedy output is unchanged."""
    n_seq = 20
    cfg = config(model_paths, "walk-qwen35-mtp", None, "mtp", n_seq, n_ctx=128, n_batch=256)
    assert not cfg.unified_kv
    requests = mixed_requests(n_seq, seed=17)
    tm = models("walk-qwen35-mtp", mtp=True)
    async with Engine(cfg) as engine:
        flat = StepCost()
        flat.calibrate(lambda rows, prompt: 0.05, 256)
        engine._scheduler.policy.cost = flat  # type: ignore[union-attr]
        outs = await gather(*(engine.generate(p, SamplingParams(max_tokens=n)) for p, n in requests))
        assert [o.token_ids for o in outs] == [greedy_plain(tm, p, n) for p, n in requests]
        m = engine.metrics
        assert m.accepted > 0 and m.max_decode_calls_per_step == 1, m


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_drafts_padded_to_a_whole_tile_never_split_the_decode(
    model_paths: dict[str, Path], models: ModelCache, anyio_backend: str
) -> None:
    """On a machine whose output rows come in tiles of four, a step pads drafts to a whole
    tile; when prompt chunks fill the batch there is no room for the fillers, and the step
    drops the partial tile instead: still one decode per step, greedy output unchanged
    (padding past n_batch made the step two decodes: checked to fail without the cap)."""
    cfg = config(
        model_paths,
        "walk-llama-cycle6",
        None,
        "ngram-simple",
        2,
        n_batch=14,  # 7 kept for prompts; one decoding sequence drafts 6 of its 12 (7 rows)
        n_draft_max=12,
        draft_policy="fixed",
        spec_extra={"ngram_size_n": 2, "ngram_size_m": 12},
    )
    tm = models("walk-llama-cycle6")
    first, second = ([1, 2, 3], 160), (list(range(500, 600)), 8)
    async with Engine(cfg) as engine, anyio.create_task_group() as tg:
        engine._scheduler.policy.cost = StepCost(align=4)  # type: ignore[union-attr]
        a = Task(tg, engine.generate, first[0], SamplingParams(max_tokens=first[1]))
        await wait_until(lambda: engine.metrics.accepted >= 6)  # A drafts: the cycle repeats
        b = await engine.generate(second[0], SamplingParams(max_tokens=second[1]))
        out_a = await a.result()
        assert engine.metrics.max_decode_calls_per_step == 1, engine.metrics
    assert out_a.token_ids == greedy_plain(tm, *first)
    assert b.token_ids == greedy_plain(tm, *second)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize(
    ("target", "draft", "spec"),
    [
        ("walk-llama", "walk-llama-eagle3", "eagle3"),
        ("walk-llama", "walk-llama-dflash-oracle", "dflash"),
        ("walk-qwen35-mtp", None, "mtp"),
    ],
    ids=["eagle3", "dflash", "mtp"],
)
async def test_a_stream_drafter_skipped_once_drafts_no_more_for_that_sequence(
    model_paths: dict[str, Path],
    models: ModelCache,
    anyio_backend: str,
    target: str,
    draft: str | None,
    spec: str,
) -> None:
    """Hidden-state drafters read every batch as it is decoded. While the gate is closed
    the batches go past them (and the target extracts no hidden states): the running
    request and a request whose prompt is read then draft no more, and greedy output is
    unchanged. A request that starts once the gate is open again drafts, beside the one
    still out of sync, whose rows the drafter now reads too (after a gap in its cache)."""
    cfg = config(model_paths, target, draft, spec, 2, draft_policy="fixed")
    tm = models(target, mtp=spec == "mtp")
    feed = [True]
    long, short = ([1, 2, 3], 150), (list(range(40, 60)), 12)
    async with Engine(cfg) as engine, anyio.create_task_group() as tg:
        engine._scheduler.policy.sync_step = lambda *args: feed[0]  # type: ignore[union-attr,method-assign]
        a = Task(tg, engine.generate, long[0], SamplingParams(max_tokens=long[1]))
        await wait_until(lambda: engine.metrics.accepted >= 2)
        feed[0] = False
        skipped = engine.metrics.steps
        await wait_until(lambda: engine.metrics.steps >= skipped + 2)
        b = await engine.generate(short[0], SamplingParams(max_tokens=short[1]))
        feed[0] = True
        c = await engine.generate(short[0][::-1], SamplingParams(max_tokens=short[1]))
        assert engine._scheduler.requests, "the long request must still run beside the last one"  # type: ignore[union-attr]
        drafted_a_after = engine.metrics.drafted - b.metrics.drafted - c.metrics.drafted
        out_a = await a.result()
    assert out_a.token_ids == greedy_plain(tm, *long)
    assert b.token_ids == greedy_plain(tm, *short) and b.metrics.drafted == 0
    assert c.token_ids == greedy_plain(tm, short[0][::-1], short[1]) and c.metrics.accepted > 0
    assert out_a.metrics.drafted <= drafted_a_after  # nothing drafted for it after the skip
    assert engine.metrics.max_decode_calls_per_step == 1


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_draft_model_catches_up_on_the_history_it_skipped(
    model_paths: dict[str, Path], models: ModelCache, anyio_backend: str
) -> None:
    """A draft model decodes nothing on steps without drafts; before it drafts again it
    decodes what it skipped. Self-drafting a random (context-dependent) model, its drafts
    are right only if it saw the whole history: checked to fail without the catch-up."""
    cfg = config(model_paths, "llama", "llama", "draft", 2)
    calls = [0]

    def every_third(seqs: list[Drafting]) -> list[int]:
        calls[0] += 1
        return [s.max_k if calls[0] % 3 == 0 else 0 for s in seqs]

    tm = models("llama")
    requests = [([1, 2, 3, 4, 5], 40), (list(range(300, 340)), 30)]
    async with Engine(cfg) as engine:
        engine._scheduler.policy.lengths = every_third  # type: ignore[union-attr,method-assign]
        outs = await gather(*(engine.generate(p, SamplingParams(max_tokens=n)) for p, n in requests))
        m = engine.metrics
    assert [o.token_ids for o in outs] == [greedy_plain(tm, p, n) for p, n in requests]
    assert m.drafted >= 30 and m.accepted >= 0.9 * m.drafted, m


@pytest.mark.parametrize("spec", ["ngram-simple", "ngram-map-k", "ngram-cache", "mtp"])
def test_the_library_and_the_cli_give_one_set_of_drafter_defaults(
    spec: str, model_paths: dict[str, Path]
) -> None:
    """``EngineConfig(speculative=name)``, what an async app writes, drafts as ``--spec name``
    does (before: llama.cpp's 3-token drafts and 12-token n-gram keys against the CLI's 16 and 4)."""
    from engine.cli import _engine_config, _parser

    model = str(model_paths["walk-llama"])
    args = _parser().parse_args(["run", "--model", model, "--spec", spec])
    cli = _engine_config(args, args.spec, 4)
    library = EngineConfig(model=model, speculative=spec, n_seq=4)
    assert library.spec == cli.spec
    assert (library.spec.n_draft_max, library.spec.ngram_size_n) == (16, 4)
