"""What a caller reads a streamed request through: :class:`RequestStream` (one request's
deltas) and :class:`StreamGroup` (several requests' deltas through one buffer). A chat
request's output is parsed here, on its consumer's task, not in the step loop."""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import anyio

from ..session.chat import ChatParser
from .request import Delta, Request, RequestOutput

if TYPE_CHECKING:
    from .engine import Engine

__all__ = ["RequestStream", "StreamGroup", "read_message"]


def read_message(output: RequestOutput, parser: ChatParser) -> None:
    """``output`` of a chat request: its text becomes the answer's content, as parsed."""
    output.message = parser.message()
    output.text = output.message.content


class RequestStream:
    """The deltas of one streamed request (see :meth:`Engine.stream`): an async iterator
    and an async context manager. Not an async generator, so that leaving a loop early
    needs no finalizer on any backend: the request is aborted at once (or when the stream
    is dropped). A chat request's output is parsed here, on its consumer's task, not in
    the step loop."""

    def __init__(self, engine: Engine, submit: Callable[..., Awaitable[Request]]) -> None:
        self._engine = engine
        self._submit: Callable[..., Awaitable[Request]] | None = submit
        self._request: Request | None = None
        self._parser: ChatParser | None = None

    async def start(self, group: tuple[Any, int, int] | None = None) -> None:
        """Submit the request now (else the first iteration does): its refusal (a full
        queue, a prompt too long) is raised here. ``group``: see :class:`StreamGroup`."""
        if self._submit is not None:
            submit, self._submit = self._submit, None
            self._request = await submit(group)
            self._parser = self._request.chat_parser()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Delta:
        await self.start()
        r = self._request
        if r is None or r.receive is None:
            raise StopAsyncIteration
        while True:
            try:
                delta = await r.receive.receive()
            except (anyio.EndOfStream, anyio.ClosedResourceError):
                r.receive.close()
                if r.error is not None:
                    raise r.error from r.error.__cause__
                raise StopAsyncIteration from None
            except BaseException:
                self._abort()  # cancelled while waiting: the request ends with its consumer
                raise
            self._engine._delta_taken()
            parsed = self.read(delta)
            if parsed is not None:
                return parsed

    def read(self, delta: Delta) -> Delta | None:
        """A delta as its caller sees it: a chat request's as the template's format reads
        it (None: nothing to hand out yet)."""
        parser = self._parser
        if parser is None:
            return delta
        final = delta.output is not None
        reasoning, content, calls = parser.update(delta.text, final=final)
        if delta.output is not None:
            read_message(delta.output, parser)
        if not (content or reasoning or calls or delta.token_ids or final or delta.finish_reason):
            return None
        return dataclasses.replace(delta, text=content, reasoning=reasoning, tool_calls=calls or None)

    async def aclose(self) -> None:
        """Abort the request unless it has finished; stop the iteration."""
        self._submit = None
        self._abort()

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _abort(self) -> None:
        r = self._request
        if r is not None:
            self._engine._abort(r)
            if r.receive is not None:
                r.receive.close()

    def __del__(self) -> None:
        self._abort()


class StreamGroup:
    """Several streamed requests as one stream of ``(index, delta)`` (see
    :meth:`Engine.stream_group`): their deltas share one buffer, so reading them needs no
    task per request and no task group, and the group can be read from any task (a
    response body, a generator). An async iterator and an async context manager."""

    def __init__(self, engine: Engine, streams: Sequence[RequestStream]) -> None:
        self._engine = engine
        self._streams = list(streams)
        self._send, self._receive = anyio.create_memory_object_stream[tuple[int, Any]](float("inf"))
        self._started = False

    async def start(self) -> None:
        """Submit every request, in order; one refused aborts those before it and raises."""
        if self._started:
            return
        self._started = True
        n = len(self._streams)
        try:
            for i, stream in enumerate(self._streams):
                await stream.start((self._send.clone(), i, n))
        except BaseException:
            self._abort()
            raise
        finally:
            self._send.close()  # the clones remain: it ends when every request has ended

    def __aiter__(self) -> StreamGroup:
        return self

    async def __anext__(self) -> tuple[int, Delta]:
        await self.start()
        while True:
            try:
                index, item = await self._receive.receive()
            except (anyio.EndOfStream, anyio.ClosedResourceError):
                raise StopAsyncIteration from None
            except BaseException:
                self._abort()  # cancelled while waiting: the requests end with their consumer
                raise
            self._engine._delta_taken()
            if isinstance(item, BaseException):
                raise item
            delta = self._streams[index].read(item)
            if delta is not None:
                return index, delta

    async def aclose(self) -> None:
        """Abort every request that has not finished; stop the iteration."""
        self._started = True
        self._abort()

    async def __aenter__(self) -> StreamGroup:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _abort(self) -> None:
        for stream in self._streams:
            stream._abort()
        self._send.close()
        self._receive.close()

    def __del__(self) -> None:
        self._abort()
