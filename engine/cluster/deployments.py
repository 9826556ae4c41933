"""The two tiers on Ray Serve: engine replicas (one :class:`~engine.Engine` each) and an
OpenAI ingress in front of them.

The ingress is ``engine serve``'s own app (``engine.server.app``: validation, errors,
streaming responses) over a :class:`ClusterBackend`: it calls the replicas through a
deployment handle, so Serve's request router (``prefix``, ``session``, ``pow2``) picks the
replica. Each replica answers with ``engine.server.serving`` — the same code that answers
``engine serve`` — and reports its load to the routers and its health to Serve.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from ray import serve
from ray.exceptions import RayError
from ray.serve.config import RequestRouterConfig
from ray.serve.exceptions import RayServeException
from ray.serve.schema import ApplicationStatus

from ..logs import get_logger
from ..models import NAMED_MODELS, resolve_model
from ..scheduler import Engine, EngineConfig
from ..server import protocol
from ..server.app import OpenAIServer, ServerLimits, asgi_app
from ..server.serving import DONE, Answer, ApiError, OpenAIServing, api_error, sse
from ..session import SpeculativeConfig
from .routing import ROUTERS, ReplicaRequest, routing_text

__all__ = ["ClusterConfig", "EngineReplica", "OpenAIIngress", "app_builder", "build_app"]

log = get_logger("engine.cluster")

#: the header that names the replica that served a response
REPLICA_HEADER = "x-engine-replica"
#: the engine replicas' deployment
ENGINE_DEPLOYMENT = "EngineReplica"
#: the header whose value keeps a session on one replica (``--router session``)
SESSION_HEADER = "x-session-id"


@dataclass(frozen=True)
class ClusterConfig:
    """A cluster: what each replica serves (``engine``: :class:`EngineConfig` fields, plain
    values) and how Serve runs them."""

    engine: dict[str, Any]
    model_name: str
    replicas: int = 2
    min_replicas: int | None = None  #: with max_replicas: autoscaling on queue depth
    max_replicas: int | None = None
    #: more of Serve's ``autoscaling_config`` (delays, look-back period...), over ours
    autoscaling: dict[str, Any] | None = None
    replica_cpus: float = 1.0  #: CPUs each replica reserves (its engine's threads)
    router: str = "prefix"
    #: prefix router: how much busier than the least busy a full replica keeps its
    #: conversations (default n_seq / 2)
    imbalance: int | None = None
    graceful_shutdown_timeout_s: float = 20.0
    strict_params: bool = False
    api_key: str | None = None

    def __post_init__(self) -> None:
        if self.router not in ROUTERS:
            raise ValueError(f"router must be one of {', '.join(ROUTERS)}, got {self.router!r}")
        if (self.min_replicas is None) != (self.max_replicas is None):
            raise ValueError("give both min_replicas and max_replicas (autoscaling), or neither")
        if self.replica_cpus <= 0:
            raise ValueError("replica_cpus must be > 0")

    @property
    def n_seq(self) -> int:
        return int(self.engine.get("n_seq", EngineConfig.n_seq))

    def as_args(self) -> dict[str, Any]:
        """Plain values, for ``serve deploy``'s YAML (:func:`app_builder` reads them back)."""
        return dataclasses.asdict(self)


def engine_config(values: Mapping[str, Any], threads: int) -> EngineConfig:
    """An :class:`EngineConfig` from plain values (``speculative`` may be the fields of a
    :class:`SpeculativeConfig`), its threads those the replica reserves."""
    values = dict(values)
    for key in ("model", "draft_model"):  # a model fetched by name is fetched on this machine
        if values.get(key) in NAMED_MODELS:
            values[key] = str(resolve_model(values[key]))
    spec = values.get("speculative")
    if isinstance(spec, Mapping):
        values["speculative"] = SpeculativeConfig(**spec, n_seq=int(values.get("n_seq", EngineConfig.n_seq)))
    return EngineConfig(**{**values, "threads": threads})


class EngineReplica:
    """One engine in a replica: it answers validated API calls with ``engine serve``'s
    code and reports its load (:meth:`record_routing_stats`) and health."""

    async def __init__(self, engine: dict[str, Any], model_name: str, threads: int) -> None:  # type: ignore[misc]
        try:
            self.replica = serve.get_replica_context().replica_id.unique_id
        except RayServeException:  # (not in a Serve replica: tests)
            self.replica = str(os.getpid())
        self._ready: asyncio.Future[Engine] = asyncio.get_running_loop().create_future()
        self._stop = asyncio.Event()
        # the engine is started and closed by one task of its own (its task group must be)
        self._runner = asyncio.create_task(self._run(engine_config(engine, threads)))
        self.engine = await self._ready
        self.serving = OpenAIServing(self.engine, model_name)
        log.info("cluster.replica_ready", replica=self.replica)

    async def _run(self, config: EngineConfig) -> None:
        try:
            async with Engine(config) as engine:
                self._ready.set_result(engine)
                await self._stop.wait()
        except BaseException as exc:
            if not self._ready.done():
                self._ready.set_exception(exc)
            raise

    async def answer(self, request: ReplicaRequest) -> dict[str, Any]:
        """A whole response: ``{"status", "body", "headers", "replica"}``."""
        try:
            answer = await self.serving.answer(request.body)
            return {"status": 200, "body": answer.body, "headers": {}, "replica": self.replica}
        except Exception as exc:  # noqa: BLE001 - every failure is an OpenAI-style error
            e = api_error(exc, _prompt_param(request.body))
            return {"status": e.status, "body": e.body, "headers": e.headers, "replica": self.replica}

    async def answer_stream(self, request: ReplicaRequest) -> AsyncIterator[dict[str, Any] | bytes]:
        """A streamed response: first a head (``answer``'s fields, ``body`` only for an
        error), then the server-sent events. Closing it aborts the requests."""
        try:
            answer = await self.serving.answer(request.body)
        except Exception as exc:  # noqa: BLE001 - refused before the stream starts
            e = api_error(exc, _prompt_param(request.body))
            yield {"status": e.status, "body": e.body, "headers": e.headers, "replica": self.replica}
            return
        assert answer.chunks is not None
        yield {"status": 200, "headers": {}, "replica": self.replica}
        chunks = answer.chunks
        try:
            async for chunk in chunks:
                yield chunk
        finally:
            await chunks.aclose()  # type: ignore[attr-defined]

    async def record_routing_stats(self) -> dict[str, Any]:
        """What the request routers see of this replica: its queue, running requests and
        KV-cache use."""
        return self.engine.load().as_dict()

    async def check_health(self) -> None:
        if not self.engine.serving:
            raise RuntimeError(f"replica {self.replica}: the engine is not serving")

    async def pid(self) -> int:
        """(tests: the process to kill)"""
        return os.getpid()

    async def __del__(self) -> None:
        self._stop.set()  # Serve drained the requests it routed here first
        await asyncio.shield(self._runner)


def _prompt_param(body: Any) -> str:
    return "messages" if isinstance(body, protocol.ChatRequest) else "prompt"


@dataclass
class ClusterBackend:
    """The ingress's :class:`~engine.server.serving.Backend`: the replicas, through a
    deployment handle (Serve's request router chooses one per request)."""

    handle: Any
    model_name: str
    session_routing: bool = False
    #: the health check's last answer and when it was taken (it asks Serve's controller)
    _ready: tuple[float, bool] = field(default=(-1e9, False), init=False)
    _deployed: bool = field(default=False, init=False)

    async def ready(self) -> bool:
        """Able to answer: an engine replica is running and the application's first
        deployment has finished (until then a load balancer that sent traffic would see
        it all land on the first replica up). Asked of Serve at most once a second."""
        checked, ready = self._ready
        if time.monotonic() - checked < 1.0:
            return ready
        status = await asyncio.to_thread(serve.status)
        app = status.applications.get(serve.get_replica_context().app_name)
        engines = app.deployments.get(ENGINE_DEPLOYMENT) if app else None
        running = (
            sum(n for state, n in engines.replica_states.items() if state == "RUNNING") if engines else 0
        )
        self._deployed = self._deployed or (app is not None and app.status == ApplicationStatus.RUNNING)
        ready = running > 0 and self._deployed
        self._ready = (time.monotonic(), ready)
        return ready

    async def answer(self, body: Any, headers: Mapping[str, str] | None = None) -> Answer:
        request = ReplicaRequest(body, routing_text(body))
        handle = self.handle
        session = (headers or {}).get(SESSION_HEADER)
        if self.session_routing and session:
            handle = handle.options(session_id=session)
        if body.stream:
            return await self._stream(handle, request)
        response = handle.answer.remote(request)
        try:
            reply = await response
        except asyncio.CancelledError:
            response.cancel()  # the client left: the replica aborts its requests
            raise
        except RayError as exc:
            raise _replica_failed(exc) from None
        if reply["status"] != 200:
            raise _error(reply)
        return Answer(body=reply["body"], headers=_headers(reply))

    async def _stream(self, handle: Any, request: ReplicaRequest) -> Answer:
        stream = handle.options(stream=True).answer_stream.remote(request)
        try:
            head = await stream.__anext__()
        except RayError as exc:
            stream.cancel()
            raise _replica_failed(exc) from None
        if head["status"] != 200:
            raise _error(head)
        return Answer(chunks=_relay(stream), headers=_headers(head))


async def _relay(stream: Any) -> AsyncIterator[bytes]:
    """A replica's events; if the replica dies mid-stream, an error event then ``[DONE]``.
    Closing it (the client left) cancels the replica's stream, which aborts its requests."""
    try:
        async for chunk in stream:
            yield chunk
    except RayError as exc:
        log.warning("cluster.stream_failed", error=repr(exc))
        e = _replica_failed(exc)
        yield sse(e.body)
        yield DONE
    finally:
        stream.cancel()


def _headers(reply: Mapping[str, Any]) -> dict[str, str]:
    return {**reply.get("headers", {}), REPLICA_HEADER: reply["replica"]}


def _error(reply: Mapping[str, Any]) -> ApiError:
    return ApiError(reply["status"], reply["body"], _headers(reply))


def _replica_failed(exc: BaseException) -> ApiError:
    message = f"the replica serving the request failed: {type(exc).__name__}"
    return ApiError(503, protocol.error_body(message, "service_unavailable", code="unavailable"))


class OpenAIIngress:
    """The OpenAI endpoints of the cluster: ``engine serve``'s app over the replicas."""

    def __init__(self, replicas: Any, config: ClusterConfig) -> None:
        self.backend = ClusterBackend(replicas, config.model_name, session_routing=config.router == "session")
        self.config = config

    def __serve_build_asgi_app__(self) -> Any:
        server = OpenAIServer(self.backend, ServerLimits(), self.config.strict_params)
        return asgi_app(server, api_key=self.config.api_key)


def build_app(config: ClusterConfig) -> Any:
    """The Serve application: an ingress (no CPU reserved) bound to the engine replicas."""
    threads = max(1, round(config.replica_cpus))
    n_seq = config.n_seq
    router = ROUTERS[config.router]
    options: dict[str, Any] = {
        "name": ENGINE_DEPLOYMENT,
        "ray_actor_options": {"num_cpus": config.replica_cpus},
        # Serve's default (5) would hold back a replica with more slots; a few requests
        # beyond the slots wait in the engine's own queue, where a prefix finds its cache
        "max_ongoing_requests": 2 * n_seq,
        "graceful_shutdown_timeout_s": config.graceful_shutdown_timeout_s,
        "graceful_shutdown_wait_loop_s": 0.5,
        "health_check_period_s": 2.0,
        "health_check_timeout_s": 10.0,
    }
    if config.min_replicas is not None:
        options["autoscaling_config"] = {
            "min_replicas": config.min_replicas,
            "max_replicas": config.max_replicas,
            "target_ongoing_requests": n_seq,  # scale up when requests queue beyond the slots
            "upscale_delay_s": 5.0,
            "downscale_delay_s": 30.0,
            **(config.autoscaling or {}),
        }
    else:
        options["num_replicas"] = config.replicas
    if router is not None:
        kwargs = (
            {"slots": n_seq, "imbalance": config.imbalance or max(1, n_seq // 2)}
            if config.router == "prefix"
            else {}
        )
        options["request_router_config"] = RequestRouterConfig.model_validate(
            {
                "request_router_class": router,
                "request_router_kwargs": kwargs,
                "request_routing_stats_period_s": 2.0,
            }
        )
    replica = serve.deployment(**options)(EngineReplica)
    ingress = serve.deployment(
        name="OpenAIIngress", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=100_000
    )(serve.ingress()(OpenAIIngress))
    return ingress.bind(replica.bind(config.engine, config.model_name, threads), config)


def app_builder(args: dict[str, Any]) -> Any:
    """``serve deploy``'s entry point (``import_path: engine.cluster:app_builder``)."""
    return build_app(ClusterConfig(**args))
