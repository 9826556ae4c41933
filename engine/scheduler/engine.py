"""The async engine: any number of requests over ``n_seq`` sequences, one native step at a time.

Each step is planned in Python (admissions, aborts, checkpoints, prompt chunks, decode
entries), executed by ONE native call — one batched draft call, one target decode (more only
when the batch exceeds ``n_batch``), verification, accept and KV rollback — and its outputs
are fanned out to the waiting callers and streams. Boundary work (checkpoints, slot
clearing, restores) happens only between steps, where no draft proposal is pending.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog

from .. import _nb_spec
from ..session import (
    ClosedError,
    ContextConfig,
    InvalidArgumentError,
    Model,
    PromptTooLongError,
    Runtime,
    SessionError,
    SpeculativeSession,
    StateError,
)
from ..session import errors as session_errors
from ..session.checkpoint import SequenceCheckpoint, pack, unpack
from .params import EngineConfig, SamplingParams, default_model_path
from .planner import Plan, SlotTable, WaitQueue, WorkItem, plan_step
from .policy import DraftPolicy
from .request import Delta, FinishReason, Request, RequestOutput, RequestState

__all__ = ["Engine", "EngineMetrics", "QueueFullError", "RequestError", "UnknownRequestError"]

log = structlog.get_logger("engine")

Prompt = str | Sequence[int] | Sequence[dict[str, str]]


class QueueFullError(SessionError):
    """The wait queue is full (``EngineConfig.max_queue``)."""


class UnknownRequestError(SessionError, KeyError):
    """No running or waiting request has this id."""


class RequestError(SessionError):
    """A request failed in the engine; ``__cause__`` holds the native error."""


@dataclass
class EngineMetrics:
    """Engine-wide counters."""

    steps: int = 0
    decode_calls: int = 0
    draft_calls: int = 0
    max_decode_calls_per_step: int = 0  #: 1 unless a batch exceeded n_batch or failed
    max_draft_calls_per_step: int = 0  #: always <= 1: one draft call for every sequence
    batch_tokens: int = 0
    isolated_failures: int = 0  #: batches that failed and were decoded one sequence at a time
    draft_failures: int = 0  #: steps whose draft call failed (they verified no drafts)
    occupancy_sum: float = 0.0  #: sum over steps of active sequences / n_seq
    generated_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    requests_finished: int = 0
    queue_depth: int = 0
    started: float = field(default_factory=time.perf_counter)
    last_step: dict[str, Any] = field(default_factory=dict)

    @property
    def batch_occupancy(self) -> float:
        return self.occupancy_sum / self.steps if self.steps else 0.0

    @property
    def throughput(self) -> float:
        """Generated tokens per second since the engine started."""
        return self.generated_tokens / max(time.perf_counter() - self.started, 1e-9)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


class Engine:
    """Serve generation requests from one model with batched speculative decoding.

    Use as ``async with Engine(config) as engine:``; see :meth:`generate` and :meth:`stream`.
    """

    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        self.metrics = EngineMetrics()
        self._runtime: Runtime | None = None
        self._session: SpeculativeSession | None = None
        self._runner: Any = None
        self._model: Model | None = None
        self._slots = SlotTable(self.config.n_seq)
        self._waiting = WaitQueue()
        self._requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self._wakeup = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._closed = False
        self._fingerprint: dict[str, Any] = {}
        self._policy = DraftPolicy(
            adaptive=self.config.draft_policy == "adaptive", unified_kv=self.config.unified_kv
        )

    # --- lifecycle ---------------------------------------------------------------------
    async def __aenter__(self) -> Engine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        """Start the native thread and load the models (without blocking the event loop)."""
        if self._runtime is not None:
            return
        self._runtime = Runtime()
        try:
            await asyncio.to_thread(self._open)
        except BaseException:
            self._runtime.close()
            self._runtime = None
            raise
        self._loop_task = asyncio.create_task(self._run(), name="engine-step-loop")
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
        ctx = ContextConfig(
            n_ctx=cfg.n_ctx * cfg.n_seq,
            n_seq=cfg.n_seq,
            n_batch=cfg.n_batch,
            threads=cfg.threads,
            kv_unified=cfg.unified_kv,
        )
        self._session = SpeculativeSession.open(self._model, spec, ctx, draft_model=draft)
        self._runner = _nb_spec.StepRunner.create(self._session.native)
        self._fingerprint = self._session.fingerprint()

    async def close(self) -> None:
        """Abort what is in flight, stop the step loop, free the models, join the thread.
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except asyncio.CancelledError:
                pass
        for r in list(self._requests.values()):
            if r.final_pending is not None:  # finished, its final checkpoint will not come
                reason, new_ids = r.final_pending
                r.final_pending = None
                self._complete(r, reason, new_ids)
            else:
                self._finish(r, FinishReason.ABORT.value)
        if self._runtime is not None:
            await asyncio.to_thread(self._runtime.close)
        log.info("engine.closed", steps=self.metrics.steps)

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
    ) -> RequestOutput:
        """Generate a completion. ``prompt``: text, token ids, or chat messages.

        ``resume_from`` continues a sequence from :meth:`checkpoint` bytes (the prompt is
        appended to it); ``checkpoint=True`` returns the final state in
        ``output.checkpoint``. Cancelling the awaiting task aborts the request.

        :raises QueueFullError, InvalidArgumentError, PromptTooLongError, StateError:
        :raises RequestError: the request failed in the engine (others go on).
        """
        request = await self._submit(prompt, params, request_id, resume_from, priority, checkpoint)
        try:
            await request.done.wait()
        except asyncio.CancelledError:
            self._abort(request)
            raise
        if request.error is not None:
            raise request.error
        return request.output()

    async def stream(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        resume_from: bytes | None = None,
        priority: int = 0,
        checkpoint: bool = False,
    ) -> AsyncIterator[Delta]:
        """Stream a completion as :class:`Delta` pieces (whole UTF-8 characters). The last
        delta carries the whole result in ``delta.output`` (with the final state when
        ``checkpoint=True``). Leaving the loop early aborts the request."""
        request = await self._submit(
            prompt, params, request_id, resume_from, priority, checkpoint, stream=True
        )
        assert request.stream is not None
        try:
            while True:
                delta = await request.stream.get()
                self._wakeup.set()  # a request paused on a full buffer may go on
                if delta is None:
                    break
                yield delta
            if request.error is not None:
                raise request.error
        finally:
            if not request.finished:
                self._abort(request)

    async def abort(self, request_id: str) -> None:
        """End a request; unknown or finished ids are a no-op."""
        request = self._requests.get(request_id)
        if request is not None:
            self._abort(request)

    async def checkpoint(self, request_id: str) -> bytes:
        """Capture a running request's sequence at the next step boundary (quiescent); the
        request continues. Resume with ``generate(..., resume_from=bytes)``.

        :raises UnknownRequestError: no such running or waiting request.
        """
        request = self._requests.get(request_id)
        if request is None or request.finished:
            raise UnknownRequestError(f"no running request {request_id!r}")
        future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        request.checkpoint_waiters.append(future)
        self._wakeup.set()
        return await future

    async def _submit(
        self,
        prompt: Prompt,
        params: SamplingParams | None,
        request_id: str | None,
        resume_from: bytes | None,
        priority: int,
        want_checkpoint: bool,
        stream: bool = False,
    ) -> Request:
        if self._closed or self._runtime is None:
            raise ClosedError("the engine is not running")
        params = params or SamplingParams()
        if len(self._waiting) >= self.config.max_queue:
            raise QueueFullError(
                f"the wait queue is full ({self.config.max_queue} requests)", reason="queue full"
            )
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._requests:
            raise InvalidArgumentError(f"request id {request_id!r} is in use", reason="duplicate id")
        tokens = await self._prompt_tokens(prompt, add_special=resume_from is None)
        resume = None
        history: list[int] = []
        n_prompt_history = 0
        n_past = 0
        if resume_from is not None:
            ck = unpack(resume_from, self._fingerprint)
            meta = ck.meta
            try:
                history = [int(t) for t in meta["history"]]
                last = int(meta["last"])
                n_prompt_history = int(meta["n_prompt"])
            except (KeyError, TypeError, ValueError):
                raise StateError("invalid checkpoint: missing sequence metadata", reason="meta") from None
            n_past = len(history)
            resume = (ck.sections["target"], ck.sections.get("draft", b""), ck.sections["spec"], meta)
            tokens = [last, *tokens]
        elif not tokens:
            raise InvalidArgumentError("the prompt is empty", reason="empty prompt")
        n_vocab = self.model.n_vocab
        bad = [t for t in tokens if not isinstance(t, int) or not 0 <= t < n_vocab]
        if bad:
            raise InvalidArgumentError(f"token id {bad[0]!r} outside [0, {n_vocab})", reason="bad token")
        if n_past + len(tokens) >= self.config.n_ctx:
            raise PromptTooLongError(
                f"prompt has {n_past + len(tokens)} tokens; a sequence holds {self.config.n_ctx}",
                size=n_past + len(tokens),
                maximum=self.config.n_ctx - 1,
            )
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(4), "little")
        request = Request(
            request_id, tokens, params, seed, priority, next(self._arrivals), resume, want_checkpoint
        )
        request.history = history
        request.n_prompt_history = n_prompt_history
        request.n_past = n_past
        request.to_prefill = list(tokens)
        request.metrics.arrival = time.perf_counter()
        request.metrics.prompt_tokens = len(tokens) - (1 if resume else 0)
        if stream:
            # bounded: a consumer that stops reading pauses its own request (see _schedule)
            request.stream = asyncio.Queue(maxsize=self.config.stream_buffer)
        self._requests[request_id] = request
        self._waiting.push(request)
        self.metrics.queue_depth = len(self._waiting)
        log.debug(
            "request.queued", request_id=request_id, prompt_tokens=len(tokens), resumed=resume is not None
        )
        self._wakeup.set()
        return request

    async def _prompt_tokens(self, prompt: Prompt, add_special: bool) -> list[int]:
        model = self.model
        if isinstance(prompt, str):
            return (
                await model.atokenize(prompt, add_special=add_special, parse_special=True) if prompt else []
            )
        items = list(prompt) if isinstance(prompt, list | tuple) else None
        if items and all(isinstance(m, dict) for m in items):
            text = await model.aapply_chat_template(items)
            return await model.atokenize(text, add_special=add_special, parse_special=True)
        ids = [t for t in items or () if isinstance(t, int) and not isinstance(t, bool)]
        if items is not None and len(ids) == len(items):
            return ids
        raise InvalidArgumentError(
            "prompt must be a string, a list of token ids or a list of chat messages", reason="bad prompt"
        )

    def _abort(self, request: Request) -> None:
        if request.finished:
            return
        request.aborted = True
        if request.state is RequestState.WAITING:
            self._waiting.remove(request)
            self._finish(request, FinishReason.ABORT.value)
        self._wakeup.set()  # a running request ends at the next boundary

    # --- the step loop -----------------------------------------------------------------
    async def _run(self) -> None:
        assert self._runtime is not None
        while True:
            plan = self._schedule()
            if plan.empty:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            try:
                result = await self._runtime.wait(self._runner.step_async(plan.native()))
            except SessionError as exc:  # the whole step failed: fail its requests, reset their slots
                log.error("engine.step_failed", error=str(exc))
                for r in {w.request.request_id: w.request for w in plan.work}.values():
                    self._fail(r, exc)
                continue
            self._postprocess(plan, result)

    def _schedule(self) -> Plan:
        plan = Plan()
        # boundary: checkpoints first, then finished/aborted slots are cleared and freed
        for slot, r in list(self._slots.owner.items()):
            if r.aborted and not r.finished:
                self._finish(r, FinishReason.ABORT.value)
            if r.last is not None and (r.checkpoint_waiters or r.final_pending is not None):
                plan.captures.append(r)
            elif r.finished:
                plan.clears.append(slot)
                self._slots.release(slot)
                r.slot = None
        while len(self._waiting) and self._slots.n_free:
            r = self._waiting.pop()
            r.slot = self._slots.allocate(r)
            r.state = RequestState.PREFILL
            plan.admitted.append(r)
            log.debug("request.admitted", request_id=r.request_id, slot=r.slot)
        self.metrics.queue_depth = len(self._waiting)
        # a stream whose consumer fell behind waits (its buffer keeps room for the next
        # delta plus the end marker); the other streams go on
        running = [
            r
            for r in self._slots.owner.values()
            if not r.finished and (r.stream is None or r.stream.qsize() <= r.stream.maxsize - 2)
        ]
        running.sort(key=lambda r: r.arrival_index)
        spec = self.config.spec
        plan.work = plan_step(
            running,
            n_batch=self.config.n_batch,
            n_draft_max=spec.n_draft_max,
            n_ctx=self.config.n_ctx,
            prefill_reserve=self.config.prefill_reserve,
            speculative=spec.type != "none",
            policy=self._policy,
            step=self.metrics.steps,
        )
        return plan

    def _postprocess(self, plan: Plan, result: Any) -> None:
        m = self.metrics
        m.steps += 1
        m.decode_calls += result.n_decode_calls
        m.draft_calls += result.n_draft_calls
        m.max_decode_calls_per_step = max(m.max_decode_calls_per_step, result.n_decode_calls)
        m.max_draft_calls_per_step = max(m.max_draft_calls_per_step, result.n_draft_calls)
        if result.n_decode_calls == 1:
            self._policy.observe_step(result.n_batch_tokens, result.t_decode_us)
        m.batch_tokens += result.n_batch_tokens
        if result.draft_error:
            m.draft_failures += 1
            log.warning("engine.draft_failed", error=result.draft_error)
        if result.n_isolated_failures:
            m.isolated_failures += result.n_isolated_failures
            log.warning("engine.batch_failed", batches=result.n_isolated_failures, failed=len(result.errors))
        m.occupancy_sum += len({w.request.slot for w in plan.work}) / self.config.n_seq
        m.last_step = {
            "decode_calls": result.n_decode_calls,
            "draft_calls": result.n_draft_calls,
            "batch_tokens": result.n_batch_tokens,
            "work": len(plan.work),
            "t_draft_us": result.t_draft_us,
            "t_decode_us": result.t_decode_us,
            "t_verify_us": result.t_verify_us,
            "t_total_us": result.t_total_us,
        }
        for cap in result.captures:
            r = self._slots.owner.get(cap.seq)
            if r is not None:
                self._deliver_checkpoint(r, cap)
        for err in result.errors:
            r = self._slots.owner.get(err.seq)
            if r is not None:
                cls = getattr(session_errors, err.kind, SessionError)
                self._fail(r, cls(err.message))
        by_slot = {w.request.slot: w for w in plan.work}
        for out in result.outputs:
            w = by_slot.get(out.seq)
            if w is None or w.request.finished:
                continue
            self._apply_output(w.request, w, out)
        if m.steps % 64 == 0:
            log.debug(
                "engine.step",
                steps=m.steps,
                occupancy=round(m.batch_occupancy, 3),
                queue=m.queue_depth,
                throughput=round(m.throughput, 1),
            )

    def _apply_output(self, r: Request, w: WorkItem, out: Any) -> None:
        n_tok = len(w.tokens)
        r.history.extend(w.tokens)
        del r.to_prefill[:n_tok]
        if not w.sample:  # a prompt chunk without output
            r.n_past = out.n_past
            return
        tokens: list[int] = list(out.tokens)
        pieces: list[bytes] = list(out.pieces)
        if r.state is RequestState.PREFILL:
            r.state = RequestState.DECODE
            if r.resume is None:
                r.n_prompt_history = len(r.history)
        # accepted drafts are in the KV cache: they join the history
        r.history.extend(tokens[:-1])
        r.n_past = out.n_past
        r.last = tokens[-1]
        r.metrics.drafted += out.drafted
        r.metrics.accepted += out.accepted
        r.metrics.decode_steps += 1
        m = self.metrics
        m.drafted += out.drafted
        m.accepted += out.accepted
        if len(m.accepted_per_position) < out.accepted:
            m.accepted_per_position.extend([0] * (out.accepted - len(m.accepted_per_position)))
        for i in range(out.accepted):
            m.accepted_per_position[i] += 1
        r.mark_first_token()
        new_ids: list[int] = []
        reason: str | None = None
        eog = self.model.is_eog
        for tok, piece in zip(tokens, pieces, strict=True):
            if (eog(tok) and not r.params.ignore_eos) or tok in r.params.stop_token_ids:
                reason = FinishReason.STOP.value
                break
            r.output_ids.append(tok)
            new_ids.append(tok)
            r.assembler.feed(piece)
            if r.assembler.stopped:
                reason = FinishReason.STOP.value
                break
            if len(r.output_ids) >= r.params.max_tokens:
                reason = FinishReason.LENGTH.value
                break
        m.generated_tokens += len(new_ids)
        r.metrics.completion_tokens = len(r.output_ids)
        if reason is None and r.n_past >= self.config.n_ctx - 1:
            reason = FinishReason.LENGTH.value  # the sequence's context is full
        if reason is None:
            r.push(Delta(r.assembler.take(), new_ids))
        else:
            self._finish(r, reason, new_ids)

    def _deliver_checkpoint(self, r: Request, cap: Any) -> None:
        meta = {
            "history": list(r.history),
            "last": r.last,
            "n_prompt": r.n_prompt_history,
            "request_id": r.request_id,
        }
        sections = {"target": cap.target, "spec": cap.spec}
        if self._session is not None and self._session.draft_context is not None:
            sections["draft"] = cap.draft
        data = pack(SequenceCheckpoint(self._fingerprint, sections, meta))
        waiters, r.checkpoint_waiters = r.checkpoint_waiters, []
        for f in waiters:
            if not f.done():
                f.set_result(data)
        if r.final_pending is not None:
            r.final_checkpoint = data
            reason, new_ids = r.final_pending
            r.final_pending = None
            self._complete(r, reason, new_ids)

    def _finish(self, r: Request, reason: str, new_ids: list[int] | None = None) -> None:
        if r.finished:
            return
        r.state = RequestState.FINISHED
        r.finish_reason = reason
        r.metrics.finish_reason = reason
        r.metrics.finished = time.perf_counter()
        if (
            r.want_checkpoint
            and reason in (FinishReason.STOP.value, FinishReason.LENGTH.value)
            and r.slot is not None
            and r.last is not None
        ):
            r.final_pending = (reason, list(new_ids or []))  # completed once captured
            self._wakeup.set()
            return
        self._complete(r, reason, new_ids)

    def _complete(self, r: Request, reason: str, new_ids: list[int] | None) -> None:
        waiters, r.checkpoint_waiters = r.checkpoint_waiters, []
        for f in waiters:
            if not f.done():
                f.set_exception(UnknownRequestError(f"request {r.request_id!r} ended before its checkpoint"))
        text = r.assembler.take(final=True)  # also completes r.assembler.text
        if r.stream is not None:
            r.push(Delta(text, list(new_ids or []), reason, r.output()))
        if r.stream is not None:
            r.stream.put_nowait(None)
        self._requests.pop(r.request_id, None)
        self.metrics.requests_finished += 1
        r.done.set()
        log.info("request.finished", request_id=r.request_id, **r.metrics.as_dict())

    def _fail(self, r: Request, exc: BaseException) -> None:
        if r.finished:
            return
        err = RequestError(f"request {r.request_id!r} failed: {exc}")
        err.__cause__ = exc
        r.error = err
        self._finish(r, FinishReason.ERROR.value)

    # --- introspection (tests, metrics) ------------------------------------------------
    def slots_in_use(self) -> int:
        return self.config.n_seq - self._slots.n_free

    async def kv_positions(self) -> list[int]:
        """Largest KV position per sequence (-1: empty), read at a quiescent point."""
        assert self._session is not None and self._runtime is not None
        ctx = self._session.target_context
        return await asyncio.to_thread(lambda: [ctx.seq_pos_max(s) for s in range(self.config.n_seq)])
