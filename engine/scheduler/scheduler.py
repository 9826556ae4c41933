"""Scheduling: requests over ``n_seq`` sequence slots, and every state transition.

Two queues (waiting, and the slot table of requests holding a sequence) and two methods,
as in nano-vLLM: :meth:`Scheduler.schedule` plans the next step (boundary work, admission,
the target batch) and :meth:`Scheduler.update` applies its result (outputs through the pure
output path, captures, per-sequence errors). A request ends in one place,
:meth:`Scheduler.finish`, which hands its result to the caller.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..logs import get_logger
from ..session import InvalidArgumentError, SessionError
from ..session import errors as session_errors
from .checkpoints import pack_request
from .drafting import DrafterSync, DraftPolicy
from .errors import QueueFullError, RequestError
from .output import FinishReason, StopRules, process_output
from .params import EngineConfig
from .planner import Plan, SlotTable, WaitQueue, WorkItem, plan_step
from .request import Delta, Request, RequestMetrics, RequestState, Resume

__all__ = ["EngineMetrics", "Scheduler"]

log = get_logger("engine.scheduler")


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
    step_faults: int = 0  #: steps whose planning, native call or output handling raised
    occupancy_sum: float = 0.0  #: sum over steps of active sequences / n_seq
    step_seconds: float = 0.0  #: sum over steps of the native step's time
    #: sum over steps of the event loop's time planning the step and applying its result
    host_seconds: float = 0.0
    generated_tokens: int = 0
    drafted: int = 0
    accepted: int = 0  #: drafts kept (accepted by verification and before any stop)
    cut_tokens: int = 0  #: verified tokens dropped because a stop came before them
    accepted_per_position: list[int] = field(default_factory=list)
    prompt_tokens: int = 0  #: prompt tokens of the requests admitted
    cached_tokens: int = 0  #: of those, tokens a cached prefix saved from prefill
    prefix_hits: int = 0  #: requests that reused a cached prefix
    preemptions: int = 0  #: running requests swapped out for waiting ones
    swapped_bytes: int = 0  #: host memory held by swapped-out requests' state now
    queue_depth: int = 0
    finish_reasons: dict[str, int] = field(default_factory=dict)  #: requests ended, by reason
    started: float = field(default_factory=time.perf_counter)
    #: called with each request's metrics when it ends (e.g. a server's latency histograms);
    #: a listener that raises is logged and removed
    listeners: list[Callable[[RequestMetrics], None]] = field(default_factory=list, repr=False)

    @property
    def requests_finished(self) -> int:
        return sum(self.finish_reasons.values())

    def request_ended(self, metrics: RequestMetrics) -> None:
        reason = metrics.finish_reason or "abort"
        self.finish_reasons[reason] = self.finish_reasons.get(reason, 0) + 1
        for listener in list(self.listeners):
            try:
                listener(metrics)
            except Exception as exc:  # noqa: BLE001 - a metrics sink must not fail a request
                log.error("metrics.listener_failed", error=repr(exc))
                self.listeners.remove(listener)

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

    @property
    def prefix_hit_rate(self) -> float:
        """Share of admitted prompt tokens the prefix cache saved from prefill."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class Scheduler:
    """The requests of one engine and the slots they hold."""

    def __init__(
        self,
        config: EngineConfig,
        eog_tokens: Sequence[int],
        fingerprint: dict[str, Any],
        metrics: EngineMetrics,
        prefix_cache: bool = False,
        drafter_sync: DrafterSync = DrafterSync.NONE,
        shadow_drafts: bool = False,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.fingerprint = fingerprint
        self.requests: dict[str, Request] = {}
        self.slots = SlotTable(config.n_seq, prefix_cache=prefix_cache)
        self.waiting = WaitQueue()
        self._speculative = config.spec.type != "none"
        self.policy = DraftPolicy(
            adaptive=config.draft_policy == "adaptive",
            uniform=not config.unified_kv,
            sync=drafter_sync,
            every_match=drafter_sync is DrafterSync.NONE,
            shadow=shadow_drafts,
        )
        self._eog = tuple(eog_tokens)
        self._settles: dict[int, int] = {}  # slot -> drafts kept, settled at the next boundary
        self._to_clear: list[int] = []  # slots given back, cleared at the next boundary
        self._drops: list[int] = []  # parked samplers of requests that ended swapped out
        self._swap_per_token: float | None = None  # bytes of swapped state per token, as measured

    # --- requests ----------------------------------------------------------------------
    def check_admissible(self, request_id: str) -> None:
        """:raises QueueFullError, InvalidArgumentError: before any work is spent on it."""
        if len(self.waiting) >= self.config.max_queue:
            raise QueueFullError(
                f"the wait queue is full ({self.config.max_queue} requests)", reason="queue full"
            )
        if request_id in self.requests:
            raise InvalidArgumentError(f"request id {request_id!r} is in use", reason="duplicate id")

    def add(self, r: Request) -> None:
        self.check_admissible(r.request_id)
        r.metrics.arrival = time.perf_counter()
        self.requests[r.request_id] = r
        self.waiting.push(r)
        self.metrics.queue_depth = len(self.waiting)
        log.debug("request.queued", request_id=r.request_id, prompt_tokens=len(r.prompt_tokens))

    def finish(self, r: Request, reason: str, error: BaseException | None = None) -> None:
        """End a request in any state and hand its result (or error) to the caller; its slot
        is cleared at the next boundary."""
        if r.finished:
            return
        if r.state is RequestState.WAITING:
            self.waiting.remove(r)
            self.metrics.queue_depth = len(self.waiting)
        if r.parked is not None:  # preempted: its swapped state and parked sampler go
            self._drops.append(r.parked)  # (a no-op natively once a restore took it back)
            self._release_swap(r)
        if r.slot is not None:  # (a settle decided for it still applies before the clear)
            # its KV cache holds r.history (and perhaps a step's tokens after it): kept for
            # prefix reuse unless it failed or was restored from captured state
            keep = r.history if r.cacheable and reason != FinishReason.ERROR.value else ()
            if self.slots.release(r.slot, keep, r.drafter_in_sync):
                self._to_clear.append(r.slot)
            r.slot = None
        r.finish(reason, error)
        self.requests.pop(r.request_id, None)
        self.metrics.request_ended(r.metrics)
        log.info("request.finished", request_id=r.request_id, **r.metrics.as_dict())

    def fail(self, r: Request, exc: BaseException) -> None:
        """End ``r`` with a :class:`RequestError` caused by ``exc``."""
        err = RequestError(f"request {r.request_id!r} failed: {exc}")
        err.__cause__ = exc
        self.finish(r, FinishReason.ERROR.value, err)

    def end_all(self, error: BaseException | None = None) -> None:
        """Every request ends: with ``error`` (the engine died), else aborted (closing); one
        whose generation had ended keeps its reason, without its final checkpoint."""
        for r in list(self.requests.values()):
            if error is not None:
                self.finish(r, FinishReason.ERROR.value, error)
            elif r.state is RequestState.FINISHING and r.tail is not None and r.tail.finish_reason:
                self.finish(r, r.tail.finish_reason)
            else:
                self.finish(r, FinishReason.ABORT.value)

    # --- planning ----------------------------------------------------------------------
    def schedule(self) -> Plan:
        """The next step: boundary work for the slots, admissions, then the target batch."""
        plan = Plan()
        for r in self.slots.owner.values():
            if r.state is RequestState.FINISHING or (r.checkpoint_waiters and r.last is not None):
                plan.captures.append(r)
        self._preempt(plan)
        now = time.perf_counter()
        while len(self.waiting) and self.slots.n_free:
            r = self.waiting.pop()
            grant = self.slots.allocate(r, r.to_prefill if r.resume is None and r.cache_prompt else ())
            assert grant is not None
            r.slot = grant.slot
            r.state = RequestState.PREFILL
            r.held_since = now
            r.restored = r.restored or r.resume is not None
            if grant.keep:
                plan.reuses.append((grant.slot, r.to_prefill[: grant.keep]))
                r.drafter_in_sync = r.drafter_in_sync and grant.drafter_in_sync
                r.history = r.to_prefill[: grant.keep]
                del r.to_prefill[: grant.keep]
                r.metrics.cached_tokens = grant.keep
                self.metrics.prefix_hits += 1
                self.metrics.cached_tokens += grant.keep
            elif grant.cached:
                self._to_clear.append(grant.slot)  # evicted for a prompt it shares nothing with
            if not r.metrics.preemptions:
                self.metrics.prompt_tokens += r.metrics.prompt_tokens
            plan.admitted.append(r)
            log.debug("request.admitted", request_id=r.request_id, slot=r.slot, cached_tokens=grant.keep)
        self.metrics.queue_depth = len(self.waiting)
        # a stream whose consumer fell behind waits; the other streams go on
        running = [
            r
            for r in self.slots.owner.values()
            if r.state in (RequestState.PREFILL, RequestState.DECODE) and r.stream_has_room()
        ]
        running.sort(key=lambda r: r.arrival_index)
        spec = self.config.spec
        plan.work = plan_step(
            running,
            n_batch=self.config.n_batch,
            n_draft_max=spec.n_draft_max,
            n_ctx=self.config.n_ctx,
            prefill_reserve=self.config.prefill_reserve,
            speculative=self._speculative,
            policy=self.policy,
            step=self.metrics.steps,
        )
        plan.sync_drafter = self.policy.feed_drafter(self.metrics.steps, plan.work)
        plan.tiles = self.policy.tiles()
        # taken last: a planning fault leaves them for the next plan
        plan.settles = sorted(self._settles.items())
        self._settles.clear()
        plan.clears, self._to_clear = self._to_clear, []
        plan.drops, self._drops = self._drops, []
        return plan

    # --- preemption --------------------------------------------------------------------
    def _preempt(self, plan: Plan) -> None:
        """Free slots for waiting requests that outrank running ones: a higher priority, or
        an equal one once the running request has held its slot ``time_slice`` seconds. The
        victims (lowest priority, then longest held) are captured at this step's boundary,
        before the slot is given away, and wait again with their state in host memory."""
        cfg = self.config
        need = len(self.waiting) - self.slots.n_free
        if not cfg.preemption or need <= 0:
            return
        now = time.perf_counter()
        victims = sorted(
            (
                r
                for r in self.slots.owner.values()
                if r.state is RequestState.DECODE and r.last is not None and not r.checkpoint_waiters
            ),
            key=lambda r: (r.priority, r.held_since),
        )
        for w in self.waiting.first(need):
            for r in victims:
                timed_out = cfg.time_slice is not None and now - r.held_since >= cfg.time_slice
                if (r.priority < w.priority or (r.priority == w.priority and timed_out)) and self._swap_fits(
                    r
                ):
                    victims.remove(r)
                    self._swap_out(r, plan)
                    break

    def _swap_fits(self, r: Request) -> bool:
        """Whether ``r``'s state fits the swap space (estimated from earlier captures; the
        first capture is the measure)."""
        space = self.config.swap_space_mib * 2**20
        estimate = (self._swap_per_token or 0.0) * (len(r.history) + 1)
        return space > 0 and self.metrics.swapped_bytes + estimate <= space

    def _swap_out(self, r: Request, plan: Plan) -> None:
        assert r.slot is not None
        slot = r.slot
        r.parked = r.arrival_index  # unique per engine
        plan.preempted.append((slot, r))
        # the slot's KV cache holds r.history after the capture: a prefix another may reuse
        if self.slots.release(slot, r.history if r.cacheable else (), r.drafter_in_sync):
            self._to_clear.append(slot)
        r.slot = None
        r.state = RequestState.SWAPPING
        r.metrics.preemptions += 1
        self.metrics.preemptions += 1
        log.debug("request.preempted", request_id=r.request_id, slot=slot, held=len(r.history))

    def _release_swap(self, r: Request) -> None:
        """``r`` holds no swapped state any more (resumed, or ended while swapped out)."""
        self.metrics.swapped_bytes -= r.swap_bytes
        r.parked, r.swap_bytes, r.resume = None, 0, None

    def _swapped_in(self, r: Request, sections: dict[str, bytes]) -> None:
        """``r``'s captured state: it waits again, to resume from it."""
        assert r.last is not None
        r.resume = Resume(
            sections["target"],
            sections.get("draft", b""),
            sections["spec"],
            list(r.history),
            r.last,
            r.n_prompt_history,
        )
        r.swap_bytes = sum(len(b) for b in sections.values())
        self.metrics.swapped_bytes += r.swap_bytes
        self._swap_per_token = r.swap_bytes / (len(r.history) + 1)
        r.to_prefill = [r.last]
        r.state = RequestState.WAITING
        self.waiting.push(r)
        self.metrics.queue_depth = len(self.waiting)

    def redo_boundary(self, plan: Plan) -> None:
        """A step failed: the slots it was to clear may still hold their sequences, and what
        the cached ones hold is not known any more."""
        self._to_clear.extend(s for s in plan.clears if s not in self._to_clear)
        if self.slots.cache is not None:
            for slot in self.slots.cache.slots():
                if self.slots.forget(slot) and slot not in self._to_clear:
                    self._to_clear.append(slot)

    # --- applying a step's result ------------------------------------------------------
    def update(self, plan: Plan, result: Any) -> None:
        """Apply one native step's result: captures, errors, then each request's outputs.
        A fault while applying one request's part fails that request alone."""
        self._count(plan, result)
        outputs = {out.seq: out for out in result.outputs}  # (each read of it builds a new list)
        if self._speculative:  # (without a drafter there is nothing to learn)
            self.policy.observe(plan.work, result, outputs)
        preempted = dict(plan.preempted)
        for cap in result.captures:
            if (victim := preempted.pop(cap.seq, None)) is not None:
                if victim.state is RequestState.SWAPPING:  # (not aborted meanwhile)
                    self._isolated(victim, self._swapped_in, victim, cap.sections)
                continue
            r = self.slots.owner.get(cap.seq)
            if r is not None:
                self._isolated(r, self._deliver_checkpoint, r, cap.sections)
        for victim in preempted.values():  # its capture failed
            self.fail(victim, SessionError("the preempted request's state could not be captured"))
        for r in plan.admitted:
            if r.parked is not None and r.slot is not None:  # swapped in: its state is back
                self._release_swap(r)
        for err in result.errors:
            r = self.slots.owner.get(err.seq)
            if r is None and self.slots.forget(err.seq):  # a cached slot whose KV is gone
                self._to_clear.append(err.seq)
            if r is not None:
                cls = getattr(session_errors, err.kind, SessionError)
                self.fail(r, cls(err.message))
        for w in plan.work:
            r = w.request
            if r.slot is None or r.state not in (RequestState.PREFILL, RequestState.DECODE):
                continue  # ended while the step ran (aborted, failed): its tokens are dropped
            self._isolated(r, self._apply, w, outputs.get(r.slot))
        if self.metrics.steps % 64 == 0:
            m = self.metrics
            log.debug(
                "engine.step",
                steps=m.steps,
                occupancy=round(m.batch_occupancy, 3),
                queue=m.queue_depth,
                throughput=round(m.throughput, 1),
            )

    def fail_requests(self, requests: Iterable[Request], exc: BaseException) -> None:
        for r in list(requests):
            self.fail(r, exc)

    def _isolated(self, r: Request, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - a fault in one request's part fails it alone
            log.error("request.fault", request_id=r.request_id, error=repr(exc))
            self.metrics.step_faults += 1
            self.fail(r, exc)

    def _apply(self, w: WorkItem, out: Any) -> None:
        r = w.request
        r.history.extend(w.tokens)
        del r.to_prefill[: len(w.tokens)]
        if not w.sample:
            return  # a prompt chunk with more to come
        if out is None:
            raise SessionError("the step returned no output for a sampling work item")
        if r.state is RequestState.PREFILL:
            r.state = RequestState.DECODE
            if not r.restored:
                r.n_prompt_history = len(r.history)
        r.drafter_in_sync = r.drafter_in_sync and out.in_sync
        if w.n_draft > 0:
            r.drafter_upto = w.pos0  # (a draft model caught up to here before it drafted)
        outcome = process_output(r, out, StopRules.of(r.params, self._eog, self.config.n_ctx))
        if outcome.keep < len(out.tokens):
            assert r.slot is not None
            self._settles[r.slot] = outcome.keep - 1  # a stop inside accepted drafts
            self.metrics.cut_tokens += len(out.tokens) - outcome.keep
        kept_drafts = outcome.keep - 1
        m = self.metrics
        r.metrics.drafted += out.drafted
        r.metrics.accepted += kept_drafts
        r.metrics.decode_steps += 1
        r.metrics.completion_tokens = len(r.output_ids)
        r.mark_first_token()
        m.drafted += out.drafted
        m.accepted += kept_drafts
        m.generated_tokens += len(outcome.token_ids)
        if len(m.accepted_per_position) < kept_drafts:
            m.accepted_per_position.extend([0] * (kept_drafts - len(m.accepted_per_position)))
        for i in range(kept_drafts):
            m.accepted_per_position[i] += 1
        if outcome.logprobs is not None and r.output_logprobs is not None:
            r.output_logprobs.extend(outcome.logprobs)
        delta = Delta(outcome.text, outcome.token_ids, outcome.finish_reason, logprobs=outcome.logprobs)
        if outcome.finish_reason is None:
            r.push(delta)
        elif r.want_checkpoint and outcome.finish_reason != FinishReason.ERROR.value:
            r.state = RequestState.FINISHING  # the result waits for the final capture
            r.tail = delta
        else:
            r.tail = delta
            self.finish(r, outcome.finish_reason)

    def _deliver_checkpoint(self, r: Request, sections: dict[str, bytes]) -> None:
        data = pack_request(self.fingerprint, sections, r)
        for waiter in r.checkpoint_waiters:
            waiter.resolve(data)
        r.checkpoint_waiters.clear()
        if r.state is RequestState.FINISHING:
            assert r.tail is not None and r.tail.finish_reason is not None
            r.final_checkpoint = data
            self.finish(r, r.tail.finish_reason)

    def _count(self, plan: Plan, result: Any) -> None:
        m = self.metrics
        m.steps += 1
        m.decode_calls += result.n_decode_calls
        m.draft_calls += result.n_draft_calls
        m.max_decode_calls_per_step = max(m.max_decode_calls_per_step, result.n_decode_calls)
        m.max_draft_calls_per_step = max(m.max_draft_calls_per_step, result.n_draft_calls)
        m.batch_tokens += result.n_batch_tokens
        m.step_seconds += result.t_total_us / 1e6
        if result.draft_error:
            m.draft_failures += 1
            log.warning("engine.draft_failed", error=result.draft_error)
        if result.n_isolated_failures:
            m.isolated_failures += result.n_isolated_failures
            log.warning("engine.batch_failed", batches=result.n_isolated_failures, failed=len(result.errors))
        m.occupancy_sum += len({w.request.slot for w in plan.work}) / self.config.n_seq
