"""The ASGI app: OpenAI's ``/v1`` endpoints over one :class:`Engine` (Starlette).

Each choice is one engine request; the engine does all scheduling, so this layer only
translates. A client that disconnects mid-stream aborts its requests (their slots are freed
at the next step boundary). Every error is OpenAI-style JSON: ``{"error": {"message",
"type", "param", "code"}}``.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from dataclasses import dataclass, replace
from typing import Any

import anyio
import anyio.abc
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..logs import get_logger
from ..scheduler import Delta, Engine, QueueFullError, RequestError, RequestMetrics, RequestOutput
from ..session import ClosedError, InvalidArgumentError, InvalidConfigError, PromptTooLongError
from . import protocol
from .metrics import metrics_registry, render
from .protocol import ChatRequest, CompletionRequest, ProtocolError

__all__ = ["ServerLimits", "create_app"]

log = get_logger("engine.server")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


@dataclass(frozen=True)
class ServerLimits:
    """What one request may send."""

    max_body_bytes: int = 4 * 1024 * 1024  #: 413 beyond it
    retry_after_s: int = 1  #: the Retry-After of a 429 (full queue)


def error(
    status: int,
    message: str,
    type_: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


class _Guard:
    """ASGI middleware in front of every route: the API key (all but ``/health``) and the
    request body's size, both checked before the app reads anything."""

    server: OpenAIServer | None = None  #: the routes' state behind it

    def __init__(self, app: Any, api_key: str | None, max_body: int) -> None:
        self.app = app
        self.key = f"Bearer {api_key}".encode() if api_key else None
        self.max_body = max_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        if self.key is not None and scope["path"] != "/health":
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, self.key):  # constant time
                response = error(
                    401, "invalid or missing API key", "invalid_request_error", code="invalid_api_key"
                )
                return await response(scope, receive, send)
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body):
            return await self._too_large(scope, receive, send)
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_body:
                raise _BodyTooLarge
            return message

        try:
            await self.app(scope, limited, send)
        except _BodyTooLarge:
            await self._too_large(scope, receive, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = error(413, f"the request body exceeds {self.max_body} bytes", code="request_too_large")
        await response(scope, receive, send)


class _BodyTooLarge(Exception):
    pass


class OpenAIServer:
    """The routes' state: the engine, the model's name, the metrics registry."""

    def __init__(self, engine: Engine, model_name: str, limits: ServerLimits) -> None:
        self.engine = engine
        self.model_name = model_name
        self.limits = limits
        self.registry = metrics_registry(engine, model_name)
        self.draining = False  # shutting down: new requests get 503
        self.created = protocol.now()

    # --- plain endpoints -----------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        if self.draining or not self.engine.serving:
            return error(503, "the engine is not serving", "service_unavailable", code="unavailable")
        return JSONResponse({"status": "ok"})

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        if request.path_params["model"] != self.model_name:
            return self._unknown_model(request.path_params["model"])
        return JSONResponse(self._model_card())

    async def metrics(self, request: Request) -> Response:
        return Response(render(self.registry), media_type="text/plain; version=0.0.4; charset=utf-8")

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "engine"}

    def _unknown_model(self, name: str) -> Response:
        return error(404, f"the model {name!r} does not exist", param="model", code="model_not_found")

    # --- completions ---------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        return await self._serve(request, CompletionRequest)

    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, ChatRequest)

    async def _serve(self, request: Request, kind: type[CompletionRequest] | type[ChatRequest]) -> Response:
        try:
            raw = await request.body()
            body = kind.model_validate_json(raw)
        except ValidationError as exc:
            return _validation_error(exc)
        if body.model != self.model_name:
            return self._unknown_model(body.model)
        if self.draining:
            return error(503, "the server is shutting down", "service_unavailable", code="unavailable")
        try:
            model = self.engine.model
            params = protocol.sampling_params(body, self.engine.config.n_ctx, model.n_vocab)
            prompts: list[Any] = (
                body.prompts()
                if isinstance(body, CompletionRequest)
                else [[m.as_template_message() for m in body.messages]]
            )
            if len(prompts) * body.n > protocol.MAX_CHOICES:
                raise ProtocolError(f"at most {protocol.MAX_CHOICES} choices (prompts x n) per request", "n")
            call = _Call(self, body, params, prompts, chat=isinstance(body, ChatRequest))
            if body.stream:
                return await call.stream()
            result = await _unless_disconnected(request, call.complete())
            return JSONResponse(result) if result is not None else Response(status_code=499)
        except Exception as exc:  # noqa: BLE001 - every failure is an OpenAI-style error
            return _engine_error(exc, "messages" if isinstance(body, ChatRequest) else "prompt", self.limits)


class _Call:
    """One API request: ``len(prompts) * n`` engine requests (choice ``i`` of prompt ``p``
    has index ``p * n + i``)."""

    def __init__(self, server: OpenAIServer, body: Any, params: Any, prompts: list[Any], chat: bool) -> None:
        self.server = server
        self.engine = server.engine
        self.body = body
        self.params = params
        self.prompts = prompts
        self.chat = chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = protocol.now()
        self.object = "chat.completion" if chat else "text_completion"

    def _choice_params(self, index: int) -> Any:
        if self.params.seed is None or index == 0:
            return self.params
        return replace(self.params, seed=(self.params.seed + index) % 2**32)  # reproducible, distinct

    def _choices(self) -> list[tuple[int, Any]]:
        n = self.body.n
        return [(p * n + i, prompt) for p, prompt in enumerate(self.prompts) for i in range(n)]

    def _usage(self, outputs: dict[int, RequestMetrics]) -> dict[str, Any]:
        n = self.body.n
        per_prompt = [outputs[p * n] for p in range(len(self.prompts)) if p * n in outputs]
        return protocol.usage(per_prompt, list(outputs.values()))

    # --- whole responses ---------------------------------------------------------------
    async def complete(self) -> dict[str, Any]:
        results: dict[int, RequestOutput] = {}

        async def one(index: int, prompt: Any) -> None:
            results[index] = await self.engine.generate(
                prompt,
                self._choice_params(index),
                request_id=f"{self.id}-{index}",
                cache_prompt=self.body.cache_prompt,
            )

        choices = self._choices()
        if len(choices) == 1:
            await one(*choices[0])
        else:
            async with _task_group() as tg:  # (the first failure cancels the rest)
                for index, prompt in choices:
                    tg.start_soon(one, index, prompt)
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.server.model_name,
            "choices": [self._choice(index, results[index]) for index in sorted(results)],
            "usage": self._usage({i: r.metrics for i, r in results.items()}),
        }

    def _choice(self, index: int, out: RequestOutput) -> dict[str, Any]:
        reason = out.finish_reason
        if self.chat:
            return {
                "index": index,
                "message": {"role": "assistant", "content": out.text},
                "logprobs": None if out.logprobs is None else protocol.chat_logprobs(out.logprobs),
                "finish_reason": reason,
            }
        return {
            "index": index,
            "text": out.text,
            "logprobs": None if out.logprobs is None else protocol.completion_logprobs(out.logprobs),
            "finish_reason": reason,
        }

    # --- server-sent events --------------------------------------------------------------
    async def stream(self) -> Response:
        streams = [
            (
                index,
                self.engine.stream(
                    prompt,
                    self._choice_params(index),
                    request_id=f"{self.id}-{index}",
                    cache_prompt=self.body.cache_prompt,
                ),
            )
            for index, prompt in self._choices()
        ]
        # the first delta (or the submission's error: a full queue, a prompt too long) comes
        # before the response starts, so that a refusal is an HTTP status, not a broken stream
        merged = _Merged(streams)
        try:
            first = await merged.__anext__()
        except StopAsyncIteration:
            first = None
        except BaseException:
            await merged.aclose()
            raise
        return StreamingResponse(
            self._events(first, merged),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def _events(
        self, first: tuple[int, Delta] | None, rest: AsyncIterator[tuple[int, Delta]]
    ) -> AsyncIterator[bytes]:
        options = self.body.stream_options
        include_usage = bool(options and options.include_usage)
        continuous = bool(options and options.continuous_usage_stats)  # tokens so far on every chunk
        finals: dict[int, RequestMetrics] = {}
        offsets: dict[int, int] = {}
        generated = 0
        try:
            if self.chat:
                for index, _ in self._choices():
                    yield self._chunk(
                        [{"index": index, "delta": {"role": "assistant", "content": ""}}], include_usage
                    )
            async for index, delta in _prepend(first, rest):
                if delta.output is not None:
                    finals[index] = delta.output.metrics
                choice = self._delta_choice(index, delta, offsets)
                generated += len(delta.token_ids)
                if choice is not None and continuous:
                    yield _sse(self._envelope([choice], usage={"completion_tokens": generated}))
                elif choice is not None:
                    yield self._chunk([choice], include_usage)
            if include_usage:
                yield _sse(self._envelope([], usage=self._usage(finals)))
        except (RequestError, ClosedError) as exc:  # the request failed (or the engine stopped) mid-stream
            log.warning("server.stream_failed", error=repr(exc))
            yield _sse({"error": {"message": str(exc), "type": "server_error", "param": None, "code": None}})
        finally:
            await _aclose(rest)
        yield b"data: [DONE]\n\n"

    def _delta_choice(self, index: int, delta: Delta, offsets: dict[int, int]) -> dict[str, Any] | None:
        reason = delta.finish_reason  # stop, length; "abort" when the server shuts down (as vLLM)
        if not delta.text and not delta.token_ids and reason is None:
            return None
        logprobs = None
        if delta.logprobs is not None:
            if self.chat:
                logprobs = protocol.chat_logprobs(delta.logprobs)
            else:
                logprobs = protocol.completion_logprobs(delta.logprobs, offsets.get(index, 0))
                offsets[index] = offsets.get(index, 0) + sum(len(t) for t in logprobs["tokens"])
        if self.chat:
            return {
                "index": index,
                "delta": {"content": delta.text} if delta.text or not reason else {},
                "logprobs": logprobs,
                "finish_reason": reason,
            }
        return {"index": index, "text": delta.text, "logprobs": logprobs, "finish_reason": reason}

    def _envelope(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.server.model_name,
            "choices": choices,
            **extra,
        }

    def _chunk(self, choices: list[dict[str, Any]], include_usage: bool) -> bytes:
        return _sse(self._envelope(choices, **({"usage": None} if include_usage else {})))


async def _prepend(
    first: tuple[int, Delta] | None, rest: AsyncIterator[tuple[int, Delta]]
) -> AsyncIterator[tuple[int, Delta]]:
    if first is not None:
        yield first
    async for item in rest:
        yield item


async def _unless_disconnected(request: Request, work: Awaitable[dict[str, Any]]) -> dict[str, Any] | None:
    """``work``'s result, or None once the client has gone away: then its requests are
    cancelled (aborted in the engine), as a streamed request's are."""
    result: dict[str, Any] | None = None

    async def run(scope: anyio.CancelScope) -> None:
        nonlocal result
        result = await work
        scope.cancel()

    async with _task_group() as tg:
        tg.start_soon(run, tg.cancel_scope)
        while (await request.receive())["type"] != "http.disconnect":
            pass
        tg.cancel_scope.cancel()  # the client left before the result
    return result


@contextlib.asynccontextmanager
async def _task_group() -> AsyncIterator[anyio.abc.TaskGroup]:
    """A task group that raises its first task's error as itself (with its own cause), so
    that the error maps to its HTTP status."""
    try:
        async with anyio.create_task_group() as tg:
            yield tg
    except BaseExceptionGroup as group:
        raise group.exceptions[0] from group.exceptions[0].__cause__


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class _Merged:
    """The deltas of several streams as ``(index, delta)``, in the order they come; closing
    it aborts every stream that has not finished."""

    def __init__(self, streams: list[tuple[int, Any]]) -> None:
        self.streams = streams
        self.tg: Any = None
        self.live = len(streams)

    def __aiter__(self) -> _Merged:
        return self

    async def __anext__(self) -> tuple[int, Delta]:
        if len(self.streams) == 1:  # one choice: no task group (the common case)
            index, stream = self.streams[0]
            return index, await stream.__anext__()
        if self.tg is None:
            self.send, self.receive = anyio.create_memory_object_stream[tuple[int, Delta] | BaseException](1)
            self.tg = anyio.create_task_group()
            await self.tg.__aenter__()
            for index, stream in self.streams:
                self.tg.start_soon(self._pump, index, stream)
        if self.live == 0:
            raise StopAsyncIteration
        while True:
            item = await self.receive.receive()
            if isinstance(item, StopAsyncIteration):
                self.live -= 1
                if self.live == 0:
                    raise StopAsyncIteration
                continue
            if isinstance(item, BaseException):
                raise item
            return item

    async def _pump(self, index: int, stream: Any) -> None:
        try:
            async for delta in stream:
                await self.send.send((index, delta))
            await self.send.send(StopAsyncIteration())
        except Exception as exc:  # noqa: BLE001 - handed to the reader
            await self.send.send(exc)

    async def aclose(self) -> None:
        for _, stream in self.streams:
            await stream.aclose()
        if self.tg is not None:
            tg, self.tg = self.tg, None
            tg.cancel_scope.cancel()
            await tg.__aexit__(None, None, None)
            self.send.close()
            self.receive.close()


async def _aclose(it: Any) -> None:
    with anyio.CancelScope(shield=True):
        await it.aclose()


def _validation_error(exc: ValidationError) -> Response:
    first = exc.errors()[0]
    loc = ".".join(str(part) for part in first.get("loc", ()))
    if first.get("type") == "json_invalid":
        return error(400, "the request body is not valid JSON", code="invalid_json")
    if first.get("type") == "extra_forbidden":
        return error(
            400, f"unrecognized request argument supplied: {loc}", param=loc, code="unknown_parameter"
        )
    if first.get("type") == "missing":
        return error(400, f"missing required parameter: {loc}", param=loc, code="missing_required_parameter")
    return error(400, f"invalid value for {loc}: {first.get('msg')}", param=loc, code="invalid_value")


def _engine_error(exc: BaseException, prompt_param: str, limits: ServerLimits) -> Response:
    if isinstance(exc, ProtocolError):
        return error(exc.status, str(exc), param=exc.param, code=exc.error_code)
    if isinstance(exc, PromptTooLongError):
        return error(400, str(exc), param=prompt_param, code="context_length_exceeded")
    if isinstance(exc, QueueFullError):
        return error(
            429,
            "the server is at capacity: retry later",
            "rate_limit_exceeded",
            code="rate_limit_exceeded",
            headers={"Retry-After": str(limits.retry_after_s)},
        )
    if isinstance(exc, InvalidConfigError | InvalidArgumentError):
        return error(400, str(exc), code="invalid_value")
    if isinstance(exc, ClosedError):
        return error(503, "the engine is not serving", "service_unavailable", code="unavailable")
    if isinstance(exc, RequestError) and isinstance(exc.__cause__, InvalidConfigError | InvalidArgumentError):
        return error(400, str(exc.__cause__), code="invalid_value")  # e.g. a schema the grammar rejects
    if isinstance(exc, RequestError):
        log.warning("server.request_failed", error=repr(exc))
        return error(500, str(exc), "server_error")
    log.error("server.internal_error", error=repr(exc))
    return error(500, "internal error", "server_error")


def create_app(
    engine: Engine,
    *,
    model_name: str,
    api_key: str | None = None,
    limits: ServerLimits | None = None,
    lifespan: Any = None,
) -> Any:
    """An ASGI app serving OpenAI's API from ``engine`` (started and closed by the caller,
    or by ``lifespan``). ``api_key``: every endpoint but ``/health`` requires
    ``Authorization: Bearer <api_key>``."""
    limits = limits or ServerLimits()
    server = OpenAIServer(engine, model_name, limits)
    routes = [
        Route("/health", server.health, methods=["GET"]),
        Route("/metrics", server.metrics, methods=["GET"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/v1/models/{model:path}", server.model, methods=["GET"]),
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/chat/completions", server.chat_completions, methods=["POST"]),
    ]

    async def not_found(request: Request, exc: Exception) -> Response:
        return error(404, f"no route {request.method} {request.url.path}", code="not_found")

    async def not_allowed(request: Request, exc: Exception) -> Response:
        return error(405, f"method {request.method} not allowed here", code="method_not_allowed")

    async def internal(request: Request, exc: Exception) -> Response:
        log.error("server.internal_error", error=repr(exc))
        return error(500, "internal error", "server_error")

    app = Starlette(
        routes=routes,
        exception_handlers={404: not_found, 405: not_allowed, 500: internal},
        lifespan=lifespan,
    )
    guard = _Guard(app, api_key, limits.max_body_bytes)
    guard.server = server  # (serve() drains it on shutdown)
    return guard
