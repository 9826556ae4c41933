"""The async engine: any number of requests over ``n_seq`` sequences, one native step at a time.

The step loop reads: plan (:meth:`Scheduler.schedule`), ONE native call (settle, boundary
work, one batched draft call, one target decode, verification), apply its result
(:meth:`Scheduler.update`, through the pure output path), repeat. Callers are woken as
their requests produce tokens or end.

Written against anyio: it runs under asyncio and trio alike. ``start()`` and ``close()``
enter and leave a task group, so call them from the same task (``async with Engine(...)``
does). A fault anywhere in the loop fails the requests it touches and the engine goes on;
a fault it cannot recover from fails every request with :class:`EngineDeadError`, and so
does every later call. ``close()`` always stops the native thread and returns.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import uuid
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from time import perf_counter
from typing import Any

import anyio
import anyio.abc

from ..logs import get_logger
from ..session import (
    ClosedError,
    Model,
    Runtime,
    SpeculativeSession,
)
from ..session.chat import ChatOptions, ChatTemplate, builtin_template
from .drafting import DrafterSync
from .drafting.calibration import calibrate
from .errors import EngineDeadError, UnknownRequestError
from .inputs import InputProcessor, Prompt
from .native import step_plan, step_runner
from .params import EngineConfig, SamplingParams, default_model_path
from .planner import Plan
from .request import CheckpointWaiter, Request, RequestOutput
from .scheduler import EngineMetrics, Scheduler
from .streams import RequestStream, StreamGroup, read_message

__all__ = ["Engine", "EngineLoad"]

log = get_logger("engine")

#: consecutive faulty steps after which the engine gives up (a fault that repeats is not
#: one request's: the engine's own state is broken)
MAX_CONSECUTIVE_FAULTS = 3
#: how long a step waits for requests being submitted when it starts (their tokenization)
ARRIVAL_WAIT_S = 0.01
#: event-loop turns a step gives the callers whose requests just ended, to submit their
#: next one before the step is planned: a caller that goes on at once (a chat turn, a
#: client in a loop) is back within a few (``engine.stream`` in a loop: 3). Missing it
#: costs that request a whole step: its prompt, tokenized on the native thread, waited
#: behind the step
CALLER_TURNS = 8


class Engine:
    """Serve generation requests from one model with batched speculative decoding.

    Use as ``async with Engine(config) as engine:``; see :meth:`generate` and :meth:`stream`.
    """

    def __init__(self, config: EngineConfig | None = None, *, runtime: Runtime | None = None) -> None:
        """``runtime``: a native thread to share with other engines instead of one of this
        engine's own. Their steps then take turns on it, under one OpenMP team: what a
        measurement comparing two engines wants (``benchmarks/idle_cost.py``), not serving,
        where each engine would wait for the others' steps. The engine does not close a
        runtime it was given, and what it loaded stays on it until the runtime is closed."""
        self.config = config or EngineConfig()
        self.metrics = EngineMetrics()
        self._runtime: Runtime | None = None
        self._given_runtime = runtime
        self._session: SpeculativeSession | None = None
        self._runner: Any = None
        self._model: Model | None = None
        self._scheduler: Scheduler | None = None
        self._inputs: InputProcessor | None = None
        self._arrivals = itertools.count()
        self._wakeup = anyio.Event()
        self._task_group: anyio.abc.TaskGroup | None = None
        self._closed = False
        self._dead: EngineDeadError | None = None
        self._submitting = 0  # submissions being tokenized
        self._submitted = anyio.Event()

    # --- lifecycle ---------------------------------------------------------------------
    async def __aenter__(self) -> Engine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        """Start the native thread and load the models (without blocking the event loop).

        :raises ModelLoadError, InvalidConfigError, IncompatibleContextsError:
        """
        if self._runtime is not None or self._closed:
            return
        self._runtime = self._given_runtime or Runtime()
        try:
            await anyio.to_thread.run_sync(self._open)
        except BaseException:
            if self._given_runtime is None:
                self._runtime.close()
            self._runtime = None
            raise
        self._task_group = anyio.create_task_group()
        await self._task_group.__aenter__()
        self._task_group.start_soon(self._step_loop, name="engine-step-loop")
        _warn_if_cpus_shared(self)
        log.info(
            "engine.started",
            model=self._model.info.path if self._model else None,
            speculative=self.config.spec.type,
            n_seq=self.config.n_seq,
        )

    def _open(self) -> None:
        cfg = self.config
        rt = self._runtime
        assert rt is not None
        spec = cfg.spec
        path = cfg.model if cfg.model is not None else default_model_path()
        self._model = Model.load(rt, path, n_gpu_layers=cfg.n_gpu_layers, mtp=spec.is_mtp)
        draft = Model.load(rt, cfg.draft_model, n_gpu_layers=cfg.n_gpu_layers) if cfg.draft_model else None
        self._session = SpeculativeSession.open(self._model, spec, cfg.context(), draft_model=draft)
        self._runner = step_runner(self._session)
        fingerprint = self._session.fingerprint()
        with_draft = self._session.draft_context is not None
        info = self._model.info
        self._scheduler = Scheduler(
            cfg,
            info.eog_tokens,
            fingerprint,
            self.metrics,
            prefix_cache=cfg.prefix_cache and not (info.is_recurrent or info.is_hybrid),
            drafter_sync=DrafterSync(self._session.drafter_sync()),
            shadow_drafts=self._session.can_shadow(),
        )
        self._inputs = InputProcessor(
            self._model, cfg.n_ctx, fingerprint, with_draft, _chat_template(self._model, cfg)
        )
        if spec.type != "none" and self._scheduler.policy.adaptive:
            calibrate(self._scheduler.policy, self._session, cfg.n_seq, cfg.n_batch, not cfg.unified_kv)

    async def close(self) -> None:
        """End what is in flight (``abort``), stop the step loop, free the models, join the
        native thread. Idempotent; never raises for the loop's own faults."""
        if self._closed:
            return
        self._closed = True
        if self._task_group is not None:  # (the task group is left first: scopes nest)
            task_group, self._task_group = self._task_group, None
            task_group.cancel_scope.cancel()
            await task_group.__aexit__(None, None, None)
        with anyio.CancelScope(shield=True):
            if self._scheduler is not None:
                self._scheduler.end_all(self._dead)
            if self._runtime is not None and self._given_runtime is None:
                await anyio.to_thread.run_sync(self._runtime.close)
        log.info("engine.closed", steps=self.metrics.steps)

    @property
    def serving(self) -> bool:
        """Started, not closed, and able to serve."""
        return self._scheduler is not None and not self._closed and self._dead is None

    def abort_all(self) -> int:
        """Abort every running and waiting request (finish reason ``abort``), e.g. when a
        server's shutdown grace period ends; returns how many."""
        requests = [r for r in self._scheduler.requests.values() if not r.finished] if self._scheduler else []
        for r in requests:
            self._abort(r)
        return len(requests)

    @property
    def model(self) -> Model:
        if self._model is None:
            raise ClosedError("the engine is not started")
        return self._model

    # --- requests ----------------------------------------------------------------------
    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        resume_from: bytes | None = None,
        priority: int = 0,
        checkpoint: bool = False,
        cache_prompt: bool = True,
        chat: ChatOptions | None = None,
    ) -> RequestOutput:
        """Generate a completion. ``prompt``: text, token ids, or chat messages (OpenAI's
        shape, rendered by the model's chat template; ``chat`` adds tools and other options,
        and ``output.message`` holds the answer as the template's format reads it: content,
        reasoning, tool calls).

        ``resume_from`` continues a sequence from :meth:`checkpoint` bytes (the prompt is
        appended to it); ``checkpoint=True`` returns the final state in
        ``output.checkpoint``. ``cache_prompt=False``: the request neither reuses a cached
        prefix of its prompt (see ``EngineConfig.prefix_cache``) nor leaves its sequence
        cached. Cancelling the awaiting task aborts the request.

        :raises QueueFullError, InvalidArgumentError, PromptTooLongError, StateError:
        :raises RequestError: the request failed in the engine (others go on).
        :raises EngineDeadError: the engine can no longer serve.
        """
        request = await self._submit(
            prompt, params, request_id, resume_from, priority, checkpoint, cache_prompt, chat
        )
        try:
            await request.done.wait()
        finally:
            if not request.finished:  # the caller was cancelled
                self._abort(request)
        if request.error is not None:
            raise request.error
        output = request.output()
        parser = request.chat_parser()
        if parser is not None:
            parser.update(output.text, final=True)
            read_message(output, parser)
        return output

    def stream(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        resume_from: bytes | None = None,
        priority: int = 0,
        checkpoint: bool = False,
        cache_prompt: bool = True,
        chat: ChatOptions | None = None,
    ) -> RequestStream:
        """Stream a completion: ``async for delta in engine.stream(...)`` yields
        :class:`Delta` pieces (whole UTF-8 characters); the last one carries the whole
        result in ``delta.output`` (with the final state when ``checkpoint=True``). The
        request is submitted at the first iteration (or by :meth:`RequestStream.start`);
        leaving the loop early (or ``aclose()``, or ``async with engine.stream(...) as
        deltas:``) aborts it. Chat messages stream their content as ``delta.text``, the
        thinking as ``delta.reasoning`` and tool calls as ``delta.tool_calls``.

        :raises: as :meth:`generate`, from the iteration.
        """
        return RequestStream(
            self,
            lambda group=None: self._submit(
                prompt,
                params,
                request_id,
                resume_from,
                priority,
                checkpoint,
                cache_prompt,
                chat,
                stream=group or True,
            ),
        )

    def stream_group(self, streams: Sequence[RequestStream]) -> StreamGroup:
        """Several not yet started streams (:meth:`stream`) as one: ``async for index,
        delta in engine.stream_group([...])`` yields each request's deltas as they come,
        tagged with its index, from one buffer (no task per request). Each request's error
        is raised when its turn comes; leaving the loop aborts every request."""
        return StreamGroup(self, streams)

    async def abort(self, request_id: str) -> None:
        """End a request (finish reason ``abort``); unknown or finished ids are a no-op."""
        request = self._scheduler.requests.get(request_id) if self._scheduler else None
        if request is not None:
            self._abort(request)

    async def checkpoint(self, request_id: str) -> bytes:
        """Capture a running request's sequence at the next step boundary (quiescent); the
        request continues. Resume with ``generate(..., resume_from=bytes)``.

        :raises UnknownRequestError: no such running or waiting request.
        """
        request = self._scheduler.requests.get(request_id) if self._scheduler else None
        if request is None or request.finished:
            raise UnknownRequestError(f"no running request {request_id!r}")
        waiter = CheckpointWaiter()
        request.checkpoint_waiters.append(waiter)
        self._wakeup.set()
        return await waiter.wait()

    async def _submit(
        self,
        prompt: Prompt,
        params: SamplingParams | None,
        request_id: str | None,
        resume_from: bytes | None,
        priority: int,
        want_checkpoint: bool,
        cache_prompt: bool = True,
        chat: ChatOptions | None = None,
        stream: bool | tuple[Any, int, int] = False,
    ) -> Request:
        scheduler, inputs = self._require_serving()
        params = params or SamplingParams()
        request_id = request_id or uuid.uuid4().hex
        scheduler.check_admissible(request_id)
        self._submitting += 1
        try:
            request = await inputs.request(
                request_id,
                prompt,
                params,
                resume_from=resume_from,
                priority=priority,
                want_checkpoint=want_checkpoint,
                arrival_index=next(self._arrivals),
                chat=chat,
            )
            request.cache_prompt = cache_prompt
            scheduler, _ = self._require_serving()  # it may have closed while tokenizing
            if stream:
                request.open_stream(self.config.stream_buffer, stream if isinstance(stream, tuple) else None)
            scheduler.add(request)
        finally:
            self._submitting -= 1
            self._submitted.set()
        self._wakeup.set()
        return request

    def _require_serving(self) -> tuple[Scheduler, InputProcessor]:
        if self._dead is not None:
            raise EngineDeadError(str(self._dead)) from self._dead.__cause__
        if self._closed or self._scheduler is None or self._inputs is None:
            raise ClosedError("the engine is not running")
        return self._scheduler, self._inputs

    def _abort(self, request: Request) -> None:
        if self._scheduler is not None and not request.finished:
            self._scheduler.finish(request, "abort")
            self._wakeup.set()  # its slot is cleared at the next boundary

    # --- the step loop -----------------------------------------------------------------
    async def _step_loop(self) -> None:
        assert self._scheduler is not None and self._runtime is not None
        scheduler, runtime = self._scheduler, self._runtime
        faults = 0  # consecutive faulty steps
        try:
            while True:
                plan: Plan | None = None
                try:
                    t0 = perf_counter()
                    plan = scheduler.schedule()
                    if plan.empty:
                        await self._wait_for_work()
                        continue
                    native = self._runner.step_async(step_plan(plan))
                    t1 = perf_counter()
                    result = await runtime.wait(native)
                    ended = self.metrics.requests_finished
                    t2 = perf_counter()
                    scheduler.update(plan, result)
                    self.metrics.host_seconds += perf_counter() - t2 + t1 - t0
                    faults = 0
                    await self._let_callers_submit(self.metrics.requests_finished > ended)
                except ClosedError:
                    raise  # the native thread is gone
                except Exception as exc:  # noqa: BLE001 - the step's requests fail, the engine goes on
                    faults += 1
                    self._step_fault(scheduler, plan, exc)
                    if faults >= MAX_CONSECUTIVE_FAULTS:
                        raise
                    await anyio.sleep(0)  # let the failed callers run
        except anyio.get_cancelled_exc_class():
            raise
        except BaseException as exc:  # noqa: BLE001 - nothing may leave the loop silently
            self._die(scheduler, exc)

    def _step_fault(self, scheduler: Scheduler, plan: Plan | None, exc: Exception) -> None:
        """Fail what the faulty step touched: the plan's requests, or when planning itself
        failed, every request holding a slot. Their slots are cleared at the next boundary."""
        phase = "planning" if plan is None else "step"
        touched = (
            [r for r in scheduler.slots.owner.values()]
            if plan is None
            else [r for r in plan.requests() if not r.finished]
        )
        log.error("engine.step_fault", phase=phase, error=repr(exc), failed=len(touched))
        self.metrics.step_faults += 1
        if plan is not None:
            scheduler.redo_boundary(plan)
        scheduler.fail_requests(touched, exc)

    async def _let_callers_submit(self, ended: bool) -> None:
        """Between steps: let the callers woken by this step run (when requests ended, for
        up to :data:`CALLER_TURNS` turns of the event loop, until one submits), and wait
        (briefly) for the requests they are submitting, so that a slot freed by a finished
        request is refilled in the next step rather than the one after (the prompt is
        tokenized on the native thread, which is idle now)."""
        for _ in range(CALLER_TURNS if ended else 1):
            await anyio.sleep(0)
            if self._submitting:
                break
        if self._submitting:
            with anyio.move_on_after(ARRIVAL_WAIT_S):
                while self._submitting:
                    self._submitted = anyio.Event()
                    await self._submitted.wait()

    async def _wait_for_work(self) -> None:
        await self._wakeup.wait()
        self._wakeup = anyio.Event()

    def _die(self, scheduler: Scheduler, exc: BaseException) -> None:
        dead = EngineDeadError(f"the engine stopped serving: {exc!r}")
        dead.__cause__ = exc
        self._dead = dead
        log.critical("engine.dead", error=repr(exc))
        scheduler.end_all(dead)

    def _delta_taken(self) -> None:
        self._wakeup.set()  # a request paused on a full stream buffer may go on

    # --- introspection (tests, metrics) ------------------------------------------------
    @property
    def prefix_cache(self) -> bool:
        """Whether finished sequences stay cached for prefix reuse (``EngineConfig.prefix_cache``,
        unless the target's recurrent state rules it out)."""
        return self._scheduler is not None and self._scheduler.slots.cache is not None

    def slots_in_use(self) -> int:
        return self.config.n_seq - self._scheduler.slots.n_free if self._scheduler else 0

    def load(self) -> EngineLoad:
        """What the engine holds now, for routers, autoscalers and metrics."""
        capacity = self.config.n_seq * self.config.n_ctx
        scheduler = self._scheduler
        if scheduler is None:
            return EngineLoad(0, 0, capacity, 0, 0)
        cache = scheduler.slots.cache
        return EngineLoad(
            waiting=len(scheduler.waiting),
            running=len(scheduler.slots.owner),
            kv_capacity=capacity,
            kv_running=sum(len(r.history) for r in scheduler.slots.owner.values()),
            kv_cached=sum(cache.held().values()) if cache is not None else 0,
        )

    async def kv_positions(self) -> list[int]:
        """Largest KV position per sequence (-1: empty), read between steps."""
        assert self._session is not None
        ctx = self._session.target_context
        return await anyio.to_thread.run_sync(lambda: [ctx.seq_pos_max(s) for s in range(self.config.n_seq)])


@dataclass(frozen=True)
class EngineLoad:
    """What an engine holds at one moment (:meth:`Engine.load`)."""

    waiting: int  #: requests waiting for a sequence slot
    running: int  #: requests holding a slot (reading their prompt or generating)
    kv_capacity: int  #: KV cells of every sequence (n_seq x n_ctx)
    kv_running: int  #: cells held by running requests' sequences
    kv_cached: int  #: cells held by finished sequences kept for prefix reuse (evicted on demand)

    @property
    def kv_usage(self) -> float:
        """Share of the KV cache running requests hold (vLLM's ``kv_cache_usage_perc``)."""
        return self.kv_running / self.kv_capacity if self.kv_capacity else 0.0

    def as_dict(self) -> dict[str, float]:
        return {**dataclasses.asdict(self), "kv_usage": self.kv_usage}


def _chat_template(model: Model, config: Any) -> ChatTemplate | None:
    """The template chat messages are rendered with: ``config.chat_template``, the model's
    own, or a built-in for its architecture; None when there is none. A template the chat
    module refuses fails the engine's start (InvalidConfigError naming it)."""
    if (
        config.chat_template is None
        and not model.info.chat_template
        and not builtin_template(model.info.arch)
    ):
        return None
    return model.chat_template(config.chat_template)


#: engines started in this process and not yet closed
_running: weakref.WeakSet[Engine] = weakref.WeakSet()


def _warn_if_cpus_shared(engine: Engine) -> None:
    """Warn when this process's engines use more CPU threads than it has CPUs.

    Each engine's native thread leads its own OpenMP team for llama.cpp's CPU kernels, and
    libgomp stops spin-waiting at barriers once a process holds more of its threads than it
    has CPUs: a second engine, even idle, slowed the first one's steps by about a fifth on
    2 cores (BENCHMARKS.md, "Speculation: notes on the runs")."""
    _running.add(engine)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    # (engines sharing a runtime share its thread and OpenMP team: counted once)
    live = {id(e._runtime): e for e in _running if e._runtime is not None and not e._closed}.values()
    threads = sum(e.config.threads or cpus for e in live)
    if len(live) > 1 and threads > cpus:
        log.warning(
            "engine.cpus_shared",
            engines=len(live),
            threads=threads,
            cpus=cpus,
            advice="run one engine per process (as the cluster's replicas do)",
        )
