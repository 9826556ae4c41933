"""Prefix reuse: which idle slot's KV cache already holds the start of a new prompt.

A request that ends leaves its sequence (prompt + generated tokens) in its slot's KV cache
as a *cached sequence* until the slot is needed. :class:`PrefixCache` indexes those
sequences in a radix tree over token ids; a new request is given the slot holding its
longest cached prefix, the engine cuts that slot back to the shared prefix and prefills
only the rest. Pure logic, plain data: the native side checks the slot really holds the
prefix before it cuts (``StepPlan.reuse``).

Rules (the reasons are in the engine's KV cache, not here):

- at least the prompt's last token is always decoded again: its logits start the generation
  (and a drafter's state at the boundary comes from that decode);
- a cached sequence is taken when it saves enough (:data:`MIN_REUSE` tokens, or half the
  prompt or of what it holds) or when no empty slot is left; otherwise an empty slot is
  used and the cached sequence stays for a request that shares more;
- when no slot is empty, the least recently used cached sequence is evicted (and still
  reused for whatever prefix it shares). A running request is never evicted.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["MIN_REUSE", "PrefixCache", "RadixTree", "common_prefix"]

#: a cached sequence sharing fewer tokens than this (and under half the prompt and of its
#: own tokens) is kept for a better match while an empty slot can take the request
MIN_REUSE = 32


def common_prefix(a: Sequence[int], b: Sequence[int], start: int = 0) -> int:
    """Length of the common prefix of ``a`` and ``b[start:]``."""
    n = min(len(a), len(b) - start)
    i = 0
    while i < n and a[i] == b[start + i]:
        i += 1
    return i


class _Node:
    __slots__ = ("children", "edge", "keys")

    def __init__(self, edge: tuple[int, ...]) -> None:
        self.edge = edge  # the tokens on the edge into this node
        self.children: dict[int, _Node] = {}  # by the first token of their edge
        self.keys: set[int] = set()  # the sequences whose path goes through this node


class RadixTree:
    """Token sequences under integer keys, by prefix. Edges hold runs of tokens, so a
    sequence costs one node per branch point, not per token."""

    def __init__(self) -> None:
        self.root = _Node(())

    def insert(self, key: int, tokens: Sequence[int]) -> None:
        node, i = self.root, 0
        node.keys.add(key)
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                child = _Node(tuple(tokens[i:]))
                child.keys.add(key)
                node.children[tokens[i]] = child
                return
            n = common_prefix(child.edge, tokens, i)
            if n < len(child.edge):  # split the edge where the sequences part
                mid = _Node(child.edge[:n])
                mid.keys = set(child.keys)
                child.edge = child.edge[n:]
                mid.children[child.edge[0]] = child
                node.children[tokens[i]] = child = mid
            child.keys.add(key)
            node, i = child, i + n

    def remove(self, key: int, tokens: Sequence[int]) -> None:
        """Forget ``key``, inserted with ``tokens``; nodes no sequence passes through go."""
        node, i = self.root, 0
        node.keys.discard(key)
        while i < len(tokens):
            child = node.children[tokens[i]]
            child.keys.discard(key)
            if not child.keys:
                del node.children[tokens[i]]
                return
            node, i = child, i + len(child.edge)

    def longest(self, tokens: Sequence[int]) -> tuple[set[int], int]:
        """The keys sharing the longest prefix with ``tokens``, and its length."""
        node, i = self.root, 0
        best = (node.keys, 0)
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                break
            n = common_prefix(child.edge, tokens, i)
            best = (child.keys, i + n)
            if n < len(child.edge):
                break
            node, i = child, i + n
        return best


@dataclass
class _Entry:
    tokens: list[int]
    used: int  # when it was cached (the LRU order)


class PrefixCache:
    """The sequences idle slots hold, for reuse by new requests."""

    def __init__(self) -> None:
        self._tree = RadixTree()
        self._entries: dict[int, _Entry] = {}
        self._clock = itertools.count()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, slot: object) -> bool:
        return slot in self._entries

    def put(self, slot: int, tokens: Sequence[int]) -> None:
        """``slot``'s KV cache holds ``tokens`` (its first positions, at least)."""
        if slot in self._entries:
            self.pop(slot)
        entry = _Entry(list(tokens), next(self._clock))
        self._entries[slot] = entry
        self._tree.insert(slot, entry.tokens)

    def pop(self, slot: int) -> list[int]:
        entry = self._entries.pop(slot)
        self._tree.remove(slot, entry.tokens)
        return entry.tokens

    def slots(self) -> list[int]:
        return list(self._entries)

    def held(self) -> dict[int, int]:
        """Tokens each cached slot holds (its KV cache may hold more after them)."""
        return {slot: len(e.tokens) for slot, e in self._entries.items()}

    def take(self, prompt: Sequence[int], have_empty: bool) -> tuple[int, int] | None:
        """A cached slot for a request with ``prompt`` and how many of its tokens the slot
        keeps, or None: use an empty slot (``have_empty``) or wait. The slot leaves the cache."""
        if not self._entries:
            return None
        if prompt:
            keys, shared = self._tree.longest(prompt)
            keep = min(shared, len(prompt) - 1)
            if keys and keep > 0:
                slot = max(keys, key=lambda s: self._entries[s].used)  # the freshest of equals
                held = len(self._entries[slot].tokens)
                if keep >= MIN_REUSE or 2 * keep >= min(len(prompt), held) or not have_empty:
                    self.pop(slot)
                    return slot, keep
        if have_empty:
            return None
        slot = min(self._entries, key=lambda s: self._entries[s].used)  # evict the LRU one
        tokens = self.pop(slot)
        return slot, min(common_prefix(tokens, prompt), max(len(prompt) - 1, 0))
