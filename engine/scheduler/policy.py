"""How much each sequence drafts: as many tokens as raise the step's throughput.

Every drafted token is one more row of the target batch that needs logits, and on a
compute-bound machine (a CPU, or a big batch on a GPU) such a row costs almost a full
token: on Gemma 3 270M its 262k-token output projection dominates. A step's worth is the
tokens it emits; its cost is its time. The policy therefore picks, for the whole batch at
once, the draft lengths that maximise

    expected emitted tokens / expected step time

where

- the step time comes from a :class:`StepCost` model measured on this machine: a short
  calibration at start (target decodes of 1, 2, 4, ... rows that need logits, and a prompt
  chunk) refined online from every step, plus the draft call's own time per drafted
  position, learned per drafter (an n-gram lookup costs nothing, a draft model a pass per
  position);
- the expected tokens come from :class:`DraftStats`: per draft position, how often a
  request's drafter produced a token there and how often the target accepted it, for the
  request itself and, as a prior that a fresh request inherits rather than pays for, for
  the whole engine (both weigh recent steps more; a position deeper than any measured is
  priced by how often one token followed another, so it gets tried where that pays).
  Only produced tokens take rows: a drafter that rarely matches but is right when it does
  is worth what its rows bring.

Drafting nothing for the whole batch is one of the choices: when drafts cannot pay for
their rows, a step costs exactly what it costs without speculation. A request whose
drafts stopped paying still probes with one token now and then (when a right draft could
pay at all), so it drafts again when its acceptance rises.

A drafter with a model of its own must also keep up with what the target decodes, and on
a small target that costs as much as the target itself. How depends on the drafter
(:class:`DrafterSync`): a draft model catches up lazily, decoding the history it skipped
right before it drafts, so a step that drafts nothing pays nothing; a hidden-state drafter
(EAGLE-3, DFlash, MTP) must read every batch as it is decoded, so :class:`DrafterGate`
stops feeding it when its drafts do not pay for that, and tries again later.

With per-sequence KV streams (``kv_unified=False``) llama.cpp decodes a step in one pass
only when every sequence has the same number of rows: there the policy chooses one draft
length for every decoding sequence (and the step trims every draft to the shortest).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .cost import StepCost

__all__ = ["DraftPolicy", "DraftStats", "DrafterGate", "DrafterSync"]


class DrafterSync(enum.Enum):
    """How a drafter keeps up with what the target decodes: the session's ``drafter_sync``
    (the extension decides it from the speculative type)."""

    NONE = "none"  #: n-gram drafters read the token history: nothing to decode
    CATCH_UP = "catch_up"  #: a draft model decodes the history it skipped when it drafts
    STREAM = "stream"  #: hidden-state drafters read every batch; one skipped is lost to them


@dataclass
class DraftStats:
    """Per draft position m = 1, 2, ...: how often a draft was requested there, how often the
    drafter produced a token there, how often the target accepted it. ``decay`` < 1 weighs
    recent steps more (1: plain counts)."""

    decay: float = 1.0
    requested: list[float] = field(default_factory=list)
    produced: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)
    #: per position m: requested there with a token produced / accepted at m - 1 (the
    #: cases in which a token at m could follow one at m - 1; 0 at m = 1)
    after_produced: list[float] = field(default_factory=list)
    after_accepted: list[float] = field(default_factory=list)
    version: int = 0  #: counts the verifications recorded

    def record(self, requested: int, produced: int, accepted: int) -> None:
        """One verification: ``requested`` draft positions, ``produced`` of them drafted,
        the first ``accepted`` of those accepted."""
        if requested <= 0:
            return
        self.version += 1
        n = max(requested, len(self.requested))
        for seq in (self.requested, self.produced, self.accepted, self.after_produced, self.after_accepted):
            seq.extend([0.0] * (n - len(seq)))
            if self.decay < 1.0:
                for i in range(n):
                    seq[i] *= self.decay
        for m in range(requested):
            self.requested[m] += 1.0
            self.produced[m] += m < produced
            self.accepted[m] += m < accepted
            if m:
                self.after_produced[m] += m <= produced
                self.after_accepted[m] += m <= accepted

    def rates(self, m: int, prior: tuple[float, float], weight: float) -> tuple[float, float]:
        """(P(a token is produced at position m), P(it is produced and accepted)), both given
        that position m is requested; ``prior`` is what a request with no history gets."""
        i = m - 1
        req = self.requested[i] if i < len(self.requested) else 0.0
        prod = self.produced[i] if i < len(self.produced) else 0.0
        acc = self.accepted[i] if i < len(self.accepted) else 0.0
        return (prod + weight * prior[0]) / (req + weight), (acc + weight * prior[1]) / (req + weight)

    def continuation(self, prior: tuple[float, float], weight: float) -> tuple[float, float]:
        """(P(a token is produced at m | one was at m - 1), P(it is accepted | the one at
        m - 1 was)), pooled over the positions m >= 2 requested; ``prior`` counts as
        ``weight`` cases."""
        return (
            (sum(self.produced[1:]) + weight * prior[0]) / (sum(self.after_produced) + weight),
            (sum(self.accepted[1:]) + weight * prior[1]) / (sum(self.after_accepted) + weight),
        )


#: the engine-wide (produced, accepted) rates at draft position 1 before anything was
#: measured (optimistic), and how many verifications they are worth
_FIRST, _FIRST_WEIGHT = (1.0, 0.6), 2.0


def _monotone(rates: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Per-position (produced, accepted) rates as a drafter makes them: a token at position
    m needs one at m - 1, so neither rate rises with m. Estimates can (deep positions are
    requested less often and lean on the prior): a running minimum."""
    out, prod, acc = [], 1.0, 1.0
    for p, a in rates:
        prod = min(prod, p)
        acc = min(acc, a, prod)
        out.append((prod, acc))
    return out


@dataclass
class Drafting:
    """One decoding sequence as the policy sees it."""

    stats: DraftStats  #: the request's own
    max_k: int  #: most drafts it may verify this step (context, max_tokens, batch room)
    probe: bool = False  #: draft one token even when it does not pay (its stats are stale)
    lag: int = 0  #: tokens a catching-up draft model decodes before it drafts for it


@dataclass
class DrafterGate:
    """Whether a stream drafter reads this step's batch (:attr:`DrafterSync.STREAM`).

    Open, every step weighs the policy's choice with the drafter's pass over the batch
    against a step without drafter; after ``patience`` steps in a row that lose, the gate
    closes (every sequence in a skipped batch drafts no more) and opens again
    ``backoff`` steps later for the requests that start then, the wait doubling each time
    it closes again soon. A batch with no sequence in sync is never fed."""

    patience: int = 8
    base_backoff: int = 256
    max_backoff: int = 16384
    open: bool = True
    strikes: int = 0
    paid: int = 0  #: steps in a row that paid
    backoff: int = 256
    retry_at: int = 0


@dataclass
class DraftPolicy:
    """Chooses every decoding sequence's draft length for one step (see the module)."""

    adaptive: bool = True
    uniform: bool = False  #: one length for every sequence (per-sequence KV streams)
    cost: StepCost = field(default_factory=StepCost)
    engine: DraftStats = field(default_factory=lambda: DraftStats(decay=0.995))
    prior_weight: float = 3.0  #: how many verifications the engine-wide prior is worth
    #: drafts from a drafter with a model of its own must beat drafting nothing by this much
    #: (the cost model is ~10 % accurate step to step: in the marginal region a guess is a
    #: coin toss, and a loss is what we avoid). An n-gram drafter costs nothing but the rows
    #: it fills, and there the model errs the other way: on Gemma 3 270M at 4 and 16
    #: streams, drafting every match (``fixed``) beat this policy in every interleaved
    #: comparison, so its margin only keeps drafts worth next to nothing (a drafter that
    #: never matches) from costing every step an optimisation
    margin: float = 0.05
    ngram_margin: float = 0.01
    #: an n-gram drafter (:attr:`DrafterSync.NONE`): every sequence asks for its longest
    #: draft while the engine's accepted-per-row pays (see :meth:`_every_match_pays`)
    every_match: bool = False
    #: steps between probes; doubles (up to ``max_probe_every``) with each probe rejected
    probe_every: int = 32
    base_probe_every: int = 32
    max_probe_every: int = 1024
    sync: DrafterSync = DrafterSync.NONE
    gate: DrafterGate = field(default_factory=DrafterGate)
    #: the last choice of :meth:`lengths`: (expected accepted, expected draft rows, longest
    #: draft, sequences drafting, catch-up tokens)
    chosen: tuple[float, float, int, int, int] = (0.0, 0.0, 0, 0, 0)
    probed: int | None = None  #: the sequence :meth:`lengths` made probe, by index
    k_cap: int = 0  #: the longest draft a sequence was allowed so far
    #: a choice of no drafts stands while no statistic changed (no draft was verified), for
    #: up to this many steps: the steps that draft nothing pay for no optimisation
    recheck_every: int = 8
    _idle: tuple[tuple[int, ...], int, int] | None = None  #: (stats, versions, steps)

    def prior(self, m: int) -> tuple[float, float]:
        """Engine-wide rates at position m (see :meth:`priors`)."""
        return self.priors(m)[m - 1]

    def priors(self, k: int) -> list[tuple[float, float]]:
        """Engine-wide rates at positions 1..k: what was measured there, and where little
        was, the rate at m - 1 times how often a token followed another (pooled over the
        positions measured). Optimistic before anything was measured: a position deeper
        than any drafted so far is priced by the decay seen up to it, not by a constant,
        or the policy would never try it (copying answers accept most deep positions)."""
        cont = self.engine.continuation((1.0, 0.9), 4.0)  # (a row at every position: the dear guess)
        out: list[tuple[float, float]] = []
        base = _FIRST
        for m in range(1, k + 1):
            rate = self.engine.rates(m, base, _FIRST_WEIGHT)
            out.append(rate)
            base = (rate[0] * cont[0], rate[1] * cont[1])
        return out

    def lengths(self, seqs: Sequence[Drafting]) -> list[int]:
        """Draft lengths for the decoding sequences of one step."""
        self.chosen, self.probed = (0.0, 0.0, 0, 0, 0), None
        if not seqs:
            return []
        self.k_cap = max(self.k_cap, *(s.max_k for s in seqs))
        if not self.adaptive:
            return [s.max_k for s in seqs]
        if self.sync is DrafterSync.STREAM and not self.gate.open:
            return [0] * len(seqs)
        n = len(seqs)
        if self.every_match and not self.uniform and self._every_match_pays(n):
            self._idle = None
            return [s.max_k for s in seqs]
        ids = tuple(id(s.stats) for s in seqs)
        versions = sum(s.stats.version for s in seqs) + self.engine.version
        if (
            self._idle is not None
            and self._idle[:2] == (ids, versions)
            and self._idle[2] < self.recheck_every
        ):
            self._idle = (ids, versions, self._idle[2] + 1)  # (longer catch-ups, shorter caps: still none)
            ks = [0] * n
        else:
            ks = self._optimise(seqs)
            self._idle = None if any(ks) else (ids, versions, 1)
        if self.uniform:
            return ks
        for i, (k, s) in enumerate(zip(ks, seqs, strict=True)):
            if s.probe and s.max_k > 0 and k == 0 and self._could_pay(n, s):
                ks[i], self.probed = 1, i
        return ks

    def _optimise(self, seqs: Sequence[Drafting]) -> list[int]:
        priors = self.priors(max(s.max_k for s in seqs))

        def rates(s: Drafting, m: int) -> tuple[float, float]:
            return s.stats.rates(m, priors[m - 1], self.prior_weight)

        if self.uniform:
            return self._uniform(seqs, rates)
        return self._best(seqs, [_monotone([rates(s, m) for m in range(1, s.max_k + 1)]) for s in seqs])

    def observe_probe(self, accepted: bool) -> None:
        """A probe's outcome: a rejected one waits twice as long for the next."""
        self.probe_every = (
            self.base_probe_every if accepted else min(2 * self.probe_every, self.max_probe_every)
        )

    def _every_match_pays(self, n: int) -> bool:
        """Whether an n-gram drafter's rows, accepted as often as they have been across the
        engine, beat the rate of a step of ``n`` sequences without drafts: then every
        sequence asks for its longest draft (asking costs nothing; a row appears only where
        the n-gram matches). Matches come in episodes, not per request: a request's own
        rates, after one rejected draft, kept it from asking when its next match came
        (Gemma 3 270M, mixed prompts, 4 streams: 76 % of drafts accepted against 88 % when
        every sequence asked; 1.28x off against 1.11x, medians of 3 interleaved repeats)."""
        e = self.engine
        accepted_per_row = (sum(e.accepted) + _FIRST_WEIGHT * _FIRST[1]) / (sum(e.produced) + _FIRST_WEIGHT)
        return accepted_per_row > self._row(n) * n / self.cost.target(n) * (1.0 + self.ngram_margin)

    def _row(self, n: int) -> float:
        """Seconds one more row adds to a step of ``n`` decoding sequences (the mean over
        as many again)."""
        return max((self.cost.target(2 * n) - self.cost.target(n)) / n, 1e-9)

    def _margin(self) -> float:
        return self.ngram_margin if self.sync is DrafterSync.NONE else self.margin

    def _value(self, gain: float, rows: float, k_max: int, n_drafting: int, n: int, lag: int = 0) -> float:
        """Expected tokens per second of a step of ``n`` decoding sequences whose drafts
        bring ``gain`` accepted tokens in ``rows`` rows (see :meth:`_step_cost`)."""
        return (n + gain) / self._step_cost(n)(rows, k_max, n_drafting, lag)

    def _could_pay(self, n: int, s: Drafting) -> bool:
        """Whether drafts for ``s`` alone, every one of them right, would beat none: a probe
        that could never pay is not made."""
        none = self._value(0.0, 0.0, 0, 0, n)
        return any(self._value(k, k, k, 1, n, s.lag) > none for k in range(1, s.max_k + 1))

    def _drafter_could_pay(self, n: int) -> bool:
        """Whether ``n`` decoding sequences, all drafting the same length and every draft
        right, would beat the same step without a drafter (its pass over the batch included)."""
        none = n / self.cost.target(n)
        return any(self._value(n * k, n * k, k, n, n) > none for k in range(1, self.k_cap + 1))

    def sync_step(self, step: int, n: int, prompt: int, any_in_sync: bool, drafting_in_sync: bool) -> bool:
        """Whether this step's batch goes to a stream drafter (always, for the others),
        after :meth:`lengths` chose the step's drafts: ``n`` decoding sequences, ``prompt``
        prompt tokens; ``any_in_sync``: a sequence in the batch (decoding or reading its
        prompt) can still draft; ``drafting_in_sync``: a decoding one can."""
        if self.sync is not DrafterSync.STREAM or not self.adaptive:
            return True
        g = self.gate
        if not g.open:
            if step < g.retry_at:
                return False
            if not self._drafter_could_pay(max(n, 1)):  # (not even with every draft right)
                g.retry_at = step + g.backoff
                return False
            g.open, g.strikes, g.paid = True, 0, 0  # (the requests that start now sync)
        if not any_in_sync:
            return False  # (nothing in it can draft: skipping it costs nothing)
        if n and drafting_in_sync:
            gain, rows, k_max, n_drafting, _ = self.chosen
            cost = self.cost
            with_drafter = (n + gain) / (
                cost.target(n + rows, prompt) + cost.draft(k_max, n_drafting) + cost.sync(n + rows + prompt)
            )
            if with_drafter >= n / cost.target(n, prompt):
                g.strikes, g.paid = 0, g.paid + 1
                if g.paid >= g.patience:
                    g.backoff = g.base_backoff
            else:
                g.strikes, g.paid = g.strikes + 1, 0
                if g.strikes >= g.patience:
                    g.open, g.retry_at = False, step + g.backoff
                    g.backoff = min(2 * g.backoff, g.max_backoff)
                    return False
        return True

    def _best(self, seqs: Sequence[Drafting], rates: list[list[tuple[float, float]]]) -> list[int]:
        # candidates (sequence, position), ranked by expected accepted tokens per second of
        # the rows they add (a row only where the drafter produces a token: an n-gram
        # drafter that rarely matches but is right when it does ranks high), a sequence's
        # positions in order (the running minimum of their ranks); a catching-up drafter's
        # first position also pays for the history it decodes first. The best prefix of
        # that ranking is the choice.
        n = len(seqs)
        row = self._row(n)
        cands = []
        for i, r in enumerate(rates):
            floor = math.inf
            for m, (prod, acc) in enumerate(r, start=1):
                entry = self.cost.sync(seqs[i].lag) if m == 1 else 0.0  # (lag: catching up only)
                floor = min(floor, acc / max(prod * row + entry, 1e-12))
                cands.append((floor, -m, i))
        cands.sort(reverse=True)
        step_cost = self._step_cost(n)
        best, best_at = n / step_cost(0.0, 0, 0, 0) * (1.0 + self._margin()), -1
        gain = rows = 0.0
        k_max = n_drafting = lag = 0
        for j, (_, neg_m, i) in enumerate(cands):
            m = -neg_m
            prod, acc = rates[i][m - 1]
            gain += acc
            rows += prod
            if m > k_max:
                k_max = m
            if m == 1:
                n_drafting += 1
                lag += seqs[i].lag
            value = (n + gain) / step_cost(rows, k_max, n_drafting, lag)
            if value > best:
                best, best_at = value, j
                self.chosen = (gain, rows, k_max, n_drafting, lag)
        ks = [0] * n
        for _, neg_m, i in cands[: best_at + 1]:
            ks[i] = -neg_m  # (a sequence's positions come in order)
        return ks

    def _step_cost(self, n: int) -> Callable[[float, int, int, int], float]:
        """``cost(rows, k_max, n_drafting, lag)``: seconds of a step of ``n`` decoding
        sequences with ``rows`` draft rows: the target decode (interpolated between whole
        rows), the draft call and the drafter keeping up. One closure, as the policy calls it
        for every candidate. (A prompt chunk in the same step costs the same with or without
        drafts, and its work is worth as much: it is left out, or drafts would look cheap.)"""
        cost = self.cost
        w0, w1, w2 = cost.draft_fit.weights()
        sync_fit, mode = cost.sync_fit, self.sync
        whole: dict[int, float] = {}  # (the target by whole rows, as needed)

        def at(r: int) -> float:
            y = whole.get(r)
            if y is None:
                y = whole[r] = cost.target(r)
            return y

        def step_cost(rows: float, k_max: int, n_drafting: int, lag: int) -> float:
            x = n + rows
            lo = int(x)
            y = at(lo)
            t = max(y + (at(lo + 1) - y) * (x - lo), 1e-9)
            if k_max:
                t += max(w0 + k_max * (w1 + w2 * n_drafting), 0.0)
            if mode is DrafterSync.STREAM:  # (paid while the gate is open, drafts or not)
                t += max(sync_fit(x), 0.0)
            elif lag and mode is DrafterSync.CATCH_UP:
                t += max(sync_fit(lag), 0.0)
            return t

        return step_cost

    def _uniform(
        self, seqs: Sequence[Drafting], rates: Callable[[Drafting, int], tuple[float, float]]
    ) -> list[int]:
        # every sequence gets k rows of drafts (drafts are trimmed to the shortest produced):
        # a sequence's position m counts only when every sequence produced a token there
        n, k_cap = len(seqs), min(s.max_k for s in seqs)
        best_k, best = 0, self._value(0.0, 0.0, 0, 0, n) * (1.0 + self._margin())
        gain = rows = 0.0
        lag = sum(s.lag for s in seqs)
        for m in range(1, k_cap + 1):  # (positions computed as needed: 64 sequences x 16 add up)
            at_m = [rates(s, m) for s in seqs]
            produced = [max(p, 1e-9) for p, _ in at_m]
            every = math.prod(produced)  # P(every sequence drafted position m)
            if n * every < 1e-6:
                break  # (later positions add nothing but draft time)
            gain += sum(acc * every / p for (_, acc), p in zip(at_m, produced, strict=True))
            rows += n * every
            value = self._value(gain, rows, m, n, n, lag)
            if value > best:
                best, best_k = value, m
                self.chosen = (gain, rows, m, n, lag)
        return [best_k] * n

    # --- learning ----------------------------------------------------------------------
    def observe_step(
        self,
        rows: int,
        prompt: int,
        t_decode_s: float,
        k_max: int,
        n_drafting: int,
        t_draft_s: float,
    ) -> None:
        self.cost.observe(rows, prompt, t_decode_s)
        self.cost.observe_draft(k_max, n_drafting, t_draft_s)

    def observe_sync(self, rows: int, seconds: float) -> None:
        """The drafter keeping up in one step: ``rows`` decoded in ``seconds``."""
        self.cost.observe_sync(rows, seconds)

    def observe_verification(self, stats: DraftStats, requested: int, produced: int, accepted: int) -> None:
        stats.record(requested, produced, accepted)
        self.engine.record(requested, produced, accepted)
