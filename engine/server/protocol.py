"""The OpenAI wire format: request bodies (validated, unknown fields rejected as OpenAI does),
their mapping onto :class:`SamplingParams`, and the response objects and chunks.

Pure logic over plain data: no engine, no HTTP. Every rule about what a parameter means
lives here once.
"""

from __future__ import annotations

import math
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from ..scheduler import RequestMetrics, SamplingParams
from ..scheduler.output import TokenLogprob
from ..session import InvalidArgumentError

__all__ = [
    "ChatRequest",
    "CompletionRequest",
    "ProtocolError",
    "chat_logprobs",
    "completion_logprobs",
    "sampling_params",
    "usage",
]

#: most choices one request may ask for (n, times the prompts of a batched completion)
MAX_CHOICES = 16
#: most top log-probabilities per token (OpenAI's bound for chat; completions allow 5)
MAX_TOP_LOGPROBS = 20

Number = StrictInt | StrictFloat


class ProtocolError(InvalidArgumentError):
    """A request the API refuses: 400 (or ``status``), naming the parameter at fault."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message, reason=code or "invalid_request")
        self.param = param
        self.status = status
        self.error_code = code


class _Body(BaseModel):
    # unknown fields are refused (OpenAI: "Unrecognized request argument supplied");
    # strict: "5" is not 5, and true is not 1
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Body):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False  # (vLLM's) usage so far on every chunk


class JsonSchema(_Body):
    name: StrictStr = "schema"
    description: StrictStr | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None


class _Sampling(_Body):
    """What completions and chat share."""

    model: StrictStr
    n: Annotated[StrictInt, Field(ge=1, le=MAX_CHOICES)] = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: Annotated[Number, Field(ge=0, le=2)] | None = None
    top_p: Annotated[Number, Field(gt=0, le=1)] | None = None
    stop: StrictStr | Annotated[list[StrictStr], Field(max_length=4)] | None = None
    seed: StrictInt | None = None
    presence_penalty: Annotated[Number, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[Number, Field(ge=-2, le=2)] | None = None
    logit_bias: dict[StrictStr, Annotated[Number, Field(ge=-100, le=100)]] | None = None
    user: StrictStr | None = None  # accepted, not used
    # extensions in the style of vLLM and llama-server
    top_k: Annotated[StrictInt, Field(ge=0)] | None = None
    min_p: Annotated[Number, Field(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[Number, Field(gt=0)] | None = None
    ignore_eos: StrictBool = False
    cache_prompt: StrictBool = True


class CompletionRequest(_Sampling):
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    echo: StrictBool = False
    suffix: StrictStr | None = None
    best_of: StrictInt | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompts of a (possibly batched) completion request."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise ProtocolError("prompt must not be empty", "prompt")
        return [q for q in p if not isinstance(q, int)]


class TextPart(_Body):
    type: Literal["text"]
    text: StrictStr


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None

    def as_template_message(self) -> dict[str, str]:
        c = self.content
        text = c if isinstance(c, str) else "".join(part.text for part in c or ())
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatRequest(_Sampling):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    response_format: ResponseFormat | None = None
    # accepted and not used, as an OpenAI client may send them
    metadata: dict[str, StrictStr] | None = None
    store: StrictBool | None = None
    parallel_tool_calls: StrictBool | None = None
    service_tier: StrictStr | None = None


def sampling_params(body: CompletionRequest | ChatRequest, n_ctx: int, n_vocab: int) -> SamplingParams:
    """The engine's parameters for one choice of ``body``.

    :raises ProtocolError: a value the engine cannot honour.
    """
    if isinstance(body, ChatRequest):
        max_tokens = body.max_completion_tokens or body.max_tokens or n_ctx
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        if body.top_logprobs is not None and not body.logprobs:
            raise ProtocolError("top_logprobs requires logprobs: true", "top_logprobs")
        schema = _json_schema(body.response_format)
    else:
        max_tokens = body.max_tokens or 16  # OpenAI's default for completions
        logprobs = body.logprobs
        schema = None
        if body.echo:
            raise ProtocolError("echo is not supported", "echo")
        if body.suffix:
            raise ProtocolError("suffix is not supported", "suffix")
        if body.best_of not in (None, 1, body.n):
            raise ProtocolError("best_of other than n is not supported", "best_of")
    bias: dict[int, float] = {}
    for key, value in (body.logit_bias or {}).items():
        if not key.isdigit() or int(key) >= n_vocab:
            raise ProtocolError(f"logit_bias key {key!r} is not a token id in [0, {n_vocab})", "logit_bias")
        bias[int(key)] = -math.inf if value <= -100 else float(value)
    if body.seed is not None and not 0 <= body.seed < 2**32:
        raise ProtocolError("seed must be in [0, 2**32)", "seed")
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    if any(not s for s in stop):
        raise ProtocolError("stop strings must not be empty", "stop")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else float(body.temperature),
        top_p=1.0 if body.top_p is None else float(body.top_p),
        top_k=body.top_k or 0,
        min_p=float(body.min_p or 0.0),
        seed=body.seed,
        presence_penalty=float(body.presence_penalty or 0.0),
        frequency_penalty=float(body.frequency_penalty or 0.0),
        repetition_penalty=float(body.repetition_penalty or 1.0),
        stop=stop,
        ignore_eos=body.ignore_eos,
        json_schema=schema,
        logit_bias=bias or None,
        logprobs=logprobs,
    )


def _json_schema(fmt: ResponseFormat | None) -> dict[str, Any] | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "object"}
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise ProtocolError("response_format json_schema needs json_schema.schema", "response_format")
    return fmt.json_schema.schema_


def _token_text(piece: bytes) -> str:
    return piece.decode("utf-8", "replace")


def chat_logprobs(entries: list[TokenLogprob]) -> dict[str, Any]:
    """``choices[i].logprobs`` of a chat completion (or chunk)."""
    return {
        "content": [
            {
                "token": _token_text(e.piece),
                "logprob": e.logprob,
                "bytes": list(e.piece),
                "top_logprobs": [
                    {"token": _token_text(c.piece), "logprob": c.logprob, "bytes": list(c.piece)}
                    for c in e.top
                ],
            }
            for e in entries
        ]
    }


def completion_logprobs(entries: list[TokenLogprob], offset: int = 0) -> dict[str, Any]:
    """``choices[i].logprobs`` of a (legacy) completion; ``offset``: characters before."""
    tokens = [_token_text(e.piece) for e in entries]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{_token_text(c.piece): c.logprob for c in e.top} for e in entries],
        "text_offset": offsets,
    }


def usage(prompt_metrics: list[RequestMetrics], all_metrics: list[RequestMetrics]) -> dict[str, Any]:
    """``usage``: prompt tokens once per prompt, completion tokens of every choice, and the
    speculative counters as an extension."""
    prompt = sum(m.prompt_tokens for m in prompt_metrics)
    completion = sum(m.completion_tokens for m in all_metrics)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(m.cached_tokens for m in prompt_metrics)},
        "speculative": {
            "drafted_tokens": sum(m.drafted for m in all_metrics),
            "accepted_tokens": sum(m.accepted for m in all_metrics),
        },
    }


def now() -> int:
    return int(time.time())
