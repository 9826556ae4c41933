"""The runtime: one native thread that makes every llama.cpp call of an engine.

Work goes to the thread through a queue and returns at once as a native ``Ticket``.
Synchronous callers wait on the ticket with the GIL released; async callers (asyncio or
trio, through anyio) ``await runtime.wait(ticket)``, woken through the runtime's eventfd,
so the event loop is never blocked by native work.
"""

from __future__ import annotations

from typing import Any

import anyio

from .. import _nb_spec

__all__ = ["Runtime"]


class _Waiter:
    """One task awaiting a ticket."""

    def __init__(self, ticket: Any) -> None:
        self.ticket = ticket
        self.done = anyio.Event()
        self.nudge = anyio.Event()  # set when this task may take over reading the eventfd


class Runtime:
    """Owns the native thread. Close it (or use it as a context manager) to free everything.

    ``close()`` finishes queued work, frees every model, context and session created on
    this runtime (on the native thread) and joins the thread; it is idempotent.
    """

    def __init__(self) -> None:
        self._native = _nb_spec.Runtime()
        self._waiters: dict[int, _Waiter] = {}
        self._reader: _Waiter | None = None  # the task reading the eventfd for everyone

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

    async def wait(self, ticket: Any) -> Any:
        """Await a native ticket; returns its result or raises its error.

        Any number of tasks of one event loop may wait at once: one of them reads the
        eventfd and wakes the others whose tickets completed. (A runtime's async side
        serves one event loop at a time; synchronous calls work from any thread.)

        :raises SessionError: whatever the native job raised.
        """
        w = _Waiter(ticket)
        self._waiters[ticket.id] = w
        try:
            if ticket.done():
                w.done.set()
            while not w.done.is_set():
                if self._reader is None:
                    await self._read_for_everyone(w)
                else:
                    await w.nudge.wait()
                    w.nudge = anyio.Event()
        finally:
            del self._waiters[ticket.id]
            if self._reader is None:
                self._hand_over()
        return ticket.result()  # finished: does not block

    async def _read_for_everyone(self, w: _Waiter) -> None:
        self._reader = w
        try:
            await anyio.wait_readable(self._native.wake_fd)
            for ticket_id in self._native.take_completed():
                other = self._waiters.get(ticket_id)
                if other is not None:
                    other.done.set()
                    other.nudge.set()
        finally:
            self._reader = None

    def _hand_over(self) -> None:
        """Let a task that still waits read the eventfd next."""
        for other in self._waiters.values():
            if not other.done.is_set():
                other.nudge.set()
                return

    def close(self) -> None:
        """Finish queued work, free every native object, join the thread. Idempotent."""
        self._native.close()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
