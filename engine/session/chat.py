"""Chat through llama.cpp's chat module: the model's own Jinja template renders messages
and tools, and the template's parser reads reasoning and tool calls back out of the text.

:class:`ChatTemplate` renders on the runtime's native thread (it holds the model).
:class:`ChatParser` holds no llama.cpp object: each request's parser runs on its
consumer's thread. A GGUF without a template falls back to one of llama.cpp's built-in
renderers, chosen by architecture (they know no tools).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .errors import InvalidArgumentError

if TYPE_CHECKING:
    from .. import _nb_spec
    from .model import Model

    ChatPrompt = _nb_spec.ChatPrompt

__all__ = [
    "ChatMessage",
    "ChatOptions",
    "ChatParser",
    "ChatPrompt",
    "ChatTemplate",
    "ToolCall",
    "ToolCallDelta",
    "builtin_template",
]


def __getattr__(name: str) -> Any:
    if name == "ChatPrompt":  # the extension's type, loaded with the extension
        from .. import _nb_spec

        return _nb_spec.ChatPrompt
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: llama.cpp built-in renderers for GGUF files without a template of their own, by architecture
_BUILTIN_TEMPLATES = (("gemma", "gemma"), ("llama", "llama3"), ("qwen", "chatml"))
#: what a message may carry that the templates read; the rest (OpenAI's ``refusal``,
#: ``audio``, ``annotations``...) is response metadata a client echoes back
_MESSAGE_FIELDS = ("role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content")


def builtin_template(arch: str) -> str:
    """The built-in renderer for a GGUF of architecture ``arch`` without a template ("": none)."""
    return next((name for prefix, name in _BUILTIN_TEMPLATES if arch.startswith(prefix)), "")


@dataclass(frozen=True)
class ChatOptions:
    """How chat messages are rendered and the answer read.

    ``tools``: OpenAI function tools (``{"type": "function", "function": {"name",
    "description", "parameters"}}``). ``tool_choice``: ``"auto"``, ``"none"``,
    ``"required"``, or one function (its name, or OpenAI's ``{"type": "function",
    "function": {"name": ...}}``); required and named calls are constrained by a grammar,
    so even a weak model answers with a well-formed call. ``parallel_tool_calls``: None
    takes what the template supports. ``reasoning``: a thinking model's thinking comes back
    separately (``reasoning``), not in the content. ``continue_final_message``: the last
    (assistant) message is continued instead of a new turn begun.
    """

    tools: Sequence[Mapping[str, Any]] | None = None
    tool_choice: str | Mapping[str, Any] = "auto"
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: Mapping[str, Any] | None = None
    enable_thinking: bool = True
    reasoning: bool = True

    def __post_init__(self) -> None:
        if self.continue_final_message and self.add_generation_prompt:
            object.__setattr__(self, "add_generation_prompt", False)  # continuing is not a new turn

    @property
    def tool_choice_name(self) -> str:
        """``tool_choice`` as the chat module takes it: a mode or one function's name."""
        c = self.tool_choice
        if isinstance(c, str):
            return c
        function = c.get("function") if isinstance(c, Mapping) else None
        name = function.get("name") if isinstance(function, Mapping) else None
        if not isinstance(name, str) or not name:
            raise InvalidArgumentError(
                'tool_choice must be "auto", "none", "required" or {"type": "function", "function": {"name": ...}}',
                reason="bad tool_choice",
            )
        return name


@dataclass(frozen=True)
class ToolCall:
    """A call the model made: ``arguments`` is JSON text, as OpenAI returns it."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of a streamed tool call: the first of a call carries its ``id`` and ``name``,
    later ones fragments of its ``arguments`` (OpenAI's incremental form)."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(frozen=True)
class ChatMessage:
    """The answer as the template's format reads it."""

    content: str
    reasoning: str = ""
    tool_calls: tuple[ToolCall, ...] = field(default=())


def _clean_message(i: int, m: Any) -> dict[str, Any]:
    if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
        raise InvalidArgumentError(f"message {i} must be a dict with a string 'role'", reason="bad message")
    out = {k: m[k] for k in _MESSAGE_FIELDS if m.get(k) is not None}  # null means absent
    if "content" not in out and not out.get("tool_calls"):
        if out["role"] != "assistant":
            raise InvalidArgumentError(f"message {i} ({out['role']}) has no content", reason="bad message")
        out.pop("tool_calls", None)
        out["content"] = m.get("refusal") or ""  # e.g. an assistant's refusal copied back
    return out


class ChatTemplate:
    """A model's chat template (or ``override``: Jinja source, or a llama.cpp built-in name).

    :raises InvalidConfigError: the chat module cannot use the template (the error names it).
    """

    def __init__(self, model: Model, override: str | None = None) -> None:
        from .. import _nb_spec

        self.model = model
        self.native = _nb_spec.ChatTemplate.create(
            model.native, override or "", builtin_template(model.info.arch)
        )

    @property
    def name(self) -> str:
        """Which template this is, for messages: the model's, a given one, or a built-in."""
        return self.native.name

    @property
    def source(self) -> str:
        return self.native.source

    @property
    def jinja(self) -> bool:
        """False for llama.cpp's built-in renderers (the fallback), which cannot render tools."""
        return self.native.jinja

    @property
    def caps(self) -> dict[str, bool]:
        """What the template supports (``supports_tool_calls``, ``supports_parallel_tool_calls``...)."""
        return dict(self.native.caps)

    def inputs(
        self,
        messages: Sequence[Mapping[str, Any]],
        options: ChatOptions | None = None,
        json_schema: str | Mapping[str, Any] | None = None,
    ) -> _nb_spec.ChatInputs:
        """What the chat module renders: messages as OpenAI shapes them (nulls absent).

        :raises InvalidArgumentError: malformed messages or options.
        """
        o = options or ChatOptions()
        items = list(messages) if isinstance(messages, Sequence) and not isinstance(messages, str) else None
        if not items:
            raise InvalidArgumentError("messages must be a non-empty list of dicts", reason="no messages")
        from .. import _nb_spec

        inputs = _nb_spec.ChatInputs()
        try:
            inputs.messages = json.dumps([_clean_message(i, m) for i, m in enumerate(items)])
            inputs.tools = json.dumps(list(o.tools)) if o.tools else ""
            inputs.template_kwargs = json.dumps(dict(o.template_kwargs)) if o.template_kwargs else ""
            if json_schema is not None:
                inputs.json_schema = json_schema if isinstance(json_schema, str) else json.dumps(json_schema)
        except (TypeError, ValueError) as exc:
            raise InvalidArgumentError(f"messages and tools must be JSON: {exc}", reason="not json") from None
        inputs.tool_choice = o.tool_choice_name
        parallel = o.parallel_tool_calls
        inputs.parallel_tool_calls = (
            self.caps.get("supports_parallel_tool_calls", False) if parallel is None else parallel
        )
        inputs.add_generation_prompt = o.add_generation_prompt
        inputs.continue_final_message = o.continue_final_message
        inputs.enable_thinking = o.enable_thinking
        inputs.parse_reasoning = o.reasoning
        return inputs

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        options: ChatOptions | None = None,
        json_schema: str | Mapping[str, Any] | None = None,
    ) -> ChatPrompt:
        """The prompt text and what the answer needs (grammar, stops, parser).

        :raises InvalidArgumentError: messages or tools the template cannot render.
        """
        return self.native.render(self.inputs(messages, options, json_schema))

    async def arender(
        self,
        messages: Sequence[Mapping[str, Any]],
        options: ChatOptions | None = None,
        json_schema: str | Mapping[str, Any] | None = None,
    ) -> ChatPrompt:
        """:meth:`render` without blocking the event loop."""
        inputs = self.inputs(messages, options, json_schema)
        prompt: ChatPrompt = await self.model.runtime.wait(self.native.render_async(inputs))
        return prompt


class ChatParser:
    """Reads one answer as it grows: :meth:`update` returns what new text adds to the
    message (``(reasoning, content, tool_call_deltas)``); ``final=True`` at the end."""

    def __init__(self, prompt: ChatPrompt) -> None:
        from .. import _nb_spec

        self._native = _nb_spec.ChatParser(prompt)

    def update(self, text: str, final: bool = False) -> tuple[str, str, list[ToolCallDelta]]:
        d = self._native.update(text, final)
        calls = [ToolCallDelta(c.index, c.id or None, c.name or None, c.arguments) for c in d.tool_calls]
        return d.reasoning, d.content, calls

    def message(self) -> ChatMessage:
        m = self._native.message()
        return ChatMessage(
            m.content, m.reasoning, tuple(ToolCall(c.id, c.name, c.arguments) for c in m.tool_calls)
        )
