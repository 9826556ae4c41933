"""An OpenAI-compatible HTTP server on the engine (the ``server`` extra: Starlette, uvicorn,
pydantic, prometheus-client).

``python -m engine serve`` runs it; :func:`create_app` embeds it in an existing ASGI
deployment (the caller starts and closes the engine). Modules: ``protocol`` (the wire
format and its mapping onto the engine's parameters), ``serving`` (engine outputs as
responses and event streams, no HTTP), ``app`` (routes, errors), ``metrics`` (Prometheus).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Callable
from typing import Any

from ..logs import get_logger
from ..scheduler import Engine, EngineConfig
from .app import ServerLimits, create_app

__all__ = ["API_KEY_ENV", "ServerLimits", "create_app", "serve"]

log = get_logger("engine.server")

#: the environment variable ``serve`` reads the API key from when ``--api-key`` is not given
API_KEY_ENV = "ENGINE_API_KEY"


async def serve(
    config: EngineConfig,
    *,
    model_name: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    shutdown_timeout: float = 10.0,
    limits: ServerLimits | None = None,
    strict_params: bool = False,
    vllm_metrics: bool = False,
    on_ready: Callable[[], None] | None = None,
) -> None:
    """Serve ``config``'s engine over HTTP until SIGINT/SIGTERM.

    Shutdown: the listening socket closes and new requests get 503; requests in flight
    have ``shutdown_timeout`` seconds to finish, then are aborted (each stream ends with
    finish reason ``abort`` and ``[DONE]``); the engine closes.
    """
    import uvicorn

    engine = Engine(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        async with engine:
            log.info("server.ready", host=host, port=port, model=model_name)
            if on_ready is not None:
                on_ready()
            yield

    app = create_app(
        engine,
        model_name=model_name,
        api_key=api_key,
        limits=limits,
        lifespan=lifespan,
        strict_params=strict_params,
    )

    class Server(uvicorn.Server):
        async def shutdown(self, sockets: Any = None) -> None:
            app.server.draining = True  # new requests get 503

            async def abort_late() -> None:
                await asyncio.sleep(shutdown_timeout)
                n = engine.abort_all()
                log.warning("server.shutdown_aborted", requests=n)

            aborter = asyncio.create_task(abort_late())
            try:
                await super().shutdown(sockets)
            finally:
                aborter.cancel()

    uv_config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_config=None,  # the application's logging decides (uvicorn logs through `logging`)
        access_log=False,
        timeout_graceful_shutdown=int(shutdown_timeout) + 5,  # aborted streams end well before
        lifespan="on",
    )
    await Server(uv_config).serve()


def api_key_from_env() -> str | None:
    return os.environ.get(API_KEY_ENV) or None
