"""The output path: one step's verified tokens become what a request keeps and what its
caller sees. Pure logic over plain data, like the planner; no native call.

After a step, a decoding sequence has verified tokens ``[t0, ..., tn]``: ``t0..t(n-1)`` are
drafts the target accepted (already in the KV cache, still pending) and ``tn`` is the
target's own next token. :func:`process_output` walks them in order and stops at the first
of: an end-of-generation token (unless ``ignore_eos``), a stop token id, a stop string
completed by a token's text, ``max_tokens`` reached. The context end is checked after.

**The stop-state contract.** The sequence keeps exactly the first ``keep`` verified tokens
(:attr:`Outcome.keep`); the engine settles the step's drafts accordingly at the next step
boundary (``StepPlan.settle``: accepted drafts after the stop are rolled back from the
target and draft KV caches, the drafter and the history), before any capture. So after a
stop, the saved state (history + the last sampled token) equals prompt + the tokens handed
to the caller, plus the stop token id when a stop token (or end of generation) ended it:
with or without speculation, for every drafter, a resumed turn reads exactly what a cold
read of those visible tokens reads. A stop string ends generation after the token that
completed it: that token is handed out (``token_ids``) and kept, its text is cut.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from .params import SamplingParams

__all__ = [
    "Candidate",
    "FinishReason",
    "Outcome",
    "OutputState",
    "StopRules",
    "TextAssembler",
    "TokenLogprob",
    "Verified",
    "process_output",
]


class FinishReason(enum.StrEnum):
    STOP = "stop"  #: end-of-generation token, stop string or stop token id
    LENGTH = "length"  #: max_tokens or the end of the sequence's context
    ABORT = "abort"  #: aborted, cancelled, or the engine closed
    ERROR = "error"  #: the request failed (the error is raised to its caller)


class Candidate(NamedTuple):
    """A token the model considered at a position."""

    token_id: int
    logprob: float
    piece: bytes  #: its bytes (may be part of a multi-byte character)


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token's log-probability under the target model's distribution at its
    position (log-softmax of the raw logits, before temperature, penalties, grammar or
    logit bias), and the ``top`` most likely tokens there, most likely first. With
    speculation they come from the verification's own logits."""

    token_id: int
    piece: bytes
    logprob: float
    top: tuple[Candidate, ...] = ()


class Verified(Protocol):
    """What the native step returns per sampling sequence (``_nb_spec.StepOutput``)."""

    @property
    def tokens(self) -> Sequence[int]: ...
    @property
    def pieces(self) -> Sequence[bytes]: ...
    @property
    def logprobs(self) -> Sequence[tuple[float, Sequence[tuple[int, float, bytes]]]]:
        """Per token, when the request asked for them (else empty)."""
        ...


@dataclass(frozen=True)
class StopRules:
    """When one request's generation ends."""

    eog: frozenset[int]  #: end-of-generation tokens (empty under ``ignore_eos``)
    stop_token_ids: frozenset[int]
    max_tokens: int
    n_ctx: int  #: tokens one sequence holds

    @classmethod
    def of(cls, params: SamplingParams, eog_tokens: Sequence[int], n_ctx: int) -> StopRules:
        return cls(
            frozenset() if params.ignore_eos else frozenset(eog_tokens),
            frozenset(params.stop_token_ids),
            params.max_tokens,
            n_ctx,
        )


@dataclass
class Outcome:
    """What one step means for one request."""

    keep: int  #: verified tokens the sequence keeps (>= 1); the rest are rolled back
    token_ids: list[int]  #: handed to the caller now
    text: str  #: handed to the caller now (whole characters)
    finish_reason: str | None  #: set when generation ended
    logprobs: list[TokenLogprob] | None = None  #: per token of ``token_ids``, when asked for


class OutputState(Protocol):
    """The parts of a request the output path reads and writes."""

    output_ids: list[int]  #: tokens handed to the caller so far
    text: TextAssembler
    history: list[int]  #: tokens of the sequence in the KV cache, in order
    last: int | None  #: the last sampled token, not in the KV cache yet


class TextAssembler:
    """Turns token bytes into text: holds back incomplete UTF-8 characters and any tail
    that could still grow into a stop string; cuts the text at the first stop string (after
    it with ``keep_stop``)."""

    def __init__(self, stop: tuple[str, ...], keep_stop: bool = False) -> None:
        self._stop = stop
        self._keep_stop = keep_stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._bytes = b""
        self.text = ""  # complete text so far (stop string excluded once found)
        self._emitted = 0  # characters of `text` already handed out
        self.stopped = False

    def feed(self, piece: bytes) -> None:
        if self.stopped:
            return
        self._bytes += piece
        text = self._decode_complete()
        if not text:
            return
        start = max(0, len(self.text) - self._hold)
        self.text += text
        for s in self._stop:
            i = self.text.find(s, start)
            if i >= 0:
                self.text = self.text[: i + len(s) if self._keep_stop else i]
                self.stopped = True
                start = i

    def _decode_complete(self) -> str:
        b = self._bytes
        for cut in range(len(b), max(len(b) - 4, -1), -1):
            try:
                text = b[:cut].decode("utf-8")
            except UnicodeDecodeError:
                continue
            self._bytes = b[cut:]
            return text
        # not UTF-8 even allowing for a partial character: replace, do not stall
        self._bytes = b""
        return b.decode("utf-8", "replace")

    def take(self, final: bool = False) -> str:
        """Text ready to hand out; at ``final`` everything that is left."""
        if final and not self.stopped and self._bytes:
            self.text += self._bytes.decode("utf-8", "replace")
            self._bytes = b""
        end = len(self.text) if (final or self.stopped) else max(self._emitted, len(self.text) - self._hold)
        out = self.text[self._emitted : end]
        self._emitted = end
        return out


def process_output(request: OutputState, out: Verified, rules: StopRules) -> Outcome:
    """Apply one step's verified tokens to ``request`` and decide what happens.

    Updates the request's output (ids and text) and its sequence (``history`` gains the
    kept tokens that are in the KV cache, ``last`` is the last kept token), and returns the
    :class:`Outcome`. ``request.history`` must already hold the step's input tokens.
    """
    tokens = list(out.tokens)
    pieces = list(out.pieces)
    logprobs = list(out.logprobs)
    keep, reason = len(tokens), None
    emitted: list[int] = []
    emitted_logprobs: list[TokenLogprob] | None = [] if logprobs else None
    for i, (token, piece) in enumerate(zip(tokens, pieces, strict=True)):
        if token in rules.eog or token in rules.stop_token_ids:
            keep, reason = i + 1, FinishReason.STOP.value  # kept, not handed out
            break
        request.output_ids.append(token)
        emitted.append(token)
        if emitted_logprobs is not None:
            logprob, top = logprobs[i]
            emitted_logprobs.append(TokenLogprob(token, piece, logprob, tuple(Candidate(*c) for c in top)))
        request.text.feed(piece)
        if request.text.stopped:
            keep, reason = i + 1, FinishReason.STOP.value
            break
        if len(request.output_ids) >= rules.max_tokens:
            keep, reason = i + 1, FinishReason.LENGTH.value
            break
    request.history.extend(tokens[: keep - 1])  # accepted drafts the sequence keeps
    request.last = tokens[keep - 1]  # sampled, not in the KV cache yet
    if reason is None and len(request.history) >= rules.n_ctx - 1:
        reason = FinishReason.LENGTH.value  # the sequence's context is full
    return Outcome(keep, emitted, request.text.take(final=reason is not None), reason, emitted_logprobs)
