"""The native thread: one thread makes every call; the event loop is never blocked."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path

import pytest

from engine import _nb_spec
from engine.session import (
    Batch,
    ClosedError,
    Context,
    ContextConfig,
    Model,
    Runtime,
)

pytestmark = pytest.mark.timeout(120)


def test_every_call_runs_on_the_same_native_thread(model_paths: dict[str, Path]) -> None:
    with Runtime() as rt:
        assert rt.thread_id != threading.get_native_id()
        seen: list[int] = []
        lock = threading.Lock()

        def worker() -> None:
            for _ in range(20):
                tid = rt.ping()
                with lock:
                    seen.append(tid)

        threads = [threading.Thread(target=worker) for _ in range(4)]
        for t in threads:
            t.start()

        async def from_loop() -> list[int]:
            return list(await asyncio.gather(*(rt.aping() for _ in range(20))))

        seen.extend(asyncio.run(from_loop()))
        for t in threads:
            t.join()
        assert len(seen) == 100
        assert set(seen) == {rt.thread_id}
        # real work lands there too: load a model from another Python thread
        model: list[Model] = []
        t = threading.Thread(target=lambda: model.append(Model.load(rt, model_paths["llama"])))
        t.start()
        t.join()
        assert model[0].info.arch == "llama"


def test_sync_waiters_release_the_gil() -> None:
    """A Python thread blocked on a long native job does not stop other Python threads."""
    with Runtime() as rt:
        ticket = rt.native.sleep_async(0.5)
        counter = 0
        done = threading.Event()

        def spin() -> None:
            nonlocal counter
            while not done.is_set():
                counter += 1

        t = threading.Thread(target=spin)
        t.start()
        ticket.result()  # waits with the GIL released
        done.set()
        t.join()
        assert counter > 1000


async def test_event_loop_keeps_ticking_during_a_long_prefill(model_paths: dict[str, Path]) -> None:
    with Runtime() as rt:
        model = Model.load(rt, model_paths["llama"])
        ctx = Context.create(
            model,
            ContextConfig(n_ctx=8192, n_batch=4096, n_ubatch=512),
            n_outputs_max=1,
            n_outputs_max_per_seq=1,
        )
        prompt = [(i * 37) % 30000 + 100 for i in range(8192)]
        gaps: list[float] = []
        stop = asyncio.Event()

        async def ticker() -> None:
            last = time.perf_counter()
            while not stop.is_set():
                await asyncio.sleep(0.005)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        task = asyncio.create_task(ticker())
        await asyncio.sleep(0.02)
        t0 = time.perf_counter()
        for start in range(0, len(prompt), 4096):  # native prefill calls of 4096 tokens
            b = Batch()
            b.add_sequence(prompt[start : start + 4096], start, 0, logits="last")
            n_out = await rt.wait(ctx.decode_async(b))
        prefill_s = time.perf_counter() - t0
        stop.set()
        await task
        assert n_out == 1
        assert ctx.logits.shape == (1, model.n_vocab)
        # the prefill took many tick periods, yet no tick was held up by it
        assert prefill_s > 0.3
        assert max(gaps) < prefill_s / 3, (max(gaps), prefill_s)


async def test_async_errors_arrive_typed(model_paths: dict[str, Path]) -> None:
    from engine.session import InvalidArgumentError

    with Runtime() as rt:
        model = Model.load(rt, model_paths["llama"])
        ctx = Context.create(model, ContextConfig(n_ctx=256))
        b = Batch()
        b.add(model.n_vocab + 5, 0, 0, True)
        with pytest.raises(InvalidArgumentError, match="outside"):
            await rt.wait(ctx.decode_async(b))
        # and the runtime goes on
        assert await rt.aping() == rt.thread_id


def test_close_frees_everything_and_is_idempotent(model_paths: dict[str, Path]) -> None:
    rt = Runtime()
    model = Model.load(rt, model_paths["llama"])
    ctx = Context.create(model, ContextConfig(n_ctx=256))
    rt.close()
    rt.close()
    assert rt.closed
    with pytest.raises(ClosedError):
        rt.ping()
    with pytest.raises(ClosedError):
        model.tokenize("hello")
    b = Batch()
    b.add(1, 0, 0, True)
    with pytest.raises(ClosedError):
        ctx.decode(b)
    del ctx, model  # handles released after close: nothing to free, no crash


def test_native_thread_is_not_the_python_thread() -> None:
    rt = _nb_spec.Runtime()
    try:
        assert rt.ping() == rt.thread_id
        assert rt.thread_id != threading.get_native_id()
        assert rt.thread_id != os.getpid()
    finally:
        rt.close()
