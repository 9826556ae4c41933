"""Whether a drafter that must read every batch (:attr:`DrafterSync.STREAM`: EAGLE-3, DFlash,
MTP) reads this step's.

Such a drafter pays its pass over the batch whether it drafts or not, and on a small target
that costs as much as the target's own decode. The policy weighs each step fed with it
(:meth:`~.policy.DraftPolicy.sync_step`); the gate turns those verdicts into when to stop
feeding it and when to try again.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BACKOFF", "MAX_BACKOFF", "PATIENCE", "DrafterGate"]

PATIENCE = 8  #: losing steps in a row before the gate closes (and paying ones before it forgives)
BACKOFF = 256  #: steps a closed gate waits before it opens again, at first
MAX_BACKOFF = 16384  #: the longest wait: it doubles each time the gate closes again soon


@dataclass
class DrafterGate:
    """Open, every step fed with the drafter is weighed against a step without it; after
    :data:`PATIENCE` steps in a row that lose, the gate closes (every sequence in a skipped
    batch drafts no more) and opens again ``backoff`` steps later for the requests that
    start then, the wait doubling each time it closes again soon.

    A request whose drafter missed a batch does not resume when the gate opens again: the
    target's hidden states of the skipped tokens are gone, re-deriving them costs a prompt
    pass over the window, and the drafter's cache cannot take a gap in a sequence's
    positions. The gate closes only when drafting does not pay for the batch, so such
    requests rarely had drafts worth resuming (BENCHMARKS.md, "Stream drafters")."""

    open: bool = True
    strikes: int = 0  #: steps in a row that lost
    paid: int = 0  #: steps in a row that paid
    backoff: int = BACKOFF
    retry_at: int = 0

    def shut(self, step: int) -> bool:
        """Closed, and not yet time to try again at ``step``."""
        return not self.open and step < self.retry_at

    def retry(self, step: int, could_pay: bool) -> bool:
        """A closed gate's time to try again: it opens if drafts ``could_pay`` at all (every
        one right), and otherwise waits its backoff once more. Whether it opened."""
        if could_pay:
            self.open, self.strikes, self.paid = True, 0, 0
        else:
            self.retry_at = step + self.backoff
        return could_pay

    def weigh(self, step: int, paid: bool) -> bool:
        """A step fed with the drafter, and whether that ``paid``: whether the gate stays open."""
        if paid:
            self.strikes, self.paid = 0, self.paid + 1
            if self.paid >= PATIENCE:  # (paying a while: a later closing starts from the first wait)
                self.backoff = BACKOFF
            return True
        self.strikes, self.paid = self.strikes + 1, 0
        if self.strikes < PATIENCE:
            return True
        self.open, self.retry_at = False, step + self.backoff
        self.backoff = min(2 * self.backoff, MAX_BACKOFF)
        return False
