"""Shutdown, slow consumers and misuse from many threads: nothing hangs, nothing crashes."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import anyio
import pytest

from engine import Engine, EngineConfig, RequestError, SamplingParams, SpeculativeConfig
from engine.scheduler.request import RequestState
from engine.session import ClosedError, ContextConfig, Runtime, SessionError, SpeculativeSession
from tests.aio import Task, gather
from tests.conftest import ModelCache
from tests.helpers import assert_kv_accounted, both_backends, config, wait_until  # noqa: F401 - both backends

pytestmark = pytest.mark.timeout(300)


def eagle_config(paths: dict[str, Path], **kw: object) -> EngineConfig:
    return config(paths, "walk-llama", "walk-llama-eagle3", "eagle3", 4, n_ctx=512, **kw)


async def test_close_with_requests_in_flight(model_paths: dict[str, Path]) -> None:
    long = SamplingParams(max_tokens=400, ignore_eos=True)

    async def consume(engine: Engine) -> list[str | None]:
        return [d.finish_reason async for d in engine.stream([1000, 3000], long)]

    async with anyio.create_task_group() as tg:
        engine = Engine(eagle_config(model_paths))
        await engine.start()
        tasks = [Task(tg, engine.generate, [1000 + i, 2000], long) for i in range(50)]
        stream = Task(tg, consume, engine)
        await wait_until(lambda: engine.metrics.steps >= 5)
        t0 = time.perf_counter()
        await engine.close()
        with anyio.fail_after(1.0):
            outs = [await t.result() for t in tasks]
            reasons = await stream.result()
        assert time.perf_counter() - t0 < 1.0
    assert {o.finish_reason for o in outs} == {"abort"}
    assert reasons[-1] == "abort"
    await engine.close()  # twice is fine
    with pytest.raises(ClosedError):
        await engine.generate("hello", SamplingParams(max_tokens=4))
    async with Engine(eagle_config(model_paths)) as again:  # and a new engine works
        assert (await again.generate([1000, 2000], SamplingParams(max_tokens=4))).finish_reason == "length"


async def test_a_stalled_consumer_pauses_only_its_request(model_paths: dict[str, Path]) -> None:
    """A consumer that stops reading pauses its request with at most ``stream_buffer``
    deltas waiting; the others go on; reading again resumes it."""
    buffer = 4
    async with Engine(eagle_config(model_paths, stream_buffer=buffer)) as engine:
        stalled = engine.stream([1000, 2000], SamplingParams(max_tokens=200, ignore_eos=True), request_id="s")
        first = await stalled.__anext__()  # then stop reading
        assert first.token_ids
        request = engine._scheduler.requests["s"] if engine._scheduler else None
        assert request is not None and request.send is not None
        waiting: list[int] = []

        async def watch() -> None:
            while True:
                waiting.append(request.send.statistics().current_buffer_used)  # type: ignore[union-attr]
                await anyio.sleep(0.001)

        async with anyio.create_task_group() as tg:
            tg.start_soon(watch)
            with anyio.fail_after(60):
                outs = await gather(
                    *(engine.generate([1100 + i, 2000], SamplingParams(max_tokens=60)) for i in range(6))
                )
            tg.cancel_scope.cancel()
        assert all(o.metrics.completion_tokens == 60 for o in outs)
        # paused: the buffer filled up and stayed bounded while six requests ran
        assert max(waiting) <= buffer and waiting[-1] >= buffer - 1, waiting[-20:]
        assert len(request.output_ids) < 60  # it did not run on with the others
        # it resumes when read again
        rest = [d async for d in stalled]
        assert sum(len(d.token_ids) for d in rest) + len(first.token_ids) == 200


async def test_a_failing_consumer_ends_only_its_stream(model_paths: dict[str, Path]) -> None:
    async with Engine(eagle_config(model_paths)) as engine, anyio.create_task_group() as tg:

        async def bad_consumer() -> None:
            async for _ in engine.stream([1000, 2000], SamplingParams(max_tokens=100)):
                raise ValueError("the application failed")

        good = Task(tg, engine.generate, [1200, 2000], SamplingParams(max_tokens=40))
        with pytest.raises(ValueError):
            await bad_consumer()
        assert (await good.result()).metrics.completion_tokens == 40
        await wait_until(lambda: engine.slots_in_use() == 0)


async def test_abort_by_id_ends_a_running_request(model_paths: dict[str, Path], models: ModelCache) -> None:
    """``abort(id)`` of a running request: its caller gets ``abort`` with the tokens so far,
    its slot and KV are freed, the others are unchanged."""
    prompts = [[1000 + i, 2000] for i in range(3)]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    async with Engine(eagle_config(model_paths)) as engine, anyio.create_task_group() as tg:
        solo = [(await engine.generate(p, params)).token_ids for p in prompts]
        victim = Task(tg, engine.generate, [7000, 7001], SamplingParams(max_tokens=300), request_id="v")
        others = [Task(tg, engine.generate, p, params) for p in prompts]
        await wait_until(
            lambda: "v" in engine._scheduler.requests and bool(engine._scheduler.requests["v"].output_ids)
        )  # type: ignore[union-attr]
        await engine.abort("v")
        out = await victim.result()
        assert out.finish_reason == "abort" and 0 < len(out.token_ids) < 300
        assert [(await t.result()).token_ids for t in others] == solo
        await engine.abort("v")  # finished: a no-op
        await wait_until(lambda: engine.slots_in_use() == 0)
        await assert_kv_accounted(engine)


def test_session_misuse_from_many_threads(models: ModelCache) -> None:
    """Random valid and invalid calls from 4 Python threads: every failure is typed."""
    session = SpeculativeSession.open(
        models("walk-llama"),
        SpeculativeConfig("eagle3", n_seq=2, n_draft_max=3),
        ContextConfig(n_ctx=512, n_seq=2, threads=2),
        draft_model=models("walk-llama-eagle3"),
    )
    errors: list[BaseException] = []
    counts = {"ok": 0, "typed": 0}
    lock = threading.Lock()

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(150):
            seq = rng.choice([-1, 0, 1, 2])
            op = rng.randrange(7)
            try:
                if op == 0:
                    session.draft(seq, rng.randrange(-1, 8), rng.randrange(-5, 200_000))
                elif op == 1:
                    session.accept(seq, rng.randrange(-1, 5))
                elif op == 2:
                    session.begin(seq, [rng.randrange(1000, 2000) for _ in range(rng.randrange(0, 5))])
                elif op == 3:
                    session.speculative_state(seq)
                elif op == 4:
                    session.restore_speculative_state(seq, bytes(rng.randrange(256) for _ in range(20)))
                elif op == 5:
                    session.clear_target_kv_cache_seq(seq if seq >= 0 else None, rng.randrange(0, 4), None)
                else:
                    session.is_quiescent()
                with lock:
                    counts["ok"] += 1
            except SessionError:
                with lock:
                    counts["typed"] += 1
            except BaseException as exc:  # noqa: BLE001 - collected and asserted on
                errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert counts["ok"] > 0 and counts["typed"] > 0
    # quiescence tracking still holds: settle what is pending, then state capture works
    for seq in (0, 1):
        if session.pending(seq):
            session.accept(seq, 0)
    assert session.is_quiescent()
    assert session.speculative_state(0)


@pytest.mark.parametrize("spec", ["eagle3", "none"])
async def test_a_failing_decode_fails_only_its_request(model_paths: dict[str, Path], spec: str) -> None:
    """A scheduler fault (one request's positions skip ahead) makes llama.cpp reject the
    whole step's batch (or the drafter reject its draft request); the step retries each
    sequence alone, only the guilty request fails, the others' outputs are unchanged and
    the slot is reused."""
    cfg = (
        eagle_config(model_paths, draft_policy="fixed")  # the victim always drafts
        if spec == "eagle3"
        else config(model_paths, "walk-llama", None, "none", 4, n_ctx=512)
    )
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    prompts = [[1000 + i, 2000 + i, 3000] for i in range(4)]
    async with Engine(cfg) as engine:
        solo = [(await engine.generate(p, params)).token_ids for p in prompts]
        victim_prompt = [7000, 7001, 7002]
        scheduler = engine._scheduler
        assert scheduler is not None
        schedule = scheduler.schedule

        def faulty_schedule():  # type: ignore[no-untyped-def]
            plan = schedule()
            for w in plan.work:
                if w.request.prompt_tokens == victim_prompt and w.request.state is RequestState.DECODE:
                    w.pos0 += 3  # a gap in the sequence: llama_decode refuses the batch
            return plan

        scheduler.schedule = faulty_schedule  # type: ignore[method-assign]
        async with anyio.create_task_group() as tg:
            victim = Task(tg, engine.generate, victim_prompt, params)
            outs = await gather(*(engine.generate(p, params) for p in prompts[:3]))
            with pytest.raises(RequestError) as info:
                await victim.result()
        assert isinstance(info.value.__cause__, SessionError), info.value.__cause__
        if spec == "eagle3":  # the drafter refuses its draft request before anything runs
            assert "exceeds the" in str(info.value), info.value
        else:  # llama_decode refuses the batch (positions not consecutive)
            assert "decode failed" in str(info.value), info.value
            assert engine.metrics.isolated_failures >= 1
        assert [o.token_ids for o in outs] == solo[:3]
        scheduler.schedule = schedule  # type: ignore[method-assign]
        await wait_until(lambda: engine.slots_in_use() == 0)
        again = await gather(*(engine.generate(p, params) for p in prompts))
        assert [o.token_ids for o in again] == solo
        await assert_kv_accounted(engine)


async def test_engines_sharing_a_runtime_take_turns_on_its_thread(model_paths: dict[str, Path]) -> None:
    """Two engines on one runtime serve their own requests as each would alone (greedy),
    their steps on the runtime's one thread; closing one leaves the other and the runtime
    serving; neither closes the runtime it was given."""
    prompts = [[1000 + i, 2000, 3000 + i] for i in range(6)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    off_cfg = config(model_paths, "walk-llama", n_ctx=512)
    on_cfg = eagle_config(model_paths)
    alone = {}
    for name, cfg in (("off", off_cfg), ("on", on_cfg)):
        async with Engine(cfg) as engine:
            alone[name] = [(await engine.generate(p, params)).token_ids for p in prompts]
    with Runtime() as runtime:
        off, on = Engine(off_cfg, runtime=runtime), Engine(on_cfg, runtime=runtime)
        async with off:
            async with on:
                outs = await gather(
                    *(off.generate(p, params) for p in prompts), *(on.generate(p, params) for p in prompts)
                )
                threads = {off._runtime.thread_id, on._runtime.thread_id, runtime.thread_id}  # type: ignore[union-attr]
            assert [o.token_ids for o in outs] == alone["off"] + alone["on"]
            assert on.metrics.steps > 0 and on.metrics.host_seconds > 0 and on.metrics.step_seconds > 0
            assert not runtime.closed  # (the closed engine left it)
            assert (await off.generate(prompts[0], params)).token_ids == alone["off"][0]
        assert not runtime.closed
    assert len(threads) == 1 and runtime.closed
