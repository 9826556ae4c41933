"""What a step costs on this machine, measured at start (before the first request pays to
find out): target decodes by rows, a prompt chunk, and the drafter's own calls."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

from ...logs import get_logger
from ...session import Batch, Context, SessionError, SpeculativeSession
from .cost import StepCost
from .policy import DraftPolicy
from .stats import DrafterSync

__all__ = ["calibrate"]

log = get_logger(__name__)


def calibrate(
    policy: DraftPolicy, session: SpeculativeSession, n_seq: int, n_batch: int, uniform: bool
) -> None:
    """Measure the step cost ``policy`` weighs drafts with: the target's curve up to the
    largest step drafts can make (``n_seq`` sequences, each with its longest draft, within
    ``n_batch``; spread evenly when ``uniform``: per-sequence KV streams), then the
    drafter's calls when it has a model of its own."""
    max_rows = min(n_batch, n_seq * (1 + session.n_draft_max))
    policy.cost.calibrate(_target_timer(session.target_context, n_seq, uniform), max_rows)
    if policy.sync is not DrafterSync.NONE:
        _calibrate_drafter(session, policy.cost, policy.sync)


def _target_timer(ctx: Context, n_seq: int, uniform: bool) -> Callable[[int, int], float]:
    """``time(rows, prompt)``: seconds of one target decode with ``rows`` rows that need
    logits, spread over the sequences as the engine spreads them (evenly with per-sequence
    KV streams), or of a ``prompt``-token chunk ending in one such row; every sequence is
    emptied afterwards."""
    token = 1

    def time_decode(rows: int, prompt: int) -> float:
        b = Batch()
        if prompt:  # a prompt chunk whose last token needs logits
            b.add_sequence([token] * (prompt + rows), 0, 0, logits="last")
        else:
            n_used = min(rows, n_seq)
            for s in range(n_used):
                for i in range(-(-rows // n_used) if uniform else rows // n_used + (s < rows % n_used)):
                    b.add(token, i, s, True)
        try:
            t0 = time.perf_counter()
            ctx.decode(b)
            return time.perf_counter() - t0
        finally:
            for s in set(b.seq):  # (per-sequence streams cannot remove every sequence at once)
                ctx.kv_remove(s)

    return time_decode


def _calibrate_drafter(session: SpeculativeSession, cost: StepCost, sync: DrafterSync) -> None:
    """What the drafter costs on this machine, before the first request pays to find out:
    a draft call of one position and of ``n_draft_max`` for one sequence, and what keeping
    up with a 16-token prompt costs (a stream drafter's pass over it, a draft model's
    catch-up), each the best of two (the first run of a shape allocates). Sequence 0 is
    emptied afterwards; a failure only leaves the costs to be learned online."""
    token, n = 1, 16
    prompt = [token] * n
    batch = Batch()
    batch.add_sequence(prompt, 0, 0, logits="last")
    k_max = session.n_draft_max

    def draft(k: int) -> tuple[float, int]:
        """(seconds, tokens drafted) of one draft call of up to ``k`` positions."""
        t0 = time.perf_counter()
        (got,) = session.draft_many([(0, n, token, k)])
        seconds = time.perf_counter() - t0
        if got:
            session.accept(0, 0)
        return seconds, len(got)

    def empty() -> None:
        if session.pending(0) is not None:
            session.accept(0, 0)
        session.clear_target_kv_cache_seq(0)
        if session.draft_context is not None:
            session.clear_draft_kv_cache_seq(0)

    keep_up, first, one, most = [], [], [], []  # (per round)
    try:
        for _ in range(2):
            session.decode_target(batch)
            t0 = time.perf_counter()
            if sync is DrafterSync.STREAM:
                session.process(batch)
            keep_up.append(time.perf_counter() - t0)
            session.begin(0, prompt)
            first.append(draft(1)[0])  # (a draft model catches up on the prompt first)
            one.append(draft(1))
            most.append(draft(k_max))
            empty()
    except SessionError as e:
        log.warning("engine.drafter_calibration_failed", error=str(e))
        with contextlib.suppress(SessionError):
            empty()
        return
    (t1, k1), (tk, kk) = min(one), min(most)
    # a stream drafter's pass over the prompt, or a draft model's catch-up on it
    seconds = min(keep_up) if sync is DrafterSync.STREAM else max(min(first) - t1, 0.0)
    cost.observe_sync(n, seconds)
    for t, k in ((t1, k1), (tk, kk)):
        cost.observe_draft(k, 1, t)  # (k = 0, the drafter drafted nothing: no figure)
    log.debug("engine.drafter_calibrated", keep_up_s=seconds, draft_1_s=t1, draft_k_s=tk, k=kk)
