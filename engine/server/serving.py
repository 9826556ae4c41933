"""OpenAI's completions and chat completions over an :class:`~engine.Engine`: a validated
request (:class:`~engine.server.protocol.ApiCall`) becomes engine requests, and their
outputs become response objects or server-sent event chunks; every failure becomes an
OpenAI-style error (:func:`api_error`).

No HTTP here: the same code answers ``engine serve``'s routes and a cluster replica's
calls (``engine.cluster``). The routes answer from a :class:`Backend`: this engine
(:class:`OpenAIServing`), or a cluster's replicas. Each choice is one engine request; the
choices of one call are read through one :class:`~engine.scheduler.engine.StreamGroup`,
so no task is started per choice and a stream can be read from any task.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from ..logs import get_logger
from ..scheduler import (
    Delta,
    Engine,
    QueueFullError,
    RequestError,
    RequestMetrics,
    RequestOutput,
    SamplingParams,
)
from ..scheduler.streams import StreamGroup
from ..session import (
    ChatMessage,
    ClosedError,
    InvalidArgumentError,
    InvalidConfigError,
    PromptTooLongError,
)
from . import protocol
from .protocol import ApiCall, ChatRequest, CompletionRequest, ProtocolError

__all__ = ["Answer", "ApiError", "Backend", "OpenAIServing", "api_error", "sse"]

Body = CompletionRequest | ChatRequest

log = get_logger("engine.server")

DONE = b"data: [DONE]\n\n"


def _json(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def sse(obj: dict[str, Any]) -> bytes:
    """One server-sent event holding ``obj`` as JSON."""
    return b"data: " + _json(obj) + b"\n\n"


class ApiError(Exception):
    """A failure as OpenAI's API reports it: an HTTP status, an error body, headers."""

    def __init__(self, status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> None:
        super().__init__(body["error"]["message"])
        self.status = status
        self.body = body
        self.headers = headers or {}


def api_error(exc: BaseException, prompt_param: str = "prompt", retry_after_s: int = 1) -> ApiError:
    """The OpenAI-style error for any failure of a call (one place for every status)."""

    def err(status: int, message: str, type_: str = "invalid_request_error", **kw: Any) -> ApiError:
        headers = kw.pop("headers", None)
        return ApiError(status, protocol.error_body(message, type_, **kw), headers)

    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, ProtocolError):
        return err(exc.status, str(exc), param=exc.param, code=exc.error_code)
    if isinstance(exc, PromptTooLongError):
        return err(400, str(exc), param=prompt_param, code="context_length_exceeded")
    if isinstance(exc, QueueFullError):
        return err(
            429,
            "the server is at capacity: retry later",
            "rate_limit_exceeded",
            code="rate_limit_exceeded",
            headers={"Retry-After": str(retry_after_s)},
        )
    if isinstance(exc, InvalidConfigError | InvalidArgumentError):
        return err(400, str(exc), code="invalid_value")
    if isinstance(exc, ClosedError):
        return err(503, "the engine is not serving", "service_unavailable", code="unavailable")
    if isinstance(exc, RequestError) and isinstance(exc.__cause__, InvalidConfigError | InvalidArgumentError):
        return err(400, str(exc.__cause__), code="invalid_value")  # e.g. a schema the grammar rejects
    if isinstance(exc, RequestError):
        log.warning("server.request_failed", error=repr(exc))
        return err(500, str(exc), "server_error")
    log.error("server.internal_error", error=repr(exc))
    return err(500, "internal error", "server_error")


@dataclass
class Answer:
    """What a call answers: a whole response (``body``) or server-sent events
    (``chunks``, to ``[DONE]``), and headers for the HTTP response."""

    body: dict[str, Any] | None = None
    chunks: AsyncIterator[bytes] | None = None
    headers: dict[str, str] = field(default_factory=dict)


class Backend(Protocol):
    """What the HTTP routes answer from."""

    model_name: str

    async def ready(self) -> bool:
        """Able to answer (the health check)."""
        ...

    async def answer(self, body: Body, headers: Mapping[str, str] | None = None) -> Answer:
        """Answer a validated request (``headers``: the HTTP request's); a stream's
        requests are submitted before this returns, so that a refusal is raised here,
        before the response starts.

        :raises: the failure (mapped by :func:`api_error`).
        """
        ...


class OpenAIServing:
    """Answers validated API calls from ``engine`` under the name ``model_name``: the
    :class:`Backend` of one engine."""

    def __init__(self, engine: Engine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    async def ready(self) -> bool:
        return self.engine.serving

    async def answer(self, body: Body, headers: Mapping[str, str] | None = None) -> Answer:
        call = self.call(body)
        if call.stream:
            return Answer(chunks=await self.stream(call))
        return Answer(body=await self.complete(call))

    def call(self, body: protocol.CompletionRequest | protocol.ChatRequest) -> ApiCall:
        """What the engine runs for ``body``.

        :raises ProtocolError: a value this engine cannot honour.
        """
        info = self.engine.model.info
        bos = info.bos if info.bos >= 0 else None
        return protocol.engine_call(body, self.engine.config.n_ctx, info.n_vocab, bos)

    async def complete(self, call: ApiCall) -> dict[str, Any]:
        """The whole response of a non-streamed call.

        :raises: the first engine error (the other choices are aborted).
        """
        r = _Response(self, call)
        choices = call.choices()
        results: dict[int, RequestOutput] = {}
        if len(choices) == 1:
            index, prompt = choices[0]
            results[index] = await self.engine.generate(prompt, call.params, **r.request_args(index))
        else:
            async with r.group() as group:
                async for index, delta in group:
                    if delta.output is not None:
                        results[index] = delta.output
        return r.envelope(
            [r.choice(index, results[index]) for index in sorted(results)],
            usage=r.usage({i: out.metrics for i, out in results.items()}),
        )

    async def stream(self, call: ApiCall) -> AsyncIterator[bytes]:
        """The server-sent events of a streamed call, to ``data: [DONE]``. Every request is
        submitted before this returns, so that a refusal (a full queue, a prompt too long)
        is raised here, before the response starts. Closing the iterator aborts them."""
        r = _Response(self, call)
        group = r.group()
        await group.start()
        return r.events(group)


class _Response:
    """One API call's response: its id, its choices' engine requests, their chunks."""

    def __init__(self, serving: OpenAIServing, call: ApiCall) -> None:
        self.serving = serving
        self.engine = serving.engine
        self.call = call
        self.chat = call.is_chat
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = protocol.now()
        self.include_usage = call.include_usage
        self.include_reasoning = call.include_reasoning
        # a chunk is this envelope around its choices, serialised once per response
        head = _json({k: v for k, v in self.envelope([]).items() if k != "choices"})
        self._head = b"data: " + head[:-1] + b',"choices":['
        self._tail = b'],"usage":null}\n\n' if self.include_usage else b"]}\n\n"

    def request_args(self, index: int) -> dict[str, Any]:
        return {
            "request_id": f"{self.id}-{index}",
            "cache_prompt": self.call.cache_prompt,
            "chat": self.call.chat,
        }

    def params(self, index: int) -> SamplingParams:
        params = self.call.params
        if params.seed is None or index == 0:
            return params
        return replace(params, seed=(params.seed + index) % 2**32)  # reproducible, distinct

    def group(self) -> StreamGroup:
        return self.engine.stream_group(
            [
                self.engine.stream(prompt, self.params(index), **self.request_args(index))
                for index, prompt in self.call.choices()
            ]
        )

    def usage(self, metrics: dict[int, RequestMetrics]) -> dict[str, Any]:
        n = self.call.n
        per_prompt = [metrics[p * n] for p in range(len(self.call.prompts)) if p * n in metrics]
        return protocol.usage(per_prompt, list(metrics.values()))

    def envelope(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        streamed = self.call.stream
        kind = "chat.completion.chunk" if streamed else "chat.completion"
        return {
            "id": self.id,
            "object": kind if self.chat else "text_completion",
            "created": self.created,
            "model": self.serving.model_name,
            "system_fingerprint": None,
            "choices": choices,
            **extra,
        }

    def _echo(self, index: int) -> str:
        """The prompt of choice ``index`` as text (completions with ``echo``)."""
        prompt = self.call.prompts[index // self.call.n]
        return prompt if isinstance(prompt, str) else self.engine.model.detokenize(prompt)

    # --- whole responses ----------------------------------------------------------------
    def choice(self, index: int, out: RequestOutput) -> dict[str, Any]:
        reason = protocol.finish_reason(out.finish_reason, out.message)
        if self.chat:
            return {
                "index": index,
                "message": protocol.chat_message(out.message, out.text, self.call.include_reasoning),
                "logprobs": None if out.logprobs is None else protocol.chat_logprobs(out.logprobs),
                "finish_reason": reason,
            }
        return {
            "index": index,
            "text": self._echo(index) + out.text if self.call.echo else out.text,
            "logprobs": None if out.logprobs is None else protocol.completion_logprobs(out.logprobs),
            "finish_reason": reason,
        }

    # --- server-sent events ---------------------------------------------------------------
    def _chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
        if usage is not None:
            return sse(self.envelope(choices, usage=usage))
        return self._head + b",".join(_json(c) for c in choices) + self._tail

    async def events(self, group: StreamGroup) -> AsyncIterator[bytes]:
        """The chunks of every choice in the order they come, the usage chunk if asked
        for, then ``[DONE]``; a request failing mid-stream ends it with an error event."""
        finals: dict[int, RequestMetrics] = {}
        offsets: dict[int, int] = {}
        held: dict[int, str] = {}  # thinking not streamed (stream_reasoning false)
        generated = 0
        try:
            for index, _ in self.call.choices():
                if self.chat:
                    delta: dict[str, Any] = {"role": "assistant", "content": ""}
                    yield self._chunk(
                        [{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}]
                    )
                elif self.call.echo:
                    text = self._echo(index)
                    yield self._chunk(
                        [{"index": index, "text": text, "logprobs": None, "finish_reason": None}]
                    )
            async for index, d in group:
                generated += len(d.token_ids)
                usage = {"completion_tokens": generated} if self.call.continuous_usage else None
                for choice in self._delta_choices(index, d, offsets, held):
                    yield self._chunk([choice], usage)
                if d.output is not None:
                    finals[index] = d.output.metrics
            if self.include_usage:
                yield sse(self.envelope([], usage=self.usage(finals)))
        except (RequestError, ClosedError) as exc:  # the request failed (or the engine stopped) mid-stream
            log.warning("server.stream_failed", error=repr(exc))
            yield sse(protocol.error_body(str(exc), "server_error"))
        finally:
            await group.aclose()  # (aborts what has not finished: the client left, or one failed)
        yield DONE

    def _delta_choices(
        self, index: int, d: Delta, offsets: dict[int, int], held: dict[int, str]
    ) -> list[dict[str, Any]]:
        """The chunk choices of one engine delta: its content (and thinking, tool calls),
        then, at the end, the finish reason on its own, as OpenAI sends it."""
        reason = d.finish_reason  # stop, length; "abort" when the server shuts down (as vLLM)
        logprobs = None
        if d.logprobs is not None:
            if self.chat:
                logprobs = protocol.chat_logprobs(d.logprobs)
            else:
                logprobs = protocol.completion_logprobs(d.logprobs, offsets.get(index, 0))
                offsets[index] = offsets.get(index, 0) + sum(len(t) for t in logprobs["tokens"])
        if not self.chat:
            if not d.text and not d.token_ids and reason is None:
                return []
            return [{"index": index, "text": d.text, "logprobs": logprobs, "finish_reason": reason}]
        out = []
        delta: dict[str, Any] = {}
        reasoning = d.reasoning if self.include_reasoning else ""
        if reasoning and not self.call.stream_reasoning:
            held[index] = held.get(index, "") + reasoning  # handed out whole, before the answer
            reasoning = ""
        if index in held and (d.text or d.tool_calls or reason is not None):
            reasoning = held.pop(index) + reasoning
        if reasoning:
            delta["reasoning_content"] = reasoning
        if d.text:
            delta["content"] = d.text
        if d.tool_calls:
            delta["tool_calls"] = protocol.tool_call_deltas(d.tool_calls)
        if delta or logprobs is not None:
            out.append({"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": None})
        if reason is not None:
            message: ChatMessage | None = d.output.message if d.output is not None else None
            out.append(
                {
                    "index": index,
                    "delta": {},
                    "logprobs": None,
                    "finish_reason": protocol.finish_reason(reason, message),
                }
            )
        return out
