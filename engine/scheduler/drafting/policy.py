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
their rows, a step costs exactly what it costs without speculation. Every price is checked
against what the steps taken on it delivered (accepted tokens and seconds), and scaled by
that: estimates learned from the drafts the policy chose err on the drafts it did not. A request whose
drafts stopped paying still probes with one token now and then (when a right draft could
pay at all), so it drafts again when its acceptance rises. Where the drafter can draft in
shadow (ngram-simple), no probe is needed: a sequence that drafts nothing, or less than
its longest draft, drafts that in shadow now and then, checked against the tokens it emits,
so the rates measure every sequence and every position, not only those the policy chose.

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

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from .cost import StepCost
from .gate import DrafterGate
from .shadow import ShadowDrafts
from .stats import DrafterSync, DraftStats

if TYPE_CHECKING:
    from ..planner import WorkItem
    from ..request import Request

__all__ = ["DraftPolicy", "Drafts", "Tuning"]

Num = float | np.ndarray  #: a number or an array of them (elementwise)


#: the engine-wide (produced, accepted) rates at draft position 1 before anything was
#: measured (optimistic), and how many verifications they are worth
_FIRST, _FIRST_WEIGHT = (1.0, 0.6), 2.0
#: how much each step (or pricing) weighs against the last in :class:`_Realized`, and how many
#: steps predicted right its prior is worth
_REALIZED_DECAY, _REALIZED_PRIOR = 0.95, 2.0


def _prefixes(x: np.ndarray) -> np.ndarray:
    """Running sums of ``x``, after the empty one (0: no drafts)."""
    return np.concatenate(([0.0], np.cumsum(x)))


def _monotone(prod: np.ndarray, acc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-position (produced, accepted) rates, one row per sequence, as a drafter makes
    them: a token at position m needs one at m - 1, so neither rate rises with m. Estimates
    can (deep positions are requested less often and lean on the prior): a running minimum."""
    prod = np.minimum(np.minimum.accumulate(prod, axis=1), 1.0)
    return prod, np.minimum(np.minimum.accumulate(acc, axis=1), prod)


class _Price(NamedTuple):
    """Whether drafting every match pays, as priced (see :meth:`DraftPolicy._every_match_pays`)."""

    asked: int  #: :attr:`DraftPolicy.asked` when it was priced
    matched: int  #: of those, the ones in which the drafter produced a token
    rejected: int  #: and the ones in which the target rejected a drafted token
    pays: bool
    gain: float  #: expected accepted tokens of a step (before :class:`_Realized`)
    seconds: float  #: expected seconds of a step (before :class:`_Realized`)


@dataclass
class _Realized:
    """What the steps taken on a price brought against what it predicted: accepted tokens and
    seconds, as decayed sums. The engine's rates are learned from the drafts the policy chose,
    a selected sample; drafting every match applies them to every sequence, including those
    the choice would have left out, whose drafts are longer and accepted less. A price is
    scaled by what the steps it chose delivered; the evidence fades as it ages, so a price
    that stopped paying is tried again once the drafts may have changed."""

    accepted: float = 0.0
    gain: float = 0.0
    seconds: float = 0.0
    predicted: float = 0.0

    def add(self, accepted: float, gain: float, seconds: float, predicted: float) -> None:
        d = _REALIZED_DECAY
        self.accepted, self.gain = d * self.accepted + accepted, d * self.gain + gain
        self.seconds, self.predicted = d * self.seconds + seconds, d * self.predicted + predicted

    def age(self) -> None:
        """A pricing without a step: the evidence weighs a little less."""
        self.add(0.0, 0.0, 0.0, 0.0)

    def scale(self, gain: Any, seconds: Any) -> tuple[Any, Any]:
        """``gain`` and ``seconds`` as the steps taken realized them (a prior of
        ``_REALIZED_PRIOR`` steps predicted right)."""
        w, tiny = _REALIZED_PRIOR, 1e-12  # (nothing predicted: nothing to scale)
        return (
            gain * (self.accepted + w * gain + tiny) / (self.gain + w * gain + tiny),
            seconds * (self.seconds + w * seconds + tiny) / (self.predicted + w * seconds + tiny),
        )


@dataclass(slots=True)
class _Idle:
    """A choice of no drafts, standing (see :attr:`Tuning.recheck_every`)."""

    #: the engine's verifications in which the drafter produced a token, when it was
    #: searched: one that produced nothing (an n-gram probe without a match) adds no
    #: evidence that drafts would pay
    matched: int
    n: int  #: sequences decoding then
    steps: int  #: steps it has stood
    stands: int  #: steps it stands before it is searched again


@dataclass
class Drafting:
    """One decoding sequence as the policy sees it."""

    stats: DraftStats  #: the request's own
    max_k: int  #: most drafts it may verify this step (context, max_tokens, batch room)
    probe: bool = False  #: draft one token even when it does not pay (its stats are stale)
    lag: int = 0  #: tokens a catching-up draft model decodes before it drafts for it


class Drafts(NamedTuple):
    """A step's drafts (:meth:`DraftPolicy.choose`), by decoding request in order."""

    lengths: list[int]  #: drafts each verifies
    caps: list[int]  #: the most each could have verified
    probed: int | None  #: the one drafting only to see whether its drafts are right again
    shadows: list[int]  #: drafts each asks for in shadow (see :attr:`DraftPolicy.shadow`)


@dataclass(frozen=True)
class Tuning:
    """The policy's constants, in one place (tests change them; nothing else does)."""

    #: drafts must beat drafting nothing by this much, whatever the drafter: the cost
    #: model's price of a step of many rows is less sure than that (BENCHMARKS.md)
    margin: float = 0.05
    prior_weight: float = 3.0  #: how many verifications the engine-wide prior is worth
    #: steps between probes; doubles (up to ``max_probe_every``) with each probe rejected,
    #: not drafted (but by an n-gram drafter) or not worth making at its longest
    probe_every: int = 32
    max_probe_every: int = 1024
    #: steps a choice of no drafts stands while nothing it rests on changed (see
    #: :meth:`DraftPolicy.lengths`), doubling with each search in a row that again chooses none
    recheck_every: int = 8
    max_recheck_every: int = 128
    #: how many times longer the price of drafting every match stands while no n-gram has
    #: matched since it was computed (see :meth:`DraftPolicy._every_match_pays`)
    unmatched_life: int = 8


@dataclass
class DraftPolicy:
    """Chooses every decoding sequence's draft length for one step (see the module)."""

    adaptive: bool = True
    uniform: bool = False  #: one length for every sequence (per-sequence KV streams)
    cost: StepCost = field(default_factory=StepCost)
    engine: DraftStats = field(default_factory=lambda: DraftStats(decay=0.995))
    tuning: Tuning = Tuning()
    #: an n-gram drafter (:attr:`DrafterSync.NONE`): every sequence asks for its longest
    #: draft while the engine's accepted-per-row pays (see :meth:`_every_match_pays`)
    every_match: bool = False
    #: the drafter drafts in shadow (the session's ``can_shadow``: ngram-simple): a
    #: sequence that drafts nothing, or less than it could, asks it for its longest draft all
    #: the same (on one step in ``shadow.EVERY``), and nothing verifies what rows do not but
    #: the tokens the sequence emits next. Every sequence's stats and the engine's then
    #: measure what drafting every match would bring, at no cost in rows (probes measured
    #: one sequence every ``probe_every`` steps and paid for its rows), so a burst of drafts
    #: at the answers' starts does not price the rest of a run.
    shadow: bool = False
    probe_every: int = Tuning.probe_every  #: steps between probes now
    #: the step from which a probe is due; one stays due until a probe has an outcome, so
    #: that probes do not fall in step with requests of one length (a probe on a request's
    #: last token cannot pay, and one every 32 steps would land there on every request)
    next_probe: int = 0
    step: int = 0  #: the step being chosen
    _probe_turn: int = 0  #: the sequence probed next, by index
    #: an n-gram probe that found no match is asked again after the probe interval on
    #: average, at random: not in step with requests of one length, and no more often (each
    #: probe that matches costs its rows, which at many streams its drafts do not repay)
    _jitter: random.Random = field(default_factory=lambda: random.Random(0))
    sync: DrafterSync = DrafterSync.NONE
    gate: DrafterGate = field(default_factory=DrafterGate)
    #: the last choice of :meth:`lengths`: (expected accepted, expected draft rows, longest
    #: draft, sequences drafting, catch-up tokens)
    chosen: tuple[float, float, int, int, int] = (0.0, 0.0, 0, 0, 0)
    probed: int | None = None  #: the sequence :meth:`lengths` made probe, by index
    k_cap: int = 0  #: the longest draft a sequence was allowed so far
    #: decoding sequences' steps so far (drafting or not): a price's age is counted in them,
    #: not in verifications, which stop when nothing is drafted and would keep a price of
    #: no drafts for good
    asked: int = 0
    _idle: _Idle | None = None  #: the choice of none that stands
    _matching: dict[tuple[int, int], _Price] = field(default_factory=dict)  #: by (n, k)
    _realized: _Realized = field(default_factory=_Realized)  #: of drafting every match
    _realized_choice: _Realized = field(default_factory=_Realized)  #: of the per-sequence choice
    #: this step's drafts: whose choice they were, their expected accepted tokens and seconds
    _taken: tuple[_Realized, float, float] | None = None
    _log_ways: dict[int, np.ndarray] = field(default_factory=dict)  #: log C(n, j), j = 0..n
    _prior: tuple[int, int, np.ndarray] | None = None  #: (engine version, k, priors(k) as rows)
    _shadows: ShadowDrafts = field(default_factory=ShadowDrafts)

    @property
    def shadowing(self) -> bool:
        """Whether sequences that draft less than they could draft in shadow (see :attr:`shadow`)."""
        return self.shadow and self.adaptive and self.every_match and not self.uniform

    # --- what the scheduler calls: choose a step's drafts, feed the drafter, observe -------
    def choose(
        self, decoding: Sequence[Request], room: int, n_draft_max: int, n_ctx: int, step: int
    ) -> Drafts:
        """Draft lengths for the decoding requests of step ``step``, ``room`` draft rows
        fitting in its batch beside the prompts (shortest drafts kept first)."""
        n = len(decoding)
        self.step, probe = step, -1
        # (nothing drafts: no probe; shadow drafts measure every sequence: none needed)
        shut = self.sync is DrafterSync.STREAM and not self.gate.open
        if n and step >= self.next_probe and not shut and not self.shadowing:
            probe, self._probe_turn = self._probe_turn % n, self._probe_turn + 1
        if probe < 0 and self._none_stands(n):  # (most steps of an idle drafter: nothing to weigh)
            self._forget_choice()
            self.asked += n
            shadows = [0] * n
            if self.shadowing:
                shadows = self._shadows.asks(
                    decoding, shadows, lambda i: self._caps([decoding[i]], n_draft_max, n_ctx)[0], step
                )
            return Drafts([0] * n, [0] * n, None, shadows)
        caps = self._caps(decoding, n_draft_max, n_ctx)
        if self._every_match_stands(n, caps):  # (an n-gram drafter's steps while that pays)
            ks = list(caps)
        else:
            catch_up = self.sync is DrafterSync.CATCH_UP
            ks = self.lengths(
                [
                    Drafting(
                        r.draft_stats, cap, probe=i == probe, lag=r.n_past - r.drafter_upto if catch_up else 0
                    )
                    for i, (r, cap) in enumerate(zip(decoding, caps, strict=True))
                ]
            )
        if self.uniform and n:
            ks = [min(k, room // n) for k in ks]
        while sum(ks) > room:  # shorten the longest drafts first
            ks[max(range(n), key=lambda i: ks[i])] -= 1
        shadows = self._shadows.asks(decoding, ks, caps.__getitem__, step) if self.shadowing else [0] * n
        return Drafts(ks, caps, self.probed, shadows)

    @staticmethod
    def _caps(decoding: Sequence[Request], n_draft_max: int, n_ctx: int) -> list[int]:
        """The most drafts each request may verify this step."""
        return [
            # (the context keeps room for the drafts and the token sampled after them)
            max(0, min(n_draft_max, n_ctx - r.n_past - 2, r.params.max_tokens - len(r.output_ids) - 1))
            if r.drafter_in_sync
            else 0
            for r in decoding
        ]

    def tiles(self) -> tuple[int, int]:
        """(tile, from rows): how the native step pads a batch's rows with logits to whole
        tiles where drafts leave room (:attr:`StepCost.align`, calibrated; (1, 0): it does not)."""
        return self.cost.align, self.cost.align_from

    def feed_drafter(self, step: int, work: Sequence[WorkItem]) -> bool:
        """Whether this step's batch goes to the drafter (see :meth:`sync_step`)."""
        if self.sync is not DrafterSync.STREAM:
            return True  # (the other drafters are always fed)
        if self.gate.shut(step):
            return False  # (what the batch holds does not matter)
        decoding = [w for w in work if w.decoding]
        return self.sync_step(
            step,
            len(decoding),
            sum(len(w.tokens) for w in work) - len(decoding),
            any(w.request.drafter_in_sync for w in work),
            any(w.request.drafter_in_sync for w in decoding),
        )

    def observe(self, work: Sequence[WorkItem], result: Any, outputs: dict[Any, Any]) -> None:
        """A native step's result (``_nb_spec.StepResult``, its outputs by sequence): each
        verification, a probe's outcome, and what the step cost."""
        if self.shadowing:
            for request, asked_for, drafted, right, verified in self._shadows.check(work, outputs):
                self.observe_verification(request.draft_stats, asked_for, drafted, right, True, verified)
        asked = False
        for w in work:
            if w.n_draft == 0 or (out := outputs.get(w.request.slot)) is None:
                continue
            asked = True
            if w.probe and (out.produced or not self.every_match):
                # (a drafter that produced nothing has nothing right to show either)
                self.observe_probe(out.drafted > 0 and out.accepted > 0)
            elif w.probe:  # an n-gram probe without a match is no outcome: asked again later
                self.next_probe = self.step + self.probe_every // 2 + self._jitter.randrange(self.probe_every)
            stats = w.request.draft_stats
            if out.drafted < out.produced:  # the step dropped a partial tile: later positions unseen
                self.observe_verification(stats, out.drafted, out.drafted, out.accepted)
            else:  # (fillers past what the drafter produced may be accepted too: not its merit)
                self.observe_verification(stats, w.n_draft, out.produced, min(out.accepted, out.produced))
        if result.n_decode_calls != 1:  # (several: a batch over n_batch, or a retry)
            return
        t_decode = (result.t_decode_us - result.t_process_us) / 1e6
        if not asked and self._taken is None:  # (most steps of an idle drafter: a row a sequence)
            self.cost.observe(len(outputs), result.n_batch_tokens - len(outputs), t_decode)
        else:
            outs = outputs.values()
            rows = sum(1 + out.drafted for out in outs)  # the rows that needed logits
            produced = [out.produced for out in outs if out.produced]
            taken, self._taken = self._taken, None
            if taken is not None and result.n_batch_tokens == rows:  # (a prompt chunk: not priced)
                probes = {w.request.slot for w in work if w.probe}  # (not part of the choice)
                accepted = sum(min(out.accepted, out.produced) for out in outs if out.seq not in probes)
                t = (result.t_decode_us - result.t_process_us + result.t_draft_us) / 1e6
                realized, gain, seconds = taken
                realized.add(accepted, gain, t, seconds)
            self.observe_step(
                rows,
                result.n_batch_tokens - rows,
                t_decode,
                max(produced, default=0),
                len(produced),
                result.t_draft_us / 1e6,
            )
        if result.n_sync_tokens:
            self.observe_sync(result.n_sync_tokens, (result.t_process_us + result.t_catch_up_us) / 1e6)

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
        self._forget_choice()
        if not seqs:
            return []
        self.asked += len(seqs)
        self.k_cap = max(self.k_cap, *(s.max_k for s in seqs))
        if not self.adaptive:
            return [s.max_k for s in seqs]
        if self.sync is DrafterSync.STREAM and not self.gate.open:
            return [0] * len(seqs)
        n = len(seqs)
        # (priced at the longest draft allowed so far, not at this step's: a request's cap
        # shrinks by one each step near its end, and a price per cap would price most steps)
        if self.every_match and not self.uniform and self._every_match_pays(n, self.k_cap):
            self._ask_every_match(self._matching[n, self.k_cap])
            return [s.max_k for s in seqs]
        if self._idle_stands(n):
            ks = [0] * n
        else:
            idle = self._idle
            ks = self._optimise(seqs)
            t = self.tuning
            stands = t.recheck_every if idle is None else min(2 * idle.stands, t.max_recheck_every)
            self._idle = None if any(ks) else _Idle(self.engine.matched, n, 1, stands)
        if self.uniform:
            return ks
        for i, (k, s) in enumerate(zip(ks, seqs, strict=True)):
            if s.probe and s.max_k > 0 and k == 0:
                k = self._probe_length(n, s)
                if k:
                    ks[i], self.probed = k, i
                elif s.max_k >= self.k_cap:  # (one that could not pay waits as a rejected one does)
                    self.observe_probe(False)
                # (else its request ends within a draft's length: the probe stays due)
        return ks

    def _forget_choice(self) -> None:
        """No choice made yet this step: nothing chosen, probed or priced."""
        self.chosen, self.probed, self._taken = (0.0, 0.0, 0, 0, 0), None, None

    def _idle_stands(self, n: int) -> bool:
        """Whether the last choice of no drafts stands for this step of ``n`` decoding
        sequences (and counts the step): nothing it rested on changed but the catch-ups
        grown and the caps shrunk, which make drafts no better."""
        idle = self._idle
        if idle is None or idle.matched != self.engine.matched or n < idle.n or idle.steps >= idle.stands:
            return False
        idle.steps += 1
        return True

    def _every_match_stands(self, n: int, caps: list[int]) -> bool:
        """Whether this step asks every sequence for its longest draft on a price that stands
        (what :meth:`lengths` would choose, known without building its inputs); if so, it
        counts the step as that choice."""
        if not (self.adaptive and self.every_match and not self.uniform and n):
            return False
        k_cap = max(self.k_cap, *caps)
        known = self._matching.get((n, k_cap))
        if known is None or not known.pays or not self._price_stands(known, n, ahead=n):
            return False
        self._forget_choice()
        self.asked, self.k_cap = self.asked + n, k_cap
        self._ask_every_match(known)
        return True

    def _ask_every_match(self, price: _Price) -> None:
        """This step's choice is every sequence asking for its longest draft, on ``price``."""
        self._idle, self._taken = None, (self._realized, price.gain, price.seconds)

    def _none_stands(self, n: int) -> bool:
        """Whether this step's choice is no drafts, known without weighing a draft: the
        stream drafter's gate is closed, or no drafts stands (:meth:`_idle_stands`) and, for
        an n-gram drafter, drafting every match was priced not to pay and the price stands."""
        if not (self.adaptive and n):
            return False
        if self.sync is DrafterSync.STREAM and not self.gate.open:
            return True
        if self.every_match and not self.uniform:
            known = self._matching.get((n, self.k_cap))
            if known is None or known.pays or not self._price_stands(known, n):
                return False
        return self._idle_stands(n)

    def _optimise(self, seqs: Sequence[Drafting]) -> list[int]:
        # (runs on the event loop between two target decodes: the candidates are searched
        # with array operations, not a loop, which would cost a tiny model's step a tenth)
        if not any(s.max_k for s in seqs):
            return [0] * len(seqs)
        prod, acc = self._rates(seqs)
        if self.uniform:
            return self._uniform(seqs, prod, acc)
        return self._best(seqs, *_monotone(prod, acc))

    def _rates(self, seqs: Sequence[Drafting]) -> tuple[np.ndarray, np.ndarray]:
        """(P(produced), P(produced and accepted)) at positions 1..K for every sequence, as
        :meth:`DraftStats.rates` with the engine's priors: arrays of shape (sequences, K),
        K the longest ``max_k``."""
        k = max(s.max_k for s in seqs)
        prior = self._engine_rates(k)
        counts = np.stack([s.stats.counts(k) for s in seqs])
        w = self.tuning.prior_weight
        cases = counts[:, 0] + w
        return (counts[:, 1] + w * prior[0]) / cases, (counts[:, 2] + w * prior[1]) / cases

    def _engine_rates(self, k: int) -> np.ndarray:
        """:meth:`priors` at positions 1..k as a (2, k) array (produced, accepted), kept until
        the engine records its next verification."""
        if self._prior is None or self._prior[:2] != (self.engine.version, k):
            self._prior = (self.engine.version, k, np.array(self.priors(k)).T)
        return self._prior[2]

    def observe_probe(self, accepted: bool) -> None:
        """A probe's outcome: a rejected one waits twice as long for the next."""
        t = self.tuning
        self.probe_every = t.probe_every if accepted else min(2 * self.probe_every, t.max_probe_every)
        self.next_probe = self.step + self.probe_every

    def _every_match_pays(self, n: int, k: int) -> bool:
        """Whether ``n`` sequences that all ask an n-gram drafter for up to ``k`` tokens make
        more tokens per second than none do: every sequence then asks for its longest draft
        (asking costs nothing; rows appear only where the n-gram matches). Matches come in
        episodes, not per request: a request's own rates, after one rejected draft, kept it
        from asking when its next match came (BENCHMARKS.md, "Speculation: notes on the runs").

        Priced from the engine's drafts: how often a sequence's n-gram matches, how long a
        draft it then makes, how much of it is accepted; the step time is the measured curve
        averaged over how many sequences match at once (binomially). Not a price per row:
        where one row with logits costs far less than two, a long draft pays when a
        one-token one never could."""
        # (priced again once every sequence asked about 8 times since, and 32 times in all
        # at least: the engine's rates move little in that time, and pricing costs a fair
        # share of a tiny model's step. While no n-gram has matched since, the rates have
        # only decayed towards no match, and asking costs no rows: the price stands
        # ``unmatched_life`` times as long. Once the target rejected a draft since, the price
        # stands for one step: a drafter whose drafts turn bad pays rows for each step it
        # keeps asking.)
        e = self.engine
        known = self._matching.get((n, k))
        if known is not None and self._price_stands(known, n):
            return known.pays
        # (per position, given that it was asked for: a probe asks for one token, and its
        # match says nothing about how long the match would have been)
        prod, acc = (x[0] for x in _monotone(*self._engine_rates(k)[:, None, :]))
        match = min(max(float(prod[0]), 1e-9), 1.0 - 1e-9)
        length = min(float(prod.sum()) / match, float(k))  # (tokens per match)
        j = np.arange(n + 1)
        log_ways = self._log_ways.get(n)
        if log_ways is None:
            log_ways = self._log_ways[n] = np.array(
                [math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) for i in j]
            )
        p = np.exp(log_ways + j * math.log(match) + (n - j) * math.log1p(-match))  # (j sequences match)
        seconds = float(p @ self._costs(n, j * length, np.where(j > 0, k, 0), j, 0))
        gain = n * float(acc.sum())
        realized_gain, realized_seconds = self._realized.scale(gain, seconds)
        with_drafts = (n + realized_gain) / realized_seconds
        pays = bool(with_drafts > self._value(0.0, 0.0, 0, 0, n) * (1.0 + self.tuning.margin))
        self._matching[n, k] = _Price(self.asked, e.matched, e.rejected, pays, gain, seconds)
        if not pays:
            self._realized.age()
        return pays

    def _price_stands(self, known: _Price, n: int, ahead: int = 0) -> bool:
        """Whether a price of drafting every match for ``n`` sequences still stands (see
        :meth:`_every_match_pays`), ``ahead`` sequences' steps from now."""
        e = self.engine
        if e.rejected != known.rejected:
            life = n
        else:
            life = max(8 * n, 32) * (1 if e.matched != known.matched else self.tuning.unmatched_life)
        return self.asked + ahead - known.asked < life

    def _row(self, n: int) -> float:
        """Seconds one more row adds to a step of ``n`` decoding sequences (the mean over
        as many again)."""
        return max((self.cost.target(2 * n) - self.cost.target(n)) / n, 1e-9)

    def _value(self, gain: float, rows: float, k_max: int, n_drafting: int, n: int, lag: int = 0) -> float:
        """Expected tokens per second of a step of ``n`` decoding sequences whose drafts
        bring ``gain`` accepted tokens in ``rows`` rows (see :meth:`_costs`)."""
        return float(self._values(n, gain, rows, k_max, n_drafting, lag))

    def _values(self, n: int, gain: Num, rows: Num, k_max: Num, n_drafting: Num, lag: Num = 0) -> np.ndarray:
        """:meth:`_value` elementwise over arrays of choices."""
        out: np.ndarray = (n + np.asarray(gain, dtype=float)) / self._costs(n, rows, k_max, n_drafting, lag)
        return out

    def _probe_length(self, n: int, s: Drafting) -> int:
        """How long a probe for ``s`` drafts (0: a probe that could never pay is not made).
        An n-gram drafter asks for its longest draft, as every sequence does when drafting
        every match pays: asking costs only the rows of what it produces, and a shorter probe
        would leave unmeasured the deep positions that decide that price (one early rejected
        draft then kept a copying stream from drafting for good). A drafter that pays per
        position drafts the shortest length that, every token right, beats none by the margin."""
        k = np.arange(1, s.max_k + 1)
        none = self._value(0.0, 0.0, 0, 0, n)
        pays = self._values(n, k, k, k, 1, s.lag) > none * (1.0 + self.tuning.margin)
        if not pays.any():
            return 0
        return s.max_k if self.every_match else int(k[np.argmax(pays)])

    def _drafter_could_pay(self, n: int) -> bool:
        """Whether ``n`` decoding sequences, all drafting the same length and every draft
        right, would beat the same step without a drafter (its pass over the batch included)."""
        k = np.arange(1, self.k_cap + 1)
        return bool(np.any(self._values(n, n * k, n * k, k, n) > n / self.cost.target(n)))

    def sync_step(self, step: int, n: int, prompt: int, any_in_sync: bool, drafting_in_sync: bool) -> bool:
        """Whether this step's batch goes to a stream drafter (always, for the others),
        after :meth:`lengths` chose the step's drafts: ``n`` decoding sequences, ``prompt``
        prompt tokens; ``any_in_sync``: a sequence in the batch (decoding or reading its
        prompt) can still draft; ``drafting_in_sync``: a decoding one can."""
        if self.sync is not DrafterSync.STREAM or not self.adaptive:
            return True
        g = self.gate  # (once it opens again, the requests that start then sync)
        if not g.open and (g.shut(step) or not g.retry(step, self._drafter_could_pay(max(n, 1)))):
            return False
        if not any_in_sync:
            return False  # (nothing in it can draft: skipping it costs nothing)
        if n and drafting_in_sync:
            gain, rows, k_max, n_drafting, _ = self.chosen
            cost = self.cost
            with_drafter = (n + gain) / (
                cost.target(n + rows, prompt) + cost.draft(k_max, n_drafting) + cost.sync(n + rows + prompt)
            )
            return g.weigh(step, with_drafter >= n / cost.target(n, prompt))
        return True

    def _best(self, seqs: Sequence[Drafting], prod: np.ndarray, acc: np.ndarray) -> list[int]:
        # candidates (sequence, position), ranked by expected accepted tokens per second of
        # the rows they add (a row only where the drafter produces a token: an n-gram
        # drafter that rarely matches but is right when it does ranks high), a sequence's
        # positions in order (the running minimum of their ranks); a catching-up drafter's
        # first position also pays for the history it decodes first. The best prefix of
        # that ranking is the choice.
        n, k = prod.shape
        lags = np.array([s.lag for s in seqs], dtype=float)
        seq, pos = np.nonzero(np.arange(k) < np.array([s.max_k for s in seqs])[:, None])
        dear = prod * self._row(n)
        dear[:, 0] += self.cost.syncs(lags)  # (catching up)
        rank = np.minimum.accumulate(acc / np.maximum(dear, 1e-12), axis=1)
        order = np.lexsort((-seq, pos, -rank[seq, pos]))  # best first; ties: earlier positions
        seq, pos = seq[order], pos[order]
        first = pos == 0
        gain, rows = _prefixes(acc[seq, pos]), _prefixes(prod[seq, pos])
        k_max = np.concatenate(([0], np.maximum.accumulate(pos) + 1))
        n_drafting, lag = _prefixes(first), _prefixes(np.where(first, lags[seq], 0.0))
        j = self._pick_realized(n, gain, rows, k_max, n_drafting, lag)
        if not j:
            return [0] * n
        self.chosen = (float(gain[j]), float(rows[j]), int(k_max[j]), int(n_drafting[j]), int(lag[j]))
        return [int(c) for c in np.bincount(seq[:j], minlength=n)]  # (positions come in order)

    def _costs(self, n: int, rows: Num, k_max: Num, n_drafting: Num, lag: Num) -> np.ndarray:
        """Seconds of steps of ``n`` decoding sequences with ``rows`` draft rows, elementwise:
        the target decode (interpolated between whole rows), the draft call (``k_max``
        positions for ``n_drafting`` sequences) and the drafter keeping up (``lag`` tokens of
        history for a draft model). (A prompt chunk in the same step costs the same with or
        without drafts, and its work is worth as much: it is left out, or drafts would look
        cheap.)"""
        cost = self.cost
        x = n + np.asarray(rows, dtype=float)
        if x.size == 0:
            return x
        lo = np.floor(x).astype(np.intp)
        curve = cost.targets(n, int(lo.max()) + 1)
        y0, y1 = curve[lo - n], curve[lo - n + 1]
        t: np.ndarray = np.maximum(y0 + (y1 - y0) * (x - lo), 1e-9)
        t = t + cost.drafts(np.asarray(k_max), np.asarray(n_drafting))
        if self.sync is DrafterSync.STREAM:  # (paid while the gate is open, drafts or not)
            t = t + cost.syncs(x)
        elif self.sync is DrafterSync.CATCH_UP:
            t = t + cost.syncs(np.asarray(lag, dtype=float))
        return t

    def _pick_realized(
        self, n: int, gain: np.ndarray, rows: np.ndarray, k_max: np.ndarray, n_drafting: Num, lag: Num
    ) -> int:
        """:meth:`_pick` among choices (index 0: no drafts) of the per-sequence choice, each
        priced as the steps taken on such choices realized their prices (see
        :class:`_Realized`); the one taken is remembered for :meth:`observe`."""
        seconds = self._costs(n, rows, k_max, n_drafting, lag)
        realized_gain, realized_seconds = self._realized_choice.scale(gain, seconds)
        values = (n + realized_gain) / realized_seconds
        values[0] = n / seconds[0]
        j = self._pick(values)
        if j:
            self._taken = (self._realized_choice, float(gain[j]), float(seconds[j]))
        elif len(values) > 1:
            self._realized_choice.age()
        return j

    def _pick(self, values: np.ndarray) -> int:
        """Which of the choices ``values`` (expected tokens per second; ``values[0]``: no
        drafts) to take: the best, the first of equals, if it beats none by the margin; else 0."""
        j = int(np.argmax(values[1:])) + 1
        return j if values[j] > values[0] * (1.0 + self.tuning.margin) else 0

    def _uniform(self, seqs: Sequence[Drafting], prod: np.ndarray, acc: np.ndarray) -> list[int]:
        # every sequence gets k rows of drafts (drafts are trimmed to the shortest produced):
        # a sequence's position m counts only when every sequence produced a token there
        n, k = len(seqs), min(s.max_k for s in seqs)
        produced = np.maximum(prod[:, :k], 1e-9)
        every = np.prod(produced, axis=0)  # P(every sequence drafted position m)
        hopeless = np.flatnonzero(n * every < 1e-6)  # (from there on, nothing but draft time)
        k = int(hopeless[0]) if len(hopeless) else k
        if k == 0:
            return [0] * n
        gain = _prefixes(every[:k] * (acc[:, :k] / produced[:, :k]).sum(axis=0))
        rows, m, lag = n * _prefixes(every[:k]), np.arange(k + 1), sum(s.lag for s in seqs)
        j = self._pick_realized(n, gain, rows, m, n, np.where(m > 0, lag, 0))  # (j: the length)
        if j:
            self.chosen = (float(gain[j]), float(rows[j]), j, n, lag)
        return [j] * n

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

    def observe_verification(
        self,
        stats: DraftStats,
        requested: int,
        produced: int,
        accepted: int,
        shadow: bool = False,
        first: int = 0,
    ) -> None:
        stats.record(requested, produced, accepted, shadow, first)
        self.engine.record(requested, produced, accepted, shadow, first)
