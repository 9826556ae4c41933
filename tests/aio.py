"""anyio helpers for tests: run coroutines together, or start one and await it later."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

import anyio
from anyio.abc import TaskGroup

T = TypeVar("T")


async def gather(*awaitables: Awaitable[T]) -> list[T]:
    """Await all at once; results in order (the first error cancels the rest)."""
    results: list[Any] = [None] * len(awaitables)

    async def run(i: int, aw: Awaitable[T]) -> None:
        results[i] = await aw

    async with anyio.create_task_group() as tg:
        for i, aw in enumerate(awaitables):
            tg.start_soon(run, i, aw)
    return results


class Task(Generic[T]):
    """A coroutine started in a task group (like ``asyncio.create_task``): its outcome is
    kept for :meth:`result`, never raised into the group; :meth:`cancel` cancels it."""

    def __init__(self, tg: TaskGroup, fn: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any) -> None:
        self._done = anyio.Event()
        self._scope = anyio.CancelScope()
        self._value: T | None = None
        self._error: BaseException | None = None
        self.cancelled = False
        self.finished_at: float | None = None  #: time.perf_counter() when it ended
        tg.start_soon(self._run, fn, args, kwargs)

    async def _run(
        self, fn: Callable[..., Awaitable[T]], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        with self._scope:
            try:
                self._value = await fn(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - kept for result()
                self._error = exc
        self.cancelled = self._scope.cancelled_caught
        self.finished_at = time.perf_counter()
        self._done.set()

    def cancel(self) -> None:
        self._scope.cancel()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    async def result(self) -> T:
        await self._done.wait()
        if self._error is not None:
            raise self._error
        if self.cancelled:
            raise RuntimeError("the task was cancelled")
        return self._value  # type: ignore[return-value]
