"""Shadow drafts: drafts that no row verifies, checked against the tokens their sequences
emit next.

A drafter whose drafts depend on the token history alone (ngram-simple: the session's
``can_shadow``) can be asked for a draft by a sequence that drafts nothing: the lookup
costs microseconds and the batch gains no row. Checked against what the sequence emits,
such a draft measures what drafting every match would bring, on every sequence rather than
on those the policy chose to draft for. A sequence that drafts fewer tokens than it could
asks for its longest draft the same way: the rows verify its first tokens, and the rest is
checked as a shadow, so the deep positions keep being measured while the policy drafts
short (without it, a few bad drafts at a run's start kept a copying stream drafting five
tokens where sixteen paid). :class:`ShadowDrafts` decides which sequences ask and turns
their drafts into verifications for :class:`.DraftStats`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..planner import WorkItem
    from ..request import Request

__all__ = ["ShadowDrafts"]

#: a sequence drafts in shadow on one step in this many (its turn set by the step and its
#: slot, not by what its drafts found, so the samples stay unbiased): where n-grams rarely
#: match, the lookups and their bookkeeping cost a tiny model's step a few per cent each step
EVERY = 4


@dataclass(slots=True)
class _Pending:
    """A shadow draft waiting for the tokens its sequence emits."""

    request: Request
    tokens: list[int]
    requested: int
    verified: int  #: its first tokens that rows verify (recorded with the verification)
    seen: int = 0  #: how many of its first tokens the sequence emitted so far


@dataclass
class ShadowDrafts:
    """The shadow drafts in flight, at most one per slot."""

    _pending: dict[int, _Pending] = field(default_factory=dict)

    def asks(
        self, decoding: Sequence[Request], ks: Sequence[int], cap: Callable[[int], int], step: int
    ) -> list[int]:
        """Drafts each decoding request asks for in shadow at ``step``: its longest
        (``cap(i)``), where it drafts fewer (``ks``), no shadow draft of its own is pending
        and its turn has come."""
        asks = [0] * len(decoding)
        for i, (r, k) in enumerate(zip(decoding, ks, strict=True)):
            slot: int = r.slot  # type: ignore[assignment]
            if (step + slot) % EVERY or ((p := self._pending.get(slot)) and p.request is r):
                continue
            if (longest := cap(i)) > k:
                asks[i] = longest
        return asks

    def check(
        self, work: Sequence[WorkItem], outputs: dict[Any, Any]
    ) -> Iterator[tuple[Request, int, int, int, int]]:
        """This step's shadow drafts and the pending ones against the tokens their sequences
        emitted: each one settled, once a token differs or every token of it was emitted, as
        (request, requested, produced, accepted, verified: the first positions, recorded with
        the step's verification). One of a request that ends first is dropped."""
        for w in work:
            if not w.decoding or (out := outputs.get(w.request.slot)) is None:
                continue
            slot = out.seq
            pending = self._pending.get(slot)
            if w.shadow:
                if not out.shadow:  # (no n-gram matched)
                    yield w.request, w.shadow, 0, 0, w.n_draft
                    continue
                pending = self._pending[slot] = _Pending(w.request, list(out.shadow), w.shadow, w.n_draft)
            elif pending is None or pending.request is not w.request:
                continue
            draft, emitted, m = pending.tokens, out.tokens, 0
            while (
                m < len(emitted) and pending.seen + m < len(draft) and draft[pending.seen + m] == emitted[m]
            ):
                m += 1
            pending.seen += m
            if m < len(emitted) or pending.seen == len(draft):
                del self._pending[slot]
                yield w.request, pending.requested, len(draft), pending.seen, pending.verified
