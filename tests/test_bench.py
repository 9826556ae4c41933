"""The load generator itself (``engine.bench.closed_loop``), with a scripted server: the
ramp, the steady window and how arrivals are counted; and loads on an engine kept open."""

from __future__ import annotations

import itertools
import time
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest

from engine import EngineConfig, SamplingParams
from engine.bench import BURST_S, BenchResult, KeptEngines, closed_loop, load_engine, speedups, warm_up
from engine.scheduler import Engine
from engine.workloads import prompt_of


def scripted(step_s: float, per_step: int = 1) -> tuple[list[tuple[int, int]], object]:
    sent: list[tuple[int, int]] = []

    async def send(i: int, max_tokens: int) -> AsyncIterator[list[int]]:
        sent.append((i, max_tokens))
        for start in range(0, max_tokens, per_step):
            await anyio.sleep(step_s)
            yield list(range(start, min(start + per_step, max_tokens)))

    return sent, send


@pytest.mark.anyio
async def test_the_first_requests_ramp_so_that_streams_end_spread_out() -> None:
    sent, send = scripted(0.002)
    r = await closed_loop(4, 12, 8, send)  # type: ignore[arg-type]
    first = sorted(m for _, m in sent[:4])
    assert first == [2, 4, 6, 8]  # (k + 1) / N of max_tokens
    assert all(m == 8 for _, m in sent[4:])
    assert r.requests == 12 and r.tokens == 2 + 4 + 6 + 8 + 8 * 8
    assert len(r.e2e) == 8  # latencies: full-length requests only
    assert 0 < r.steady_seconds < r.seconds and r.steady_tokens > 0


@pytest.mark.anyio
async def test_one_stream_has_no_ramp() -> None:
    sent, send = scripted(0.001)
    r = await closed_loop(1, 3, 5, send)  # type: ignore[arg-type]
    assert [m for _, m in sent] == [5, 5, 5]
    assert len(r.e2e) == 3 and r.steady_tokens == 10  # the window opens after the first


@pytest.mark.anyio
async def test_back_to_back_events_are_one_arrival() -> None:
    bursts: list[float] = []  # when each burst began (a sleep may overrun on a busy machine)

    async def send(i: int, max_tokens: int) -> AsyncIterator[list[int]]:
        for _ in range(3):
            await anyio.sleep(0.02)
            bursts.append(time.perf_counter())
            for t in range(4):  # one verification's tokens, one event each
                yield [t]

    r = await closed_loop(1, 1, 12, send)
    assert len(r.itl) == 2  # three bursts of four tokens
    gaps = [(b - a) / 4 for a, b in itertools.pairwise(bursts)]
    assert all(0.8 * g <= x < g + BURST_S for x, g in zip(r.itl, gaps, strict=True)), (r.itl, gaps)


def test_speedups_pair_runs_in_the_order_they_ran() -> None:
    def run(spec: str, tps: float) -> BenchResult:
        r = BenchResult(4, spec, 1, 200, 2.0)  # the whole run: 200 tokens in 2 s
        r.steady_tokens, r.steady_seconds = int(tps), 1.0
        return r

    runs = [run("none", 100), run("x", 150), run("none", 50), run("x", 60), run("none", 100), run("x", 90)]
    ((n, spec, med, lo, hi),) = speedups(runs)
    assert (n, spec) == (4, "x") and (med, lo, hi) == (1.2, 0.9, 1.5)
    runs[1].seconds = 4.0  # slower over the whole run, faster in its steady window
    ((_, _, med, lo, hi),) = speedups(runs, whole=True)
    assert (med, lo, hi) == (1.0, 0.5, 1.0)


def test_requests_send_every_prompt_once_per_round_in_an_order_no_slot_rotation_repeats() -> None:
    prompts = [f"p{j}" for j in range(8)]
    sent = [prompt_of(prompts, i) for i in range(800)]
    assert sent == [prompt_of(prompts, i) for i in range(800)]  # every run, every server
    assert all(sorted(sent[r : r + 8]) == prompts for r in range(0, 800, 8))
    # in steady state request i + N reuses request i's slot: with N a multiple of the
    # set's size, ``i % len`` would find its whole prompt there every time
    for n in (8, 16, 64):
        same = sum(sent[i] == sent[i + n] for i in range(800 - n)) / (800 - n)
        assert same < 0.3, (n, same)


@pytest.mark.anyio
async def test_loads_on_a_kept_engine_send_the_next_prompts_and_count_only_their_own_drafts(
    model_paths: dict[str, Path],
) -> None:
    """``load_engine`` (what ``engine bench --interleave`` runs on the engines it keeps open):
    request ``i`` of a load starting at ``first`` is the sequence's request ``first + i``,
    and a load counts its own drafts, not the engine's since it started."""
    prompts = [[1] + [100 + 37 * i + j for j in range(12)] for i in range(5)]  # (token ids)
    config = EngineConfig(  # ("fixed": every match drafted, so both loads draft)
        model=model_paths["walk-llama-cycle6"],
        speculative="ngram-simple",
        draft_policy="fixed",
        n_seq=2,
        n_ctx=256,
        threads=2,
    )
    async with Engine(config) as engine:
        await warm_up(engine, prompts)
        drafted0 = engine.metrics.drafted
        outputs: list[dict[int, list[int]]] = [{}, {}]
        first = await load_engine(engine, 2, 4, 24, prompts, outputs=outputs[0])
        second = await load_engine(engine, 2, 4, 24, prompts, outputs=outputs[1], first=4)
        assert first.drafted > 0 and second.drafted > 0  # (a 6-token cycle: n-grams match)
        assert first.drafted + second.drafted == engine.metrics.drafted - drafted0
        for start, got in zip((0, 4), outputs, strict=True):
            assert sorted(got) == [0, 1, 2, 3]
            for i, ids in got.items():  # (greedy: a shorter ramp request is a prefix)
                solo = await engine.generate(prompt_of(prompts, start + i), SamplingParams(max_tokens=24))
                assert ids == solo.token_ids[: len(ids)] and len(ids) >= 12, (start, i)


@pytest.mark.anyio
async def test_kept_engines_report_an_engine_process_that_ended(tmp_path: Path) -> None:
    """A kept engine that cannot start (or dies) fails the load that waits for it, not hangs it."""
    async with KeptEngines() as kept:
        with pytest.raises(RuntimeError, match="its process ended"):
            await kept.load(EngineConfig(model=tmp_path / "missing.gguf"), 1, 1, 4)
