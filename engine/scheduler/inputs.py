"""Input processing: what a caller submits becomes a validated :class:`Request`.

Prompts (text, token ids or chat messages) are tokenized on the native thread without
blocking the event loop; chat messages (and tools) are rendered by the model's chat
template there first, which also gives the request its grammar (tool calls, a JSON schema)
and its output format. A ``resume_from`` checkpoint is checked against the engine's
fingerprint before anything else happens. Every rejection is a typed error raised to the
caller; the engine never sees a bad request.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeGuard

from ..session import InvalidArgumentError, Model, PromptTooLongError
from ..session.chat import ChatOptions, ChatTemplate
from .checkpoints import unpack_resume
from .params import SamplingParams
from .request import Request

if TYPE_CHECKING:
    from ..session.chat import ChatPrompt

__all__ = ["InputProcessor", "Prompt"]

Prompt = str | Sequence[int] | Sequence[Mapping[str, Any]]


def is_messages(prompt: Any) -> TypeGuard[Sequence[Mapping[str, Any]]]:
    """Whether ``prompt`` is a list of chat messages (dicts)."""
    return isinstance(prompt, list | tuple) and bool(prompt) and all(isinstance(m, Mapping) for m in prompt)


class InputProcessor:
    """Turns submissions into requests for one engine (its model, context, fingerprint and
    chat template: None when the model has none)."""

    def __init__(
        self,
        model: Model,
        n_ctx: int,
        fingerprint: dict[str, Any],
        with_draft: bool,
        template: ChatTemplate | None = None,
    ) -> None:
        self.model = model
        self.n_ctx = n_ctx
        self.fingerprint = fingerprint
        self.with_draft = with_draft
        self.template = template

    async def request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams,
        *,
        resume_from: bytes | None,
        priority: int,
        want_checkpoint: bool,
        arrival_index: int,
        chat: ChatOptions | None = None,
    ) -> Request:
        """:raises InvalidArgumentError, PromptTooLongError, StateError:"""
        resume = (
            unpack_resume(resume_from, self.fingerprint, self.with_draft) if resume_from is not None else None
        )
        rendered = None
        if is_messages(prompt):
            rendered, params = await self.render(prompt, params, chat)
            tokens = await self.model.atokenize(
                rendered.prompt, add_special=resume is None, parse_special=True
            )
        elif chat is not None:
            raise InvalidArgumentError("chat options apply to chat messages only", reason="chat options")
        else:
            tokens = await self.tokens(prompt, add_special=resume is None)
        if resume is not None:
            tokens = [resume.last, *tokens]  # the last sampled token is not in the KV cache yet
        elif not tokens:
            raise InvalidArgumentError("the prompt is empty", reason="empty prompt")
        n_vocab = self.model.n_vocab
        bad = [t for t in tokens if not isinstance(t, int) or not 0 <= t < n_vocab]
        if bad:
            raise InvalidArgumentError(f"token id {bad[0]!r} outside [0, {n_vocab})", reason="bad token")
        n_past = len(resume.history) if resume else 0
        if n_past + len(tokens) >= self.n_ctx:
            raise PromptTooLongError(
                f"prompt has {n_past + len(tokens)} tokens; a sequence holds {self.n_ctx}",
                size=n_past + len(tokens),
                maximum=self.n_ctx - 1,
            )
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(4), "little")
        r = Request(
            request_id, tokens, params, seed, priority, arrival_index, resume, want_checkpoint, rendered
        )
        if resume is not None:
            r.history = list(resume.history)
            r.n_prompt_history = resume.n_prompt
            r.drafter_in_sync = resume.drafter_in_sync
        r.to_prefill = list(tokens)
        r.metrics.prompt_tokens = len(tokens) - (1 if resume else 0)
        return r

    async def render(
        self, messages: Sequence[Mapping[str, Any]], params: SamplingParams, options: ChatOptions | None
    ) -> tuple[ChatPrompt, SamplingParams]:
        """Chat messages through the template: the prompt, and the request's parameters with
        the template's stop strings; a JSON schema becomes part of the template's grammar.

        :raises InvalidArgumentError: no template, or messages and tools it cannot render.
        """
        if self.template is None:
            raise InvalidArgumentError(
                "the model has no chat template: send a text prompt, or give the engine one (chat_template)",
                reason="no template",
            )
        options = options or ChatOptions()
        if options.tools and options.tool_choice != "none" and params.grammar is not None:
            raise InvalidArgumentError(
                "a grammar cannot constrain an answer that may call tools", reason="grammar"
            )
        rendered = await self.template.arender(messages, options, json_schema=params.json_schema)
        stop = tuple(dict.fromkeys((*params.stop, *rendered.stops)))
        if stop != params.stop or params.json_schema is not None:
            params = replace(params, stop=stop, json_schema=None)  # (the template's grammar holds the schema)
        return rendered, params

    async def tokens(self, prompt: Prompt, add_special: bool) -> list[int]:
        """Token ids of a prompt: text or token ids.

        :raises InvalidArgumentError: anything else.
        """
        model = self.model
        if isinstance(prompt, str):
            return (
                await model.atokenize(prompt, add_special=add_special, parse_special=True) if prompt else []
            )
        items = list(prompt) if isinstance(prompt, list | tuple) else None
        ids = [t for t in items or () if isinstance(t, int) and not isinstance(t, bool)]
        if items is not None and len(ids) == len(items):
            return ids
        raise InvalidArgumentError(
            "prompt must be a string, a list of token ids or a list of chat messages", reason="bad prompt"
        )
