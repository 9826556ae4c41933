"""Input processing: what a caller submits becomes a validated :class:`Request`.

Prompts (text, token ids or chat messages) are tokenized on the native thread without
blocking the event loop; a ``resume_from`` checkpoint is checked against the engine's
fingerprint before anything else happens. Every rejection is a typed error raised to the
caller; the engine never sees a bad request.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from ..session import InvalidArgumentError, Model, PromptTooLongError
from .checkpoints import unpack_resume
from .params import SamplingParams
from .request import Request

__all__ = ["InputProcessor", "Prompt"]

Prompt = str | Sequence[int] | Sequence[dict[str, str]]


class InputProcessor:
    """Turns submissions into requests for one engine (its model, context and fingerprint)."""

    def __init__(self, model: Model, n_ctx: int, fingerprint: dict[str, Any], with_draft: bool) -> None:
        self.model = model
        self.n_ctx = n_ctx
        self.fingerprint = fingerprint
        self.with_draft = with_draft

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
    ) -> Request:
        """:raises InvalidArgumentError, PromptTooLongError, StateError:"""
        resume = (
            unpack_resume(resume_from, self.fingerprint, self.with_draft) if resume_from is not None else None
        )
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
        r = Request(request_id, tokens, params, seed, priority, arrival_index, resume, want_checkpoint)
        if resume is not None:
            r.history = list(resume.history)
            r.n_prompt_history = resume.n_prompt
            r.drafter_in_sync = resume.drafter_in_sync
        r.to_prefill = list(tokens)
        r.metrics.prompt_tokens = len(tokens) - (1 if resume else 0)
        return r

    async def tokens(self, prompt: Prompt, add_special: bool) -> list[int]:
        """Token ids of a prompt: text, token ids, or chat messages (the model's template).

        :raises InvalidArgumentError: anything else.
        """
        model = self.model
        if isinstance(prompt, str):
            return (
                await model.atokenize(prompt, add_special=add_special, parse_special=True) if prompt else []
            )
        items = list(prompt) if isinstance(prompt, list | tuple) else None
        if items and all(isinstance(m, dict) for m in items):
            text = await model.aapply_chat_template(items)
            return await model.atokenize(text, add_special=add_special, parse_special=True)
        ids = [t for t in items or () if isinstance(t, int) and not isinstance(t, bool)]
        if items is not None and len(ids) == len(items):
            return ids
        raise InvalidArgumentError(
            "prompt must be a string, a list of token ids or a list of chat messages", reason="bad prompt"
        )
