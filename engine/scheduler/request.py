"""A request: its lifecycle, its sequence, what its caller receives, and its metrics."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ..session.chat import ChatMessage, ChatParser, ToolCallDelta
from .drafting.stats import DraftStats
from .errors import UnknownRequestError
from .output import FinishReason, TextAssembler, TokenLogprob
from .params import SamplingParams

if TYPE_CHECKING:
    from ..session.chat import ChatPrompt

__all__ = [
    "CheckpointWaiter",
    "Delta",
    "FinishReason",
    "Request",
    "RequestMetrics",
    "RequestOutput",
    "RequestState",
    "Resume",
]


class RequestState(enum.Enum):
    """WAITING → PREFILL → DECODE → (FINISHING) → FINISHED; any state may go to FINISHED.
    A preempted request goes DECODE → SWAPPING → WAITING (its state in host memory) and
    back through PREFILL (its last token) to DECODE."""

    WAITING = "waiting"  #: queued for a sequence slot
    PREFILL = "prefill"  #: holds a slot; its prompt is being read
    DECODE = "decode"  #: generating
    SWAPPING = "swapping"  #: preempted: its sequence is captured at this step's boundary
    FINISHING = "finishing"  #: generation ended; its final state is captured at the next boundary
    FINISHED = "finished"  #: handed to the caller (result or error)


@dataclass
class RequestMetrics:
    """Per-request figures; times are seconds."""

    prompt_tokens: int = 0
    cached_tokens: int = 0  #: prompt tokens a cached prefix saved from prefill
    completion_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    decode_steps: int = 0  #: target verifications that produced tokens
    preemptions: int = 0  #: times its state was swapped out to let another request run
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
            "cached_tokens": self.cached_tokens,
            "completion_tokens": self.completion_tokens,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "preemptions": self.preemptions,
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
    #: per token of ``token_ids`` when ``SamplingParams.logprobs`` asked for them
    logprobs: list[TokenLogprob] | None = None
    #: chat messages: the answer as the template's format reads it (``text`` is its content)
    message: ChatMessage | None = None


@dataclass
class Delta:
    """A piece of a streamed completion: always whole UTF-8 characters. For chat messages
    ``text`` is the answer's content; a thinking model's thinking comes in ``reasoning`` and
    tool calls in ``tool_calls`` (OpenAI's incremental form)."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    #: on the last delta only: the whole result (text, metrics, final checkpoint)
    output: RequestOutput | None = None
    #: per token of ``token_ids`` when ``SamplingParams.logprobs`` asked for them
    logprobs: list[TokenLogprob] | None = None
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] | None = None


@dataclass
class Resume:
    """A checkpoint to continue from: the native sections and the sequence it holds."""

    target: bytes
    draft: bytes
    spec: bytes
    history: list[int]  #: tokens in its KV cache
    last: int  #: its last sampled token (not in the KV cache)
    n_prompt: int  #: how many of ``history`` count as prompt
    drafter_in_sync: bool = True  #: its drafter's state was whole when it was captured


class CheckpointWaiter:
    """One ``Engine.checkpoint`` call waiting for the next step boundary."""

    def __init__(self) -> None:
        self._done = anyio.Event()
        self._data: bytes | None = None
        self._error: BaseException | None = None

    def resolve(self, data: bytes | None, error: BaseException | None = None) -> None:
        if not self._done.is_set():
            self._data, self._error = data, error
            self._done.set()

    async def wait(self) -> bytes:
        await self._done.wait()
        if self._error is not None:
            raise self._error
        assert self._data is not None
        return self._data


@dataclass
class Request:
    """Everything the scheduler knows about one request."""

    request_id: str
    prompt_tokens: list[int]
    params: SamplingParams
    seed: int
    priority: int = 0
    arrival_index: int = 0
    resume: Resume | None = None
    want_checkpoint: bool = False
    #: chat messages: the rendered template (its grammar for tools, and its output format)
    chat: ChatPrompt | None = None
    #: reuse a cached prefix of its prompt, and leave its sequence cached when it ends
    cache_prompt: bool = True
    state: RequestState = RequestState.WAITING
    slot: int | None = None
    held_since: float = 0.0  #: when it got its slot (the time slice counts from there)
    #: its KV cache came from captured state (a checkpoint, or a preemption): the cells a
    #: sliding window hid were not captured, so its sequence is not cached for reuse
    restored: bool = False
    #: preempted: the name of its parked sampler, and the bytes its swapped state holds
    parked: int | None = None
    swap_bytes: int = 0
    # the sequence: tokens in the KV cache in order (prompt, then kept output), how many of
    # them count as prompt (sampler replay), what is left to read, the last sampled token
    history: list[int] = field(default_factory=list)
    n_prompt_history: int = 0
    to_prefill: list[int] = field(default_factory=list)
    last: int | None = None
    # what the caller receives
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprob] | None = None  #: when its params ask for logprobs
    text: TextAssembler = field(init=False)
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    #: its drafts by position, recent verifications weighing more (the draft policy reads it)
    draft_stats: DraftStats = field(default_factory=lambda: DraftStats(decay=0.95))
    #: a stream drafter (EAGLE-3, DFlash, MTP) saw every batch of its sequence; once it
    #: skipped one (see ``DrafterGate``) the request drafts no more
    drafter_in_sync: bool = True
    #: a draft model has decoded its sequence up to here (it catches up when it drafts)
    drafter_upto: int = 0
    finish_reason: str | None = None
    error: BaseException | None = None
    final_checkpoint: bytes | None = None
    checkpoint_waiters: list[CheckpointWaiter] = field(default_factory=list)
    #: FINISHING: the last step's delta, handed out with the result once captured
    tail: Delta | None = None
    send: MemoryObjectSendStream[Any] | None = None
    receive: MemoryObjectReceiveStream[Any] | None = None  #: None in a stream group
    stream_index: int | None = field(default=None, init=False)  #: its index in a stream group
    _room: int = field(default=0, init=False)  #: deltas its buffer may hold before it pauses
    done: anyio.Event = field(default_factory=anyio.Event)

    def __post_init__(self) -> None:
        self.text = TextAssembler(self.params.stop, self.params.include_stop_str_in_output)
        if self.params.logprobs is not None:
            self.output_logprobs = []

    def chat_parser(self) -> ChatParser | None:
        """A new parser of its output in the template's format (chat messages only)."""
        return ChatParser(self.chat) if self.chat is not None else None

    @property
    def cacheable(self) -> bool:
        """Whether its sequence may stay cached for prefix reuse when it gives up its slot."""
        return self.cache_prompt and not self.restored

    @property
    def n_past(self) -> int:
        """Tokens of the sequence in the KV cache."""
        return len(self.history)

    @property
    def finished(self) -> bool:
        return self.state is RequestState.FINISHED

    def open_stream(
        self, buffer: int, group: tuple[MemoryObjectSendStream[Any], int, int] | None = None
    ) -> None:
        """Deltas go through a bounded buffer: a consumer that stops reading pauses this
        request (the scheduler checks :meth:`stream_has_room`) and no other. ``group``:
        ``(send, index, size)``, the unbounded buffer of a :class:`StreamGroup` that ``size``
        requests share, where this one's deltas go as ``(index, delta)``; they all pause
        when it holds ``size * buffer``."""
        if group is None:
            self.send, self.receive = anyio.create_memory_object_stream[Any](buffer)
            self._room = buffer - 2  # one more step's delta and the final one
        else:
            self.send, self.stream_index, size = group
            self._room = size * (buffer - 2)

    def stream_has_room(self) -> bool:
        if self.send is None:
            return True
        return bool(self.send.statistics().current_buffer_used <= self._room)

    def push(self, delta: Delta | BaseException) -> None:
        if self.send is None:
            return
        if isinstance(delta, Delta) and not (delta.text or delta.token_ids or delta.finish_reason):
            return
        try:
            self.send.send_nowait(delta if self.stream_index is None else (self.stream_index, delta))
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass  # the consumer is gone; its request is being aborted

    def mark_first_token(self) -> None:
        if self.metrics.first_token is None:
            self.metrics.first_token = time.perf_counter()

    def output(self) -> RequestOutput:
        return RequestOutput(
            self.request_id,
            self.text.text,
            list(self.output_ids),
            self.finish_reason or FinishReason.ABORT.value,
            self.metrics,
            self.final_checkpoint,
            None if self.output_logprobs is None else list(self.output_logprobs),
        )

    def finish(self, reason: str, error: BaseException | None = None) -> None:
        """Hand the result (or ``error``) to the caller; the only way a request ends."""
        if self.finished:
            return
        tail = self.tail or Delta("", [])
        self.state = RequestState.FINISHED
        self.finish_reason = reason
        self.error = error
        self.tail = None
        self.metrics.finish_reason = reason
        self.metrics.finished = time.perf_counter()
        for waiter in self.checkpoint_waiters:
            waiter.resolve(
                None, UnknownRequestError(f"request {self.request_id!r} ended before its checkpoint")
            )
        self.checkpoint_waiters.clear()
        text = tail.text + self.text.take(final=True)
        if self.send is not None:
            if error is None:
                self.push(Delta(text, tail.token_ids, reason, self.output(), tail.logprobs))
            elif self.stream_index is not None:
                self.push(error)  # (a group's buffer is shared: the error travels in it)
            self.send.close()
        self.done.set()
