"""What a drafter got right, per draft position (:class:`DraftStats`), and how it keeps up
with the target (:class:`DrafterSync`): the draft policy's inputs, kept by each request and
by the engine."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

import numpy as np

__all__ = ["DraftStats", "DrafterSync"]


class DrafterSync(enum.Enum):
    """How a drafter keeps up with what the target decodes: the session's ``drafter_sync``
    (the extension decides it from the speculative type)."""

    NONE = "none"  #: n-gram drafters read the token history: nothing to decode
    CATCH_UP = "catch_up"  #: a draft model decodes the history it skipped when it drafts
    STREAM = "stream"  #: hidden-state drafters read every batch; one skipped is lost to them


#: DraftStats' series: a draft requested, produced, accepted at position m; requested
#: there with a token produced / accepted at m - 1 (the cases in which a token at m could
#: follow one at m - 1; 0 at m = 1)
_REQUESTED, _PRODUCED, _ACCEPTED, _AFTER_PRODUCED, _AFTER_ACCEPTED = range(5)


@dataclass
class DraftStats:
    """Per draft position m = 1, 2, ...: how often a draft was requested there, how often the
    drafter produced a token there, how often the target accepted it. ``decay`` < 1 weighs
    recent steps more (1: plain counts).

    Every decoding sequence records one verification per step, into its own stats and the
    engine's: a record costs O(1), not O(positions). A verification adds 1 to a run of
    positions of each series, so requested, produced and accepted are kept as differences
    between neighbouring positions (two entries per run) and expanded when read; of the
    other two only their sums over positions are read, so only those are kept. The decay
    scales what was recorded before, so it is kept as one factor for everything, each new
    record added in units of it."""

    decay: float = 1.0
    version: int = 0  #: counts the verifications recorded
    matched: int = 0  #: counts those in which the drafter produced a token
    rejected: int = 0  #: counts those in which the target rejected a drafted token (rows paid)
    _scale: float = field(default=1.0, repr=False)  #: a count is the stored value times this
    #: requested, produced, accepted: per position, the change from the position before
    _diffs: list[list[float]] = field(default_factory=lambda: [[0.0] for _ in range(3)], repr=False)
    _sums: list[float] = field(default_factory=lambda: [0.0] * 5, repr=False)  #: over positions
    _dense: tuple[int, list[list[float]]] | None = field(default=None, repr=False, compare=False)  #: _runs
    _counts: tuple[int, np.ndarray] | None = field(default=None, repr=False, compare=False)

    def record(
        self, requested: int, produced: int, accepted: int, shadow: bool = False, first: int = 0
    ) -> None:
        """One verification: ``requested`` draft positions, ``produced`` of them drafted,
        the first ``accepted`` of those accepted; ``shadow``: a draft checked against the
        tokens emitted after it, not verified (its rejection cost no rows). ``first``: the
        rest of a draft whose first positions a verification recorded already; only the
        positions after ``first`` count (not a verification of its own: no decay, and the
        match or rejection was counted with it)."""
        if requested <= first:
            return
        self.version += 1
        if self.decay < 1.0 and not first:
            self._scale *= self.decay
            if self._scale < 1e-100:  # (long before the stored values could overflow)
                self._rescale()
        diffs, sums, unit = self._diffs, self._sums, 1.0 / self._scale
        if len(diffs[0]) <= requested:
            for d in diffs:
                d.extend([0.0] * (requested + 1 - len(d)))
        if produced <= 0:  # (most records of an n-gram drafter asked without a match)
            d = diffs[_REQUESTED]
            d[first] += unit
            d[requested] -= unit
            sums[_REQUESTED] += unit * (requested - first)
            return
        produced, accepted = min(produced, requested), min(accepted, produced, requested)
        if not first:
            self.matched += 1
            if accepted < produced and not shadow:
                self.rejected += 1
        for series, upto in ((_REQUESTED, requested), (_PRODUCED, produced), (_ACCEPTED, accepted)):
            if upto > first:
                d = diffs[series]
                d[first] += unit
                d[upto] -= unit
                sums[series] += unit * (upto - first)
        # (positions 2.. up to one past the last produced / accepted token)
        after = max(first, 1)
        sums[_AFTER_PRODUCED] += unit * max(min(produced + 1, requested) - after, 0)
        sums[_AFTER_ACCEPTED] += unit * max(min(accepted + 1, requested) - after, 0)

    def _rescale(self) -> None:
        scale = self._scale
        self._diffs = [[x * scale for x in d] for d in self._diffs]
        self._sums = [x * scale for x in self._sums]
        self._scale = 1.0

    def _runs(self) -> list[list[float]]:
        """Requested, produced and accepted per position, in stored units (times
        ``_scale``: counts), expanded once per verification."""
        if self._dense is None or self._dense[0] != self.version:
            self._dense = (self.version, [list(itertools.accumulate(d[:-1])) for d in self._diffs])
        return self._dense[1]

    def count(self, series: int, m: int) -> float:
        """How often ``series`` (requested, produced, accepted) happened at position m."""
        runs = self._runs()[series]
        return max(runs[m - 1] * self._scale, 0.0) if m <= len(runs) else 0.0  # (rounding: -1e-16s)

    def total(self, series: int) -> float:
        """A series summed over every position."""
        return self._sums[series] * self._scale

    def counts(self, k: int) -> np.ndarray:
        """(requested, produced, accepted) at positions 1..k (0 where nothing was recorded),
        a (3, k) array, kept until the next verification (the policy reads it every step)."""
        if self._counts is None or self._counts[0] != self.version or self._counts[1].shape[1] != k:
            out = np.array([xs[:k] + [0.0] * (k - len(xs)) for xs in self._runs()])
            out *= self._scale
            self._counts = (self.version, np.maximum(out, 0.0, out=out))
        return self._counts[1]

    def rates(self, m: int, prior: tuple[float, float], weight: float) -> tuple[float, float]:
        """(P(a token is produced at position m), P(it is produced and accepted)), both given
        that position m is requested; ``prior`` is what a request with no history gets."""
        req = self.count(_REQUESTED, m) + weight
        return (
            (self.count(_PRODUCED, m) + weight * prior[0]) / req,
            (self.count(_ACCEPTED, m) + weight * prior[1]) / req,
        )

    def continuation(self, prior: tuple[float, float], weight: float) -> tuple[float, float]:
        """(P(a token is produced at m | one was at m - 1), P(it is accepted | the one at
        m - 1 was)), pooled over the positions m >= 2 requested; ``prior`` counts as
        ``weight`` cases."""
        deeper_produced = self.total(_PRODUCED) - self.count(_PRODUCED, 1)
        deeper_accepted = self.total(_ACCEPTED) - self.count(_ACCEPTED, 1)
        return (
            (max(deeper_produced, 0.0) + weight * prior[0]) / (self.total(_AFTER_PRODUCED) + weight),
            (max(deeper_accepted, 0.0) + weight * prior[1]) / (self.total(_AFTER_ACCEPTED) + weight),
        )
