"""The runtime: one native thread that makes every llama.cpp call of an engine.

Work goes to the thread through a queue and returns at once as a native ``Ticket``.
Synchronous callers wait on the ticket with the GIL released; asyncio callers ``await
runtime.wait(ticket)``, which is woken through the runtime's eventfd, so the event loop is
never blocked by native work.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from .. import _nb_spec
from .errors import ClosedError

__all__ = ["Runtime"]


class Runtime:
    """Owns the native thread. Close it (or use it as a context manager) to free everything.

    ``close()`` finishes queued work, frees every model, context and session created on
    this runtime (on the native thread) and joins the thread; it is idempotent.
    """

    def __init__(self) -> None:
        self._native = _nb_spec.Runtime()
        self._lock = threading.Lock()
        # ticket id -> (loop, future, ticket)
        self._waiters: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future[Any], Any]] = {}
        self._loops: set[asyncio.AbstractEventLoop] = set()

    @property
    def native(self) -> _nb_spec.Runtime:
        """The extension object, for the objects created on this runtime."""
        return self._native

    @property
    def thread_id(self) -> int:
        """Kernel thread id of the native thread."""
        return self._native.thread_id

    @property
    def closed(self) -> bool:
        return self._native.closed

    def ping(self) -> int:
        """Run a no-op on the native thread; returns the thread id it ran on."""
        return self._native.ping()

    async def aping(self) -> int:
        """Like :meth:`ping`, awaited without blocking the event loop."""
        return int(await self.wait(self._native.ping_async()))

    def queue_depth(self) -> int:
        """Jobs waiting for the native thread."""
        return self._native.queue_depth()

    async def wait(self, ticket: Any) -> Any:
        """Await a native ticket; returns its result or raises its error.

        :raises SessionError: whatever the native job raised.
        """
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        with self._lock:
            self._waiters[ticket.id] = (loop, future, ticket)
            if loop not in self._loops:
                loop.add_reader(self._native.wake_fd, self._on_wake)
                self._loops.add(loop)
        if ticket.done():
            self._resolve(ticket.id)
        try:
            return await future
        finally:
            with self._lock:
                self._waiters.pop(ticket.id, None)
                if loop in self._loops and not any(w[0] is loop for w in self._waiters.values()):
                    self._loops.discard(loop)
                    if not loop.is_closed():
                        loop.remove_reader(self._native.wake_fd)

    def _on_wake(self) -> None:
        for ticket_id in self._native.take_completed():
            self._resolve(ticket_id)

    def _resolve(self, ticket_id: int) -> None:
        with self._lock:
            waiter = self._waiters.get(ticket_id)
        if waiter is None:
            return
        loop, future, ticket = waiter

        def settle() -> None:
            if future.done():
                return
            try:
                future.set_result(ticket.result())  # already finished: does not block
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task
                future.set_exception(exc)

        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            settle()
        elif not loop.is_closed():
            loop.call_soon_threadsafe(settle)

    def check_open(self) -> None:
        """:raises ClosedError: when the runtime was closed."""
        if self._native.closed:
            raise ClosedError("the runtime is closed")

    def close(self) -> None:
        """Finish queued work, free every native object, join the thread. Idempotent."""
        self._native.close()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
