"""The OpenAI wire format: request bodies (validated), their mapping onto the engine's
parameters, and the response objects and chunks.

Pure logic over plain data: no engine, no HTTP. Every rule about what a parameter means
lives here once. Tolerant where the ecosystem is: a field we do not know is accepted and
logged (``strict=True`` refuses it, as OpenAI does), the extension fields of vLLM, SGLang
and llama-server clients and routers are accepted with the types those servers accept, and
``null`` means absent wherever OpenAI documents a field as nullable.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
)

from ..logs import get_logger
from ..scheduler import RequestMetrics, SamplingParams
from ..scheduler.output import TokenLogprob
from ..session import ChatMessage, ChatOptions, InvalidArgumentError, InvalidConfigError, ToolCallDelta

__all__ = [
    "ApiCall",
    "ChatRequest",
    "CompletionRequest",
    "ProtocolError",
    "chat_logprobs",
    "completion_logprobs",
    "error_body",
    "parse",
    "usage",
]

log = get_logger("engine.server")

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


def error_body(
    message: str, type_: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class _Body(BaseModel):
    # strict: "5" is not 5, and true is not 1; unknown fields are kept (and logged, or
    # refused in strict mode: see parse)
    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(_Body):
    include_usage: StrictBool | None = None
    continuous_usage_stats: StrictBool | None = None  # (vLLM's) usage so far on every chunk


class JsonSchema(_Body):
    name: StrictStr | None = None
    description: StrictStr | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None


class _Sampling(_Body):
    """What completions and chat share: OpenAI's fields, then the extensions of vLLM,
    SGLang and llama-server that mean something here."""

    model: StrictStr
    n: Annotated[StrictInt, Field(ge=1, le=MAX_CHOICES)] | None = None
    stream: StrictBool | None = None
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
    # extensions (vLLM, SGLang, llama-server)
    top_k: Annotated[StrictInt, Field(ge=-1)] | None = None  # -1: off (vLLM)
    min_p: Annotated[Number, Field(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[Number, Field(gt=0)] | None = None
    min_tokens: Annotated[StrictInt, Field(ge=0)] | None = None
    ignore_eos: StrictBool | None = None
    skip_special_tokens: StrictBool | None = None
    stop_token_ids: list[Annotated[StrictInt, Field(ge=0)]] | None = None
    cache_prompt: StrictBool | None = None  # (llama-server) reuse a cached prefix
    grammar: StrictStr | None = None  # (llama-server) GBNF
    json_schema: dict[str, Any] | StrictStr | None = None  # (llama-server, SGLang)
    include_stop_str_in_output: StrictBool | None = None  # (vLLM) the stop string stays in the text
    no_stop_trim: StrictBool | None = None  # (SGLang) the same
    # accepted, not applied (routers send them on every request)
    spaces_between_special_tokens: StrictBool | None = None
    return_hidden_states: StrictBool | None = None
    # what the routers may send that cannot be honoured here: refused unless null or off
    regex: StrictStr | None = None
    ebnf: StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_grammar: StrictStr | None = None  # (vLLM's: EBNF/Lark, not GBNF)
    chat_template: StrictStr | None = None  # (vLLM: a template per request)
    # vLLM's structured outputs, older names
    guided_json: dict[str, Any] | StrictStr | None = None
    guided_choice: Annotated[list[StrictStr], Field(min_length=1)] | None = None

    def check_unsupported(self) -> None:
        for name in ("regex", "ebnf", "guided_regex", "guided_grammar", "chat_template"):
            if getattr(self, name):
                raise ProtocolError(f"{name} is not supported here (use json_schema or grammar)", name)
        if self.return_hidden_states:
            raise ProtocolError("return_hidden_states is not supported", "return_hidden_states")

    def gbnf(self) -> str | None:
        """The request's GBNF grammar: ``grammar`` (llama-server), or ``guided_choice``
        (vLLM: one of the strings)."""
        if self.guided_choice is not None:
            if self.grammar:
                raise ProtocolError("give grammar or guided_choice, not both", "guided_choice")
            return "root ::= " + " | ".join(json.dumps(c) for c in self.guided_choice)
        return self.grammar or None


class CompletionRequest(_Sampling):
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]] | None
    # a count of top log-probabilities; a router's boolean means off (false) or the
    # sampled token's own (true)
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)] | StrictBool | None = None
    echo: StrictBool | None = None
    suffix: StrictStr | None = None
    best_of: StrictInt | None = None

    def prompts(self, bos: int | None = None) -> list[str | list[int]]:
        """The prompts of a (possibly batched) completion request; ``null`` is OpenAI's
        default, the start of a document (the model's ``bos`` token)."""
        p = self.prompt
        if p is None:
            if bos is None:
                raise ProtocolError("prompt is required: the model has no start-of-document token", "prompt")
            return [[bos]]
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise ProtocolError("prompt must not be empty", "prompt")
        return [q for q in p if not isinstance(q, int)]


class ContentPart(_Body):
    type: StrictStr
    text: StrictStr | None = None


class FunctionCall(_Body):
    name: StrictStr
    arguments: StrictStr | None = None


class ToolCallIn(_Body):
    id: StrictStr | None = None
    type: Literal["function"] | None = None
    function: FunctionCall


class Message(_Body):
    """A chat message, with every field OpenAI's own responses carry (a client sends the
    history back as it received it)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[ContentPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: StrictStr | None = None
    refusal: StrictStr | None = None
    reasoning_content: StrictStr | None = None  # (llama-server, vLLM, DeepSeek) past thinking
    # in OpenAI's responses, not read by templates
    audio: dict[str, Any] | None = None
    function_call: dict[str, Any] | None = None
    annotations: list[Any] | None = None

    def as_template_message(self) -> dict[str, Any]:
        m: dict[str, Any] = {"role": self.role}
        c: str | list[dict[str, str]] | None = None
        if isinstance(self.content, list):
            for part in self.content:
                if part.type != "text" or part.text is None:
                    raise ProtocolError(
                        f"content parts of type {part.type!r} are not supported (text only)", "messages"
                    )
            c = [{"type": "text", "text": part.text or ""} for part in self.content]
        else:
            c = self.content
        for key, value in (
            ("content", c),
            ("name", self.name),
            ("tool_call_id", self.tool_call_id),
            ("reasoning_content", self.reasoning_content),
            ("refusal", self.refusal),
        ):
            if value is not None:
                m[key] = value
        if self.tool_calls:
            m["tool_calls"] = [
                {
                    "id": t.id or f"call_{i}",
                    "type": "function",
                    "function": {"name": t.function.name, "arguments": t.function.arguments or "{}"},
                }
                for i, t in enumerate(self.tool_calls)
            ]
        return m


class FunctionDef(_Body):
    name: Annotated[StrictStr, Field(min_length=1, max_length=64)]
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Body):
    name: StrictStr


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class ChatRequest(_Sampling):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    logprobs: StrictBool | None = None
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    reasoning_effort: StrictStr | None = None
    # accepted and not used, as an OpenAI client may send them
    metadata: dict[str, StrictStr] | None = None
    store: StrictBool | None = None
    service_tier: StrictStr | None = None
    # extensions (vLLM, SGLang, llama-server)
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: StrictBool | None = None
    continue_final_message: StrictBool | None = None
    include_reasoning: StrictBool | None = None  # false: the thinking is dropped
    separate_reasoning: StrictBool | None = None  # false: the thinking stays in the content
    stream_reasoning: StrictBool | None = None  # false: the thinking comes whole, before the content


@dataclass(frozen=True)
class ApiCall:
    """A validated request as the engine takes it: one engine request per choice."""

    body: CompletionRequest | ChatRequest
    params: SamplingParams
    prompts: list[Any]  #: text or token ids (completions), or one list of messages (chat)
    chat: ChatOptions | None

    @property
    def is_chat(self) -> bool:
        return isinstance(self.body, ChatRequest)

    @property
    def n(self) -> int:
        return self.body.n or 1

    @property
    def stream(self) -> bool:
        return bool(self.body.stream)

    @property
    def include_usage(self) -> bool:
        o = self.body.stream_options
        return bool(o and o.include_usage)

    @property
    def continuous_usage(self) -> bool:
        o = self.body.stream_options
        return bool(o and o.continuous_usage_stats)

    @property
    def cache_prompt(self) -> bool:
        return self.body.cache_prompt is not False

    @property
    def include_reasoning(self) -> bool:
        return not isinstance(self.body, ChatRequest) or self.body.include_reasoning is not False

    @property
    def stream_reasoning(self) -> bool:
        return not isinstance(self.body, ChatRequest) or self.body.stream_reasoning is not False

    @property
    def echo(self) -> bool:
        return isinstance(self.body, CompletionRequest) and bool(self.body.echo)

    def choices(self) -> list[tuple[int, Any]]:
        """``(index, prompt)`` per choice: choice ``i`` of prompt ``p`` has index ``p * n + i``."""
        n = self.n
        return [(p * n + i, prompt) for p, prompt in enumerate(self.prompts) for i in range(n)]


def parse(
    kind: type[CompletionRequest] | type[ChatRequest], raw: bytes, *, strict: bool = False
) -> CompletionRequest | ChatRequest:
    """The body of a request, validated.

    :raises ProtocolError: invalid JSON or values, or (``strict``) an unknown field.
    """
    try:
        body = kind.model_validate_json(raw)
    except ValidationError as exc:
        raise _validation_error(exc) from None
    unknown = list(_unknown_fields(body, ()))
    if unknown and strict:
        loc = unknown[0]
        raise ProtocolError(f"unrecognized request argument supplied: {loc}", loc, code="unknown_parameter")
    if unknown:
        log.debug("server.unknown_fields", fields=unknown)
    return body


def _unknown_fields(model: BaseModel, loc: tuple[str | int, ...]) -> Iterator[str]:
    for name in model.model_extra or ():
        yield ".".join(str(p) for p in (*loc, name))
    for name in type(model).model_fields:
        value = getattr(model, name)
        items = enumerate(value) if isinstance(value, list) else [(None, value)]
        for i, item in items:
            if isinstance(item, BaseModel):
                yield from _unknown_fields(item, (*loc, name) if i is None else (*loc, name, i))


#: what pydantic puts in an error's location for the member of a union it tried
_UNION_TAG = re.compile(r"[^a-z0-9_]|^(str|int|float|bool|dict|list|none)$")


def _validation_error(exc: ValidationError) -> ProtocolError:
    first = exc.errors()[0]
    parts = [p for p in first.get("loc", ()) if isinstance(p, int) or not _UNION_TAG.search(p)]
    loc = ".".join(str(part) for part in parts)
    if first.get("type") == "json_invalid":
        return ProtocolError("the request body is not valid JSON", code="invalid_json")
    if first.get("type") == "missing":
        return ProtocolError(f"missing required parameter: {loc}", loc, code="missing_required_parameter")
    return ProtocolError(f"invalid value for {loc}: {first.get('msg')}", loc, code="invalid_value")


def engine_call(
    body: CompletionRequest | ChatRequest, n_ctx: int, n_vocab: int, bos: int | None = None
) -> ApiCall:
    """What the engine runs for ``body``: its parameters, prompts and chat options
    (``bos``: the model's start-of-document token, if it has one).

    :raises ProtocolError: a value the engine cannot honour.
    """
    body.check_unsupported()
    chat: ChatOptions | None = None
    if isinstance(body, ChatRequest):
        max_tokens = body.max_completion_tokens or body.max_tokens or n_ctx
        if body.top_logprobs is not None and not body.logprobs:
            raise ProtocolError("top_logprobs requires logprobs: true", "top_logprobs")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        schema: dict[str, Any] | str | None = _json_schema(body.response_format)
        chat = _chat_options(body)
        prompts: list[Any] = [[m.as_template_message() for m in body.messages]]
    else:
        max_tokens = body.max_tokens or 16  # OpenAI's default for completions
        logprobs = None if body.logprobs is None or body.logprobs is False else int(body.logprobs)
        schema = None
        if body.suffix:
            raise ProtocolError("suffix is not supported", "suffix")
        if body.best_of not in (None, 1, body.n or 1):
            raise ProtocolError("best_of other than n is not supported", "best_of")
        if body.echo and logprobs is not None:
            raise ProtocolError("echo with logprobs is not supported (no prompt log-probabilities)", "echo")
        prompts = body.prompts(bos)
    for name in ("json_schema", "guided_json"):
        value = getattr(body, name)
        if value is not None:
            if schema is not None:
                raise ProtocolError(
                    "give one JSON schema (response_format, json_schema or guided_json)", name
                )
            schema = value
    grammar = body.gbnf()
    if schema is not None and grammar:
        raise ProtocolError("give a grammar or a JSON schema, not both", "grammar")
    if len(prompts) * (body.n or 1) > MAX_CHOICES:
        raise ProtocolError(f"at most {MAX_CHOICES} choices (prompts x n) per request", "n")
    bias: dict[int, float] = {}
    for key, value in (body.logit_bias or {}).items():
        if not key.isdigit() or int(key) >= n_vocab:
            raise ProtocolError(f"logit_bias key {key!r} is not a token id in [0, {n_vocab})", "logit_bias")
        bias[int(key)] = -math.inf if value <= -100 else float(value)
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    try:
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else float(body.temperature),
            top_p=1.0 if body.top_p is None else float(body.top_p),
            top_k=max(body.top_k or 0, 0),
            min_p=float(body.min_p or 0.0),
            seed=body.seed,
            presence_penalty=float(body.presence_penalty or 0.0),
            frequency_penalty=float(body.frequency_penalty or 0.0),
            repetition_penalty=float(body.repetition_penalty or 1.0),
            stop=stop,
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=bool(body.ignore_eos),
            grammar=grammar,
            json_schema=schema,
            logit_bias=bias or None,
            logprobs=logprobs,
            min_tokens=body.min_tokens or 0,
            skip_special_tokens=body.skip_special_tokens is not False,
            include_stop_str_in_output=bool(body.include_stop_str_in_output or body.no_stop_trim),
        )
    except InvalidConfigError as e:  # (SamplingParams' rules, naming the value: its API parameter)
        word = str(e).split(" ", 1)[0]
        raise ProtocolError(
            str(e), word if word in type(body).model_fields else None, code="invalid_value"
        ) from e
    return ApiCall(body, params, prompts, chat)


def _chat_options(body: ChatRequest) -> ChatOptions:
    kwargs = dict(body.chat_template_kwargs or {})
    thinking = kwargs.get("enable_thinking")
    if thinking is not None and not isinstance(thinking, bool):
        raise ProtocolError("chat_template_kwargs.enable_thinking must be a boolean", "chat_template_kwargs")
    if body.reasoning_effort == "none":
        thinking = False
    elif body.reasoning_effort is not None:
        kwargs["reasoning_effort"] = body.reasoning_effort
    if body.continue_final_message and body.add_generation_prompt:
        raise ProtocolError(
            "add_generation_prompt and continue_final_message cannot both be true", "continue_final_message"
        )
    if body.continue_final_message and body.messages[-1].role != "assistant":
        raise ProtocolError(
            "continue_final_message needs an assistant message last", "continue_final_message"
        )
    choice = body.tool_choice
    tools = [t.model_dump(exclude_none=True, by_alias=True) for t in body.tools or ()]
    if not tools and choice not in (None, "none", "auto"):
        raise ProtocolError("tool_choice requires tools", "tool_choice")
    return ChatOptions(
        tools=tools or None,
        tool_choice=choice.model_dump() if isinstance(choice, NamedToolChoice) else (choice or "auto"),
        parallel_tool_calls=body.parallel_tool_calls,
        add_generation_prompt=body.add_generation_prompt is not False,
        continue_final_message=bool(body.continue_final_message),
        template_kwargs=kwargs or None,
        enable_thinking=thinking is not False,
        reasoning=body.separate_reasoning is not False,
    )


def _json_schema(fmt: ResponseFormat | None) -> dict[str, Any] | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "object"}
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise ProtocolError("response_format json_schema needs json_schema.schema", "response_format")
    return fmt.json_schema.schema_


# --- responses ------------------------------------------------------------------------


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
        ],
        "refusal": None,
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


def chat_message(message: ChatMessage | None, text: str, include_reasoning: bool) -> dict[str, Any]:
    """``choices[i].message`` of a chat completion."""
    calls = message.tool_calls if message is not None else ()
    out: dict[str, Any] = {
        "role": "assistant",
        "content": None if calls and not text else text,
        "refusal": None,
    }
    if calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls
        ]
    if include_reasoning and message is not None and message.reasoning:
        out["reasoning_content"] = message.reasoning
    return out


def tool_call_deltas(calls: list[ToolCallDelta]) -> list[dict[str, Any]]:
    """``delta.tool_calls``: a call's first piece with its id and name, then arguments."""
    out = []
    for c in calls:
        d: dict[str, Any] = {"index": c.index}
        if c.id is not None:
            d["id"] = c.id
            d["type"] = "function"
            d["function"] = {"name": c.name, "arguments": c.arguments}
        else:
            d["function"] = {"arguments": c.arguments}
        out.append(d)
    return out


def finish_reason(reason: str | None, message: ChatMessage | None) -> str | None:
    """OpenAI's finish reason: ``tool_calls`` when the answer ends in calls."""
    if reason == "stop" and message is not None and message.tool_calls:
        return "tool_calls"
    return reason


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
