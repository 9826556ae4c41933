"""A step loop that cannot die silently: a fault injected at each phase of a step fails
the requests it touches (a typed error, within a second), the others go on unchanged, the
engine keeps serving; a fault that repeats makes the engine dead (EngineDeadError for every
caller and every later call). close() always returns, and a new engine serves."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import anyio
import pytest

import engine.scheduler.scheduler as scheduler_module
from engine import Engine, EngineDeadError, RequestError, SamplingParams
from engine.session import BadSeqIdError
from tests.aio import Task
from tests.conftest import ModelCache
from tests.helpers import config, wait_until
from tests.spec_loop import greedy_plain

pytestmark = pytest.mark.timeout(300)


class Injected(RuntimeError):
    """The fault the test injects."""


def inject(fault: str, engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    scheduler = engine._scheduler
    assert scheduler is not None
    fired: list[bool] = []

    def once() -> bool:
        if fired:
            return False
        fired.append(True)
        return True

    if fault in ("planning", "persistent"):
        schedule = scheduler.schedule

        def faulty_schedule() -> Any:
            if fault == "persistent" or once():
                raise Injected(f"{fault} fault")
            return schedule()

        monkeypatch.setattr(scheduler, "schedule", faulty_schedule)
    elif fault == "native":  # the native step refuses its plan as a whole (a typed native error)
        runner = engine._runner

        class Runner:
            def step_async(self, plan: Any) -> Any:
                if once():
                    plan.clear(10**6)  # no such sequence: the whole step fails natively
                return runner.step_async(plan)

        monkeypatch.setattr(engine, "_runner", Runner())
    elif fault == "output":  # one request's output handling raises
        process = scheduler_module.process_output

        def faulty_process(request: Any, out: Any, rules: Any) -> Any:
            if request.request_id == "r2" and once():
                raise Injected("output fault")
            return process(request, out, rules)

        monkeypatch.setattr(scheduler_module, "process_output", faulty_process)
    elif fault == "update":  # applying the step's result raises outside any one request
        count = scheduler._count

        def faulty_count(plan: Any, result: Any) -> None:
            if once():
                raise Injected("update fault")
            count(plan, result)

        monkeypatch.setattr(scheduler, "_count", faulty_count)
    elif fault == "capture":  # packing a final checkpoint raises
        monkeypatch.setattr(
            scheduler_module, "pack_request", lambda *a: (_ for _ in ()).throw(Injected("capture"))
        )
    else:
        raise AssertionError(fault)


#: each phase on one backend, alternating
FAULTS = [
    ("planning", "asyncio"),
    ("native", "trio"),
    ("output", "asyncio"),
    ("update", "trio"),
    ("capture", "asyncio"),
    ("persistent", "trio"),
]


@pytest.mark.parametrize(("fault", "anyio_backend"), FAULTS, ids=[f[0] for f in FAULTS])
async def test_a_fault_answers_every_caller_and_the_engine_goes_on(
    model_paths: dict[str, Path],
    models: ModelCache,
    monkeypatch: pytest.MonkeyPatch,
    fault: str,
    anyio_backend: str,
) -> None:
    cfg = config(model_paths, "walk-llama", "walk-llama-eagle3", "eagle3", 4, n_ctx=512)
    prompts = [[1000 + 7 * i, 2000] for i in range(8)]
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    expected = [greedy_plain(models("walk-llama"), p, 32) for p in prompts]
    engine = Engine(cfg)
    await engine.start()
    async with anyio.create_task_group() as tg:
        tasks = [
            Task(tg, engine.generate, p, params, request_id=f"r{i}", checkpoint=fault == "capture" and i == 0)
            for i, p in enumerate(prompts)
        ]
        await wait_until(lambda: engine.metrics.steps >= 3)
        inject(fault, engine, monkeypatch)
        injected = time.perf_counter()
        failed: dict[int, BaseException] = {}
        with anyio.fail_after(60):
            for i, t in enumerate(tasks):
                try:
                    out = await t.result()
                except (RequestError, EngineDeadError) as exc:
                    failed[i] = exc
                    assert t.finished_at is not None
                    if fault != "capture":  # (the capture fault fires when r0 ends)
                        assert t.finished_at - injected < 1.0, (fault, i)
                else:
                    assert out.token_ids == expected[i], (fault, i)
    assert failed, "the fault had no effect"
    for exc in failed.values():
        cause = exc.__cause__
        assert isinstance(cause, Injected | BadSeqIdError | RequestError), (fault, repr(cause))
    if fault == "output":
        assert set(failed) == {2}  # the others did not notice
    if fault == "capture":
        assert set(failed) == {0}
    if fault in ("planning", "native", "update"):
        assert 0 < len(failed) < 8  # the step's requests, not the waiting ones
    if fault == "persistent":
        # those holding a slot failed with the first fault, the others when the engine died
        dead = [i for i, e in failed.items() if isinstance(e, EngineDeadError)]
        assert len(failed) == 8 and len(dead) == 8 - cfg.n_seq, failed
        with pytest.raises(EngineDeadError):
            await engine.generate([1000, 2000], params)
    else:  # the engine goes on serving, and frees what the failed requests held
        monkeypatch.undo()
        again = await engine.generate(prompts[1], params)
        assert again.token_ids == expected[1]
        await wait_until(lambda: engine.slots_in_use() == 0)
    t0 = time.perf_counter()
    await engine.close()
    assert time.perf_counter() - t0 < 1.0
    async with Engine(cfg) as fresh:
        assert (await fresh.generate(prompts[0], params)).token_ids == expected[0]
