"""A request's state, its text assembly (UTF-8 and stop strings), outputs and metrics."""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field
from typing import Any

from .params import SamplingParams

__all__ = [
    "Delta",
    "FinishReason",
    "Request",
    "RequestMetrics",
    "RequestOutput",
    "RequestState",
    "TextAssembler",
]


class FinishReason(enum.StrEnum):
    STOP = "stop"  #: end-of-generation token, stop string or stop token id
    LENGTH = "length"  #: max_tokens or the end of the sequence's context
    ABORT = "abort"  #: aborted, cancelled, or the engine closed
    ERROR = "error"  #: the request failed (the error is raised to its caller)


class RequestState(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"


@dataclass
class RequestMetrics:
    """Per-request figures; times are seconds."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    decode_steps: int = 0  #: target verifications that produced tokens
    arrival: float = 0.0
    first_token: float | None = None
    finished: float | None = None
    finish_reason: str | None = None

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per target verification (1 + accepted drafts per verification)."""
        return 1.0 + self.accepted / self.decode_steps if self.decode_steps else 0.0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def tokens_per_s(self) -> float:
        if self.first_token is None or self.finished is None or self.completion_tokens < 2:
            return 0.0
        return (self.completion_tokens - 1) / max(self.finished - self.first_token, 1e-9)

    def as_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "ttft": self.ttft,
            "tokens_per_s": self.tokens_per_s,
            "finish_reason": self.finish_reason,
        }


@dataclass
class RequestOutput:
    """The result of :meth:`Engine.generate`."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    metrics: RequestMetrics
    checkpoint: bytes | None = None


@dataclass
class Delta:
    """A piece of a streamed completion: always whole UTF-8 characters."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    #: on the last delta only: the whole result (text, metrics, final checkpoint)
    output: RequestOutput | None = None


class TextAssembler:
    """Turns token bytes into text: holds back incomplete UTF-8 characters and any tail
    that could still grow into a stop string; cuts the text at the first stop string."""

    def __init__(self, stop: tuple[str, ...]) -> None:
        self._stop = stop
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
                self.text = self.text[:i]
                self.stopped = True
                start = i
        return

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


@dataclass
class Request:
    """Everything the scheduler knows about one request."""

    request_id: str
    prompt_tokens: list[int]
    params: SamplingParams
    seed: int
    priority: int = 0
    arrival_index: int = 0
    # resume_from: (target, draft, spec) bytes and the checkpoint's meta
    resume: tuple[bytes, bytes, bytes, dict[str, Any]] | None = None
    want_checkpoint: bool = False
    state: RequestState = RequestState.WAITING
    slot: int | None = None
    # tokens of this sequence in the KV cache, in order (prompt, then accepted output)
    history: list[int] = field(default_factory=list)
    n_prompt_history: int = 0  # how many of `history` count as prompt (for sampler replay)
    to_prefill: list[int] = field(default_factory=list)
    n_past: int = 0  # tokens in the KV cache
    last: int | None = None  # sampled, not yet in the KV cache
    output_ids: list[int] = field(default_factory=list)
    assembler: TextAssembler = field(init=False)
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    finish_reason: str | None = None
    error: BaseException | None = None
    checkpoint_waiters: list[asyncio.Future[bytes]] = field(default_factory=list)
    final_checkpoint: bytes | None = None
    final_pending: tuple[str, list[int]] | None = None  # finished, waiting for its final capture
    stream: asyncio.Queue[Delta | None] | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)
    aborted: bool = False

    def __post_init__(self) -> None:
        self.assembler = TextAssembler(self.params.stop)

    @property
    def finished(self) -> bool:
        return self.state is RequestState.FINISHED

    def output(self) -> RequestOutput:
        return RequestOutput(
            self.request_id,
            self.assembler.text,
            list(self.output_ids),
            self.finish_reason or FinishReason.ABORT.value,
            self.metrics,
            self.final_checkpoint,
        )

    def push(self, delta: Delta) -> None:
        if self.stream is not None and (delta.text or delta.token_ids or delta.finish_reason):
            self.stream.put_nowait(delta)

    def mark_first_token(self) -> None:
        if self.metrics.first_token is None:
            self.metrics.first_token = time.perf_counter()
