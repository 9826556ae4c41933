"""The step planner: which sequences do what in the next step. Pure logic, plain data."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from .drafting import DraftPolicy
from .prefix import PrefixCache
from .request import Request, RequestState

__all__ = ["Grant", "Plan", "SlotTable", "WaitQueue", "WorkItem", "plan_step"]


class Grant(NamedTuple):
    """A slot given to a request."""

    slot: int
    keep: int  #: tokens of the request's prompt the slot's KV cache already holds
    cached: bool  #: the slot held a cached sequence (cut back to ``keep``, or cleared when 0)
    #: the drafter holds the kept prefix (a stream drafter fed nothing while the gate was
    #: closed: a request reusing what it missed cannot draft)
    drafter_in_sync: bool = True


class SlotTable:
    """The ``n_seq`` sequence ids: held by a request, cached (idle, holding the sequence of
    a request that ended, for prefix reuse) or empty."""

    def __init__(self, n_seq: int, prefix_cache: bool = False) -> None:
        self._free = list(range(n_seq))  # a heap: the lowest empty id first
        self.n_seq = n_seq
        self.owner: dict[int, Request] = {}
        self.cache = PrefixCache() if prefix_cache else None
        self._out_of_sync: set[int] = set()  # cached slots whose drafter missed some of them

    def allocate(self, request: Request, prompt: Sequence[int] = ()) -> Grant | None:
        """A slot for ``request``: the cached one holding the longest prefix of ``prompt``
        when it saves enough, else an empty one, else the least recently used cached one."""
        taken = self.cache.take(prompt, have_empty=bool(self._free)) if self.cache is not None else None
        if taken is not None:
            in_sync = taken[0] not in self._out_of_sync or not taken[1]  # (kept nothing: cleared)
            self._out_of_sync.discard(taken[0])
            grant = Grant(taken[0], taken[1], True, in_sync)
        elif self._free:
            grant = Grant(heapq.heappop(self._free), 0, False)
        else:
            return None
        self.owner[grant.slot] = request
        return grant

    def release(self, slot: int, holds: Sequence[int] = (), drafter_in_sync: bool = True) -> bool:
        """Give ``slot`` back. With ``holds`` (the tokens its KV cache holds) and prefix reuse
        on, it stays cached; else it is empty. Returns whether it must be cleared."""
        del self.owner[slot]
        if holds and self.cache is not None:
            self.cache.put(slot, holds)
            if not drafter_in_sync:
                self._out_of_sync.add(slot)
            return False
        heapq.heappush(self._free, slot)
        return True

    def forget(self, slot: int) -> bool:
        """A cached slot must not be reused (its KV may be gone): it is empty from now on.
        Returns whether it was cached (and must be cleared)."""
        if self.cache is None or slot not in self.cache:
            return False
        self.cache.pop(slot)
        self._out_of_sync.discard(slot)
        heapq.heappush(self._free, slot)
        return True

    @property
    def n_free(self) -> int:
        """Slots a request can have now: empty and cached ones."""
        return len(self._free) + (len(self.cache) if self.cache is not None else 0)


class WaitQueue:
    """FIFO admission; a higher ``priority`` goes first, the order of entry breaks ties (a
    preempted request enters again at the back of its priority)."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, Request]] = []
        self._entries = itertools.count()

    def push(self, request: Request) -> None:
        heapq.heappush(self._heap, (-request.priority, next(self._entries), request))

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[2]

    def first(self, n: int) -> list[Request]:
        """The ``n`` requests that would be popped next, in order."""
        return [e[2] for e in heapq.nsmallest(n, self._heap)]

    def remove(self, request: Request) -> bool:
        for i, entry in enumerate(self._heap):
            if entry[2] is request:
                self._heap.pop(i)
                heapq.heapify(self._heap)
                return True
        return False

    def __len__(self) -> int:
        return len(self._heap)


@dataclass
class WorkItem:
    """One sequence's part of the target batch."""

    request: Request
    tokens: list[int]  #: a prompt chunk, or [last sampled token]
    pos0: int  #: position of tokens[0]
    sample: bool  #: sample after the last token (a decode entry or a prompt's last chunk)
    n_draft: int  #: drafts it may verify this step
    begin: bool  #: the prompt's last chunk: the drafter begins its generation
    max_draft: int = 0  #: draft rows it could take (fillers that align the batch included)
    probe: bool = False  #: it drafts only to see whether its drafts are right again
    shadow: int = 0  #: drafts it asks for but does not verify (see DraftPolicy.shadow)

    @property
    def decoding(self) -> bool:
        """One verification of a generating sequence (not a prompt chunk)."""
        return self.sample and not self.begin


@dataclass
class Plan:
    """One step: boundary work first (settles, captures, clears, prefix reuses, restores,
    samplers), then the work. Plain data (:func:`.native.step_plan` hands it to the extension)."""

    #: (slot, drafts kept) for sequences whose last verification ended inside its drafts
    settles: list[tuple[int, int]] = field(default_factory=list)
    captures: list[Request] = field(default_factory=list)
    clears: list[int] = field(default_factory=list)
    #: (slot, prefix): a cached slot cut back to the prefix a new request shares
    reuses: list[tuple[int, list[int]]] = field(default_factory=list)
    #: (slot, request): preempted; its sequence is captured and its sampler parked first
    preempted: list[tuple[int, Request]] = field(default_factory=list)
    #: parked samplers of requests that ended while swapped out
    drops: list[int] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)
    work: list[WorkItem] = field(default_factory=list)
    sync_drafter: bool = True  #: a stream drafter reads this step's batch (see DrafterGate)
    #: (tile, from rows): the native step pads a batch of at least ``from rows`` rows with
    #: logits to whole tiles of rows with fillers, where its drafts leave room (see StepCost)
    tiles: tuple[int, int] = (1, 0)

    @property
    def empty(self) -> bool:
        return not (
            self.settles
            or self.captures
            or self.clears
            or self.reuses
            or self.preempted
            or self.drops
            or self.admitted
            or self.work
        )

    def requests(self) -> list[Request]:
        """Every request this step touches."""
        preempted = (r for _, r in self.preempted)
        touched = {
            id(r): r for r in (*self.captures, *preempted, *self.admitted, *(w.request for w in self.work))
        }
        return list(touched.values())


def plan_step(
    running: list[Request],
    *,
    n_batch: int,
    n_draft_max: int,
    n_ctx: int,
    prefill_reserve: int,
    speculative: bool,
    policy: DraftPolicy | None = None,
    step: int = 0,
) -> list[WorkItem]:
    """Work for the running requests, within one target batch of ``n_batch`` tokens.

    Decoding sequences come first (one verification each: ``[last, drafts...]``), prompt
    chunks fill what is left, shortest remaining prompt first, so a long prompt never stalls
    the streams that are running nor the prompts that are almost read;
    while prompts wait, ``prefill_reserve`` tokens stay free for them (fewer drafts). The
    policy chooses the draft lengths of all decoding sequences together (all of
    ``n_draft_max`` without one); one sequence probes now and then.
    """
    policy = policy or DraftPolicy(adaptive=False)
    decoding = [r for r in running if r.state is RequestState.DECODE]
    # the shortest prompt left first: a request whose prompt is mostly cached (a few tokens
    # to read) is not held up behind long cold prompts; ties in arrival order
    prefilling = sorted(
        (r for r in running if r.state is RequestState.PREFILL and r.to_prefill),
        key=lambda r: len(r.to_prefill),
    )
    reserve = min(prefill_reserve, n_batch // 2) if prefilling else 0
    n_dec = min(len(decoding), n_batch)
    decoding = decoding[:n_dec]
    ks = caps = shadows = [0] * n_dec
    probed = None
    if speculative and n_dec:
        room = max(0, n_batch - reserve - n_dec)  # draft rows that fit beside the prompts
        ks, caps, probed, shadows = policy.choose(decoding, room, n_draft_max, n_ctx, step)
    work = [
        WorkItem(r, [r.last], r.n_past, True, k, False, cap, probe=i == probed, shadow=sh)  # type: ignore[list-item]
        for i, (r, k, cap, sh) in enumerate(zip(decoding, ks, caps, shadows, strict=True))
    ]
    budget = n_batch - n_dec - sum(ks)
    for r in prefilling:
        if budget <= 0:
            break
        chunk = r.to_prefill[:budget]
        final = len(chunk) == len(r.to_prefill)
        work.append(WorkItem(r, chunk, r.n_past, final, 0, final))
        budget -= len(chunk)
    return work
