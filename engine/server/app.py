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
from ..scheduler import Engine
from . import protocol
from .metrics import metrics_registry, render
from .protocol import ChatRequest, CompletionRequest
from .serving import Answer, Backend, OpenAIServing, api_error

__all__ = ["OpenAIServer", "ServerLimits", "asgi_app", "create_app"]

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
    """The routes' state: the backend that answers, the model's name, the metrics."""

    def __init__(
        self,
        backend: Backend,
        limits: ServerLimits,
        strict_params: bool = False,
        registry: Any = None,
    ) -> None:
        self.backend = backend
        self.model_name = backend.model_name
        self.limits = limits
        self.strict_params = strict_params  # unknown request fields get 400 (else logged)
        self.registry = registry  # Prometheus (None: no /metrics)
        self.draining = False  # shutting down: new requests get 503
        self.created = protocol.now()

    # --- plain endpoints -----------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        if self.draining or not await self.backend.ready():
            return error(503, "the engine is not serving", "service_unavailable", code="unavailable")
        return JSONResponse({"status": "ok"})

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        if request.path_params["model"] != self.model_name:
            return self._unknown_model(request.path_params["model"])
        return JSONResponse(self._model_card())

    async def metrics(self, request: Request) -> Response:
        if self.registry is None:
            return error(404, "no metrics here", code="not_found")
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
            body = protocol.parse(kind, await request.body(), strict=self.strict_params)
            if body.model != self.model_name:
                return self._unknown_model(body.model)
            if self.draining:
                return error(503, "the server is shutting down", "service_unavailable", code="unavailable")
            if body.stream:
                answer = await self.backend.answer(body, request.headers)
                assert answer.chunks is not None
                headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **answer.headers}
                return StreamingResponse(answer.chunks, media_type="text/event-stream", headers=headers)
            whole = await _unless_disconnected(request, self.backend.answer(body, request.headers))
            if whole is None:
                return Response(status_code=499)
            return JSONResponse(whole.body, headers=whole.headers)
        except Exception as exc:  # noqa: BLE001 - every failure is an OpenAI-style error
            prompt_param = "messages" if kind is ChatRequest else "prompt"
            e = api_error(exc, prompt_param, self.limits.retry_after_s)
            return JSONResponse(e.body, status_code=e.status, headers=e.headers)


async def _unless_disconnected(request: Request, work: Awaitable[Answer]) -> Answer | None:
    """``work``'s result, or None once the client has gone away: then its requests are
    cancelled (aborted in the engine), as a streamed request's are. The task group is
    entered and left in this task."""
    result: Answer | None = None

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


def create_app(
    engine: Engine,
    *,
    model_name: str,
    api_key: str | None = None,
    limits: ServerLimits | None = None,
    lifespan: Any = None,
    strict_params: bool = False,
    vllm_metrics: bool = False,
) -> Any:
    """An ASGI app serving OpenAI's API from ``engine`` (started and closed by the caller,
    or by ``lifespan``). ``api_key``: every endpoint but ``/health`` requires
    ``Authorization: Bearer <api_key>``. ``strict_params``: a request field the API does
    not know gets 400, as OpenAI's own API answers (by default it is accepted and logged,
    as vLLM and llama-server do: routers and clients add their own). ``vllm_metrics``:
    ``/metrics`` also carries the scheduling gauges under vLLM's names."""
    limits = limits or ServerLimits()
    registry = metrics_registry(engine, model_name, vllm_metrics)
    server = OpenAIServer(OpenAIServing(engine, model_name), limits, strict_params, registry)
    return asgi_app(server, api_key=api_key, lifespan=lifespan)


def asgi_app(server: OpenAIServer, *, api_key: str | None = None, lifespan: Any = None) -> Any:
    """The routes of ``server`` behind the guard (API key, body size)."""
    limits = server.limits
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
