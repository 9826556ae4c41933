"""The ASGI app: OpenAI's ``/v1`` endpoints over one :class:`Engine` (Starlette).

HTTP only: the request body is validated by ``protocol`` and answered by ``serving``. A
client that disconnects aborts its requests (their slots are freed at the next step
boundary). Every error is OpenAI-style JSON: ``{"error": {"message", "type", "param",
"code"}}``.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..logs import get_logger
from ..scheduler import Engine, QueueFullError, RequestError
from ..session import ClosedError, InvalidArgumentError, InvalidConfigError, PromptTooLongError
from . import protocol
from .metrics import metrics_registry, render
from .protocol import ChatRequest, CompletionRequest, ProtocolError
from .serving import OpenAIServing

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
    return JSONResponse(protocol.error_body(message, type_, param, code), status_code=status, headers=headers)


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
    """The routes' state: the engine's OpenAI serving, the model's name, the metrics."""

    def __init__(
        self, engine: Engine, model_name: str, limits: ServerLimits, strict_params: bool = False
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        self.limits = limits
        self.strict_params = strict_params  # unknown request fields get 400 (else logged)
        self.serving = OpenAIServing(engine, model_name)
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
        prompt_param = "messages" if kind is ChatRequest else "prompt"
        try:
            body = protocol.parse(kind, await request.body(), strict=self.strict_params)
            if body.model != self.model_name:
                return self._unknown_model(body.model)
            if self.draining:
                return error(503, "the server is shutting down", "service_unavailable", code="unavailable")
            call = self.serving.call(body)
            if call.stream:
                return StreamingResponse(
                    await self.serving.stream(call),
                    media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                )
            result = await _unless_disconnected(request, self.serving.complete(call))
            return JSONResponse(result) if result is not None else Response(status_code=499)
        except Exception as exc:  # noqa: BLE001 - every failure is an OpenAI-style error
            return _engine_error(exc, prompt_param, self.limits)


async def _unless_disconnected(request: Request, work: Awaitable[dict[str, Any]]) -> dict[str, Any] | None:
    """``work``'s result, or None once the client has gone away: then its requests are
    cancelled (aborted in the engine), as a streamed request's are. The task group is
    entered and left in this task."""
    result: dict[str, Any] | None = None

    async def run(scope: anyio.CancelScope) -> None:
        nonlocal result
        result = await work
        scope.cancel()

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(run, tg.cancel_scope)
            while (await request.receive())["type"] != "http.disconnect":
                pass
            tg.cancel_scope.cancel()  # the client left before the result
    except BaseExceptionGroup as group:  # the work's own error, as itself (it maps to a status)
        raise group.exceptions[0] from group.exceptions[0].__cause__
    return result


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
    strict_params: bool = False,
) -> Any:
    """An ASGI app serving OpenAI's API from ``engine`` (started and closed by the caller,
    or by ``lifespan``). ``api_key``: every endpoint but ``/health`` requires
    ``Authorization: Bearer <api_key>``. ``strict_params``: a request field the API does
    not know gets 400, as OpenAI's own API answers (by default it is accepted and logged,
    as vLLM and llama-server do: routers and clients add their own)."""
    limits = limits or ServerLimits()
    server = OpenAIServer(engine, model_name, limits, strict_params)
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
