"""Preemption: a running request swapped out to host memory for a waiting one continues
exactly as it would have without the swap (greedy and seeded sampling, every kind of
drafter state), and one that ends while swapped out gives its memory back."""

from __future__ import annotations

import time
from pathlib import Path

import anyio
import pytest

from engine import Engine, SamplingParams
from tests.aio import Task
from tests.helpers import PARITY, assert_kv_accounted, config, wait_until

pytestmark = pytest.mark.timeout(600)

SWAPPY = {"time_slice": 0.01}  # a slot changes hands at almost every step while others wait

CASES = [p for p in PARITY if p[0] in ("none", "draft-self", "eagle3", "mtp", "ngram")]


async def _solo(cfg: object, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    async with Engine(cfg) as engine:  # type: ignore[arg-type]
        return [(await engine.generate(p, sp)).token_ids for p, sp in zip(prompts, params, strict=True)]


#: seeded sampling on a model whose distribution is soft (random tiny models are almost
#: greedy at any temperature), with and without a draft
SEEDED = [
    ("seeded", "llama-soft", None, "none", {}),
    ("seeded-draft", "llama-soft", "llama-soft-sharp", "draft", {}),
]


@pytest.mark.parametrize(
    ("name", "target", "draft", "spec", "extra"), CASES + SEEDED, ids=[c[0] for c in CASES + SEEDED]
)
async def test_preempted_requests_continue_exactly(
    model_paths: dict[str, Path], name: str, target: str, draft: str | None, spec: str, extra: dict
) -> None:
    """Greedy with every drafter, and seeded sampling: the parked sampler keeps its random
    state, penalties and grammar; replaying the tokens would restart its random stream."""
    prompts = [[1000 + 37 * i, 2000 + i, 3000] for i in range(4)]
    temp = 1.0 if name.startswith("seeded") else 0.0
    params = [SamplingParams(max_tokens=40, temperature=temp, seed=11 + i, ignore_eos=True) for i in range(4)]
    base = dict(n_seq=1, spec_extra=extra, draft_policy="fixed")
    solo = await _solo(config(model_paths, target, draft, spec, preemption=False, **base), prompts, params)
    async with Engine(config(model_paths, target, draft, spec, **base, **SWAPPY)) as engine:
        async with anyio.create_task_group() as tg:
            tasks = [Task(tg, engine.generate, p, sp) for p, sp in zip(prompts, params, strict=True)]
        outs = [await t.result() for t in tasks]
        assert [o.token_ids for o in outs] == solo
        assert engine.metrics.preemptions >= 3 and sum(o.metrics.preemptions for o in outs) >= 3
        assert engine.metrics.swapped_bytes == 0
        await wait_until(lambda: engine.slots_in_use() == 0)
        await assert_kv_accounted(engine)


async def test_a_higher_priority_arrival_preempts_at_once(model_paths: dict[str, Path]) -> None:
    cfg = config(model_paths, "llama", n_seq=1, time_slice=None)
    async with Engine(cfg) as engine, anyio.create_task_group() as tg:
        low = Task(
            tg,
            engine.generate,
            [1000, 2000],
            SamplingParams(max_tokens=200, ignore_eos=True),
            request_id="low",
        )
        requests = engine._scheduler.requests  # type: ignore[union-attr]
        await wait_until(lambda: "low" in requests and len(requests["low"].output_ids) > 2)
        same = Task(tg, engine.generate, [1500, 2500], SamplingParams(max_tokens=5))
        high = Task(tg, engine.generate, [1200, 2200], SamplingParams(max_tokens=5), priority=5)
        h = await high.result()
        assert not low.done and h.metrics.preemptions == 0
        s, lo = await same.result(), await low.result()
        assert lo.metrics.preemptions == 1  # for `high`; `same` waited (no time slice)
        assert h.metrics.finished < s.metrics.finished < lo.metrics.finished  # type: ignore[operator]


async def test_a_request_aborted_while_swapped_out_frees_its_state(model_paths: dict[str, Path]) -> None:
    cfg = config(model_paths, "llama", n_seq=1, time_slice=None)
    async with Engine(cfg) as engine, anyio.create_task_group() as tg:
        victim = Task(tg, engine.generate, [1000, 2000], SamplingParams(max_tokens=300), request_id="v")
        requests = engine._scheduler.requests  # type: ignore[union-attr]
        await wait_until(lambda: "v" in requests and len(requests["v"].output_ids) > 2)
        high = Task(
            tg, engine.generate, [1200, 2200], SamplingParams(max_tokens=60, ignore_eos=True), priority=5
        )
        await wait_until(lambda: engine.metrics.swapped_bytes > 0)
        await engine.abort("v")
        out = await victim.result()
        assert out.finish_reason == "abort" and out.metrics.preemptions == 1
        assert engine.metrics.swapped_bytes == 0
        assert (await high.result()).metrics.completion_tokens == 60


async def test_close_with_swapped_out_requests_resolves_them(model_paths: dict[str, Path]) -> None:
    cfg = config(model_paths, "llama", n_seq=1, time_slice=None)
    async with anyio.create_task_group() as tg:
        engine = Engine(cfg)
        await engine.start()
        victim = Task(tg, engine.generate, [1000, 2000], SamplingParams(max_tokens=300), request_id="v")
        requests = engine._scheduler.requests  # type: ignore[union-attr]
        await wait_until(lambda: "v" in requests and len(requests["v"].output_ids) > 2)
        high = Task(tg, engine.generate, [1200, 2200], SamplingParams(max_tokens=300), priority=5)
        await wait_until(lambda: engine.metrics.swapped_bytes > 0)
        t0 = time.perf_counter()
        await engine.close()
        with anyio.fail_after(1):
            assert (await victim.result()).finish_reason == "abort"
            assert (await high.result()).finish_reason == "abort"
        assert time.perf_counter() - t0 < 1.0
        assert engine.metrics.swapped_bytes == 0


async def test_no_swap_space_means_no_preemption(model_paths: dict[str, Path]) -> None:
    cfg = config(model_paths, "llama", n_seq=1, time_slice=0.01, swap_space_mib=0)
    async with Engine(cfg) as engine:
        async with anyio.create_task_group() as tg:
            tasks = [
                Task(tg, engine.generate, [1000 + i, 2000], SamplingParams(max_tokens=20)) for i in range(3)
            ]
        assert [(await t.result()).metrics.completion_tokens for t in tasks] == [20] * 3
        assert engine.metrics.preemptions == 0
