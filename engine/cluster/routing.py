"""Which replica serves a request.

``prefix``: a conversation's turns go to the replica that served its prefix. The
templating happens inside the replica, so the index is over the request's text (the
prompt, or the messages' contents in order): :class:`PrefixIndex` keeps, for prefixes of
whole blocks of that text, the replica that last served one, and :class:`PrefixRouter`
(a Ray Serve request router) prefers it unless its slots are full and it is much busier
than the least busy replica. ``session``: Ray's consistent hashing on the ``x-session-id`` header. ``pow2``:
Ray's default, power of two choices.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import LocalityMixin, MultiplexMixin, RequestRouter

__all__ = ["ROUTERS", "PrefixIndex", "PrefixRouter", "ReplicaRequest", "prefer", "routing_text"]

#: the routers ``--router`` names: Ray Serve request router classes (None: Ray's default)
ROUTERS: dict[str, str | None] = {
    "prefix": "engine.cluster.routing.PrefixRouter",
    "session": "ray.serve.experimental.consistent_hash_router.ConsistentHashRouter",
    "pow2": None,
}


@dataclass(frozen=True)
class ReplicaRequest:
    """What the ingress hands a replica: the validated body, and the text routers index."""

    body: Any  #: a ``protocol.CompletionRequest`` or ``ChatRequest``
    routing_text: str = ""


#: between the messages of a chat request's routing text: each message's end is a cut
#: point of the index (a conversation's next turn extends its last turn by whole messages)
MESSAGE_END = "\x1e"


def routing_text(body: Any) -> str:
    """The text a request's prefix is matched on: its prompt(s), or its messages' contents
    in order (their roles and the template's markup are the same for every request)."""
    messages = getattr(body, "messages", None)
    if messages is not None:
        return "".join(_content(m.content) + MESSAGE_END for m in messages)
    prompt = getattr(body, "prompt", None)
    if isinstance(prompt, str):
        return prompt
    if prompt and isinstance(prompt[0], int):
        return " ".join(map(str, prompt))
    return "\x1d".join(p if isinstance(p, str) else " ".join(map(str, p)) for p in prompt or ())


def _content(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(getattr(part, "text", None) or "" for part in content or ())


class PrefixIndex:
    """Which replica served the longest prefix of a text. A text is cut every ``block``
    characters, after every message (:data:`MESSAGE_END`) and at its end; each cut's key is
    a digest of the text up to it, so a later text that extends an earlier one by whole
    messages or blocks finds the earlier one's cuts among its own. At most ``capacity``
    keys, least recently used dropped first."""

    def __init__(self, block: int = 64, capacity: int = 200_000) -> None:
        self.block = block
        self.capacity = capacity
        self._owner: OrderedDict[bytes, str] = OrderedDict()

    def _keys(self, text: str) -> Iterable[tuple[int, bytes]]:
        """(length, key) of every cut of ``text`` (lengths in bytes of its UTF-8)."""
        data = text.encode()
        ends = set(range(self.block, len(data) + 1, self.block))
        ends.update(i + 1 for i, b in enumerate(data) if b == MESSAGE_END.encode()[0])
        ends.add(len(data))
        digest = hashlib.blake2b(digest_size=16)
        start = 0
        for end in sorted(ends - {0}):
            digest.update(data[start:end])
            start = end
            yield end, digest.copy().digest()

    def match(self, text: str) -> tuple[str | None, int]:
        """The replica holding the longest indexed prefix of ``text``, and that prefix's
        length (in bytes); ``(None, 0)`` when none is indexed."""
        best: tuple[str | None, int] = (None, 0)
        for end, key in self._keys(text):
            owner = self._owner.get(key)
            if owner is None:  # (an indexed longer prefix would have this cut indexed too)
                break
            self._owner.move_to_end(key)
            best = (owner, end)
        return best

    def insert(self, text: str, replica: str) -> None:
        """``replica`` now holds ``text`` (and so every prefix of it)."""
        for _, key in self._keys(text):
            self._owner[key] = replica
            self._owner.move_to_end(key)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)

    def forget(self, replica: str) -> None:
        """Drop what ``replica`` held (it died, or was scaled down)."""
        for key in [k for k, owner in self._owner.items() if owner == replica]:
            del self._owner[key]

    def __len__(self) -> int:
        return len(self._owner)


def prefer(
    preferred: str | None, loads: dict[str, int | None], slots: int, imbalance: int
) -> tuple[list[str], list[str]]:
    """The replicas to try first and next: the one holding the prefix, unless its ``slots``
    are full (a request there would wait) and it is busier than the least busy by more than
    ``imbalance`` requests; then the least busy ones. The rest after. A load not known
    counts as 0.

    A replica with a free slot starts the request at once, so moving it would only lose
    its cached prefix; only a queue forming is worth a recomputed prefix."""
    known = {r: (load or 0) for r, load in loads.items()}
    if not known:
        return [], []
    least = min(known.values())
    idle = [r for r, load in known.items() if load == least]
    stay = preferred in known and (known[preferred] < slots or known[preferred] - least <= imbalance)
    first = [preferred] if stay and preferred is not None else idle
    return first, [r for r in known if r not in first]


class PrefixRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    """A Ray Serve request router: a request goes to the replica that served its prefix
    (:class:`PrefixIndex`), unless that one has all its ``slots`` busy and is busier than
    the least busy by more than ``imbalance`` ongoing requests (:func:`prefer`; both are
    ``request_router_kwargs``); a request without an indexed prefix goes as power of two
    choices."""

    def initialize_state(self, slots: int = 8, imbalance: int = 4, block: int = 64, **_: Any) -> None:
        self._index = PrefixIndex(block)
        self._slots = slots
        self._imbalance = imbalance

    async def choose_replicas(self, candidate_replicas: list[Any], pending_request: Any = None) -> Any:
        text = _text_of(pending_request)
        preferred, matched = self._index.match(text) if text else (None, 0)
        if not matched:
            # as power of two choices (as Ray's own prefix router falls back)
            pow2: Any = PowerOfTwoChoicesRequestRouter.choose_replicas
            return await pow2(self, candidate_replicas, pending_request)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        cache = self.replica_queue_len_cache
        loads = {rid: cache.get(r.replica_id) for rid, r in by_id.items()}
        first, rest = prefer(preferred, loads, self._slots, self._imbalance)
        return [[by_id[r] for r in first], [by_id[r] for r in rest]]

    def on_request_routed(self, pending_request: Any, replica_id: Any, result: Any) -> None:
        text = _text_of(pending_request)
        if text:
            self._index.insert(text, replica_id.unique_id)

    def on_replica_actor_died(self, replica_id: Any) -> None:
        super().on_replica_actor_died(replica_id)
        self._index.forget(replica_id.unique_id)


def _text_of(pending_request: Any) -> str:
    """The routing text of a request's :class:`ReplicaRequest` (read by its attribute:
    Serve may hand the router a copy of the class, as Ray's own prefix router reads
    ``prompt`` / ``messages`` attributes)."""
    for arg in getattr(pending_request, "args", None) or ():
        text = getattr(arg, "routing_text", None)
        if isinstance(text, str):
            return text
    return ""
