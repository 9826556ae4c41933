"""A terminal chatbot on the engine: streamed replies in the model's chat template, and
multi-turn conversations that do not re-read their history.

Each turn sends the whole conversation, as an OpenAI-style client does; the engine's prefix
cache finds the previous turn's sequence still in its slot and reads only the new tokens.
Each reply also ends with the sequence's state (``checkpoint=True``): ``/save FILE`` writes
the messages and that state to disk, ``/load FILE`` resumes it (``resume_from``, feeding
only the end of the assistant's turn and the next user message, rendered by the same
template), in this process or another one started with the same models and options. An
engine without a prefix cache (turned off, or a recurrent target) resumes every turn so.
"""

from __future__ import annotations

import base64
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import anyio

from .scheduler import Engine, RequestOutput, SamplingParams
from .session import SessionError, StateError
from .session.checkpoint import unpack

__all__ = ["ChatSession", "Conversation", "TurnResult", "chat_loop"]

Message = dict[str, str]

#: stands for the assistant's reply when rendering, to find the text that closes its turn
_REPLY = "@@engine-reply@@"

HELP = """commands:
  /save FILE   write the conversation (messages and KV state) to FILE
  /load FILE   continue a saved conversation
  /reset       start over
  /quit        leave (also Ctrl-D)"""


@dataclass
class Conversation:
    """The messages so far and, after a reply, the sequence state that holds them."""

    messages: list[Message] = field(default_factory=list)
    checkpoint: bytes | None = None
    #: loaded from disk: the next turn resumes from the checkpoint (no cache holds it yet)
    resume_next: bool = False

    def save(self, path: str | Path) -> None:
        data = {
            "format": "engine-chat/1",
            "messages": self.messages,
            "checkpoint": base64.b64encode(self.checkpoint).decode() if self.checkpoint else None,
        }
        Path(path).write_text(json.dumps(data, ensure_ascii=False))

    @classmethod
    def load(cls, path: str | Path) -> Conversation:
        try:
            data = json.loads(Path(path).read_text())
            if data.get("format") != "engine-chat/1":
                raise ValueError("not a saved conversation")
            messages = [{"role": str(m["role"]), "content": str(m["content"])} for m in data["messages"]]
            ck = data.get("checkpoint")
            return cls(messages, base64.b64decode(ck) if ck else None, resume_next=ck is not None)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"cannot load {path}: {exc}") from None


@dataclass
class TurnResult:
    text: str
    finish_reason: str
    completion_tokens: int
    tokens_per_s: float
    drafted: int
    accepted: int
    ttft: float | None
    prompt_tokens: int  #: tokens read for this turn (only the new ones when reused)
    cached_tokens: int  #: tokens of history not read again (prefix cache or checkpoint)
    cold_ttft: float | None = None  #: the same turn from scratch (when measured)

    def status(self) -> str:
        rate = self.accepted / self.drafted if self.drafted else 0.0
        parts = [
            f"{self.completion_tokens} tokens, {self.tokens_per_s:.1f} tok/s",
            f"drafted {self.drafted}, accepted {self.accepted} ({rate:.0%})",
        ]
        if self.ttft is not None:
            ttft = f"TTFT {1000 * self.ttft:.0f} ms"
            if self.cached_tokens:
                ttft += f", {self.prompt_tokens} new tokens on {self.cached_tokens} cached"
                if self.cold_ttft is not None:
                    ttft += f" (cold start {1000 * self.cold_ttft:.0f} ms, {self.cold_ttft / self.ttft:.1f}x)"
            else:
                ttft += f", {self.prompt_tokens} prompt tokens"
            parts.append(ttft)
        return "[" + " · ".join(parts) + "]"


class ChatSession:
    """One conversation on an engine."""

    def __init__(self, engine: Engine, params: SamplingParams, system: str | None = None) -> None:
        self.engine = engine
        self.params = params
        self.system = system
        self.conversation = Conversation(self._start())

    def _start(self) -> list[Message]:
        return [{"role": "system", "content": self.system}] if self.system else []

    def reset(self) -> None:
        self.conversation = Conversation(self._start())

    async def _continuation(self, user: Message) -> tuple[list[int], int] | None:
        """The tokens that extend the saved sequence by the end of the assistant's turn and
        the user's message, and how many tokens the sequence holds; None when the template
        or the saved state does not allow that (then the whole conversation is read again)."""
        conv = self.conversation
        if conv.checkpoint is None or not conv.messages or conv.messages[-1]["role"] != "assistant":
            return None
        try:
            meta = unpack(conv.checkpoint).meta
            last, n_cached = int(meta["last"]), len(meta["history"])
        except (StateError, KeyError, TypeError, ValueError):
            return None
        model = self.engine.model
        prev = conv.messages
        base = await model.aapply_chat_template(prev, add_assistant=False)
        full = await model.aapply_chat_template([*prev, user], add_assistant=True)
        marked = await model.aapply_chat_template(
            [*prev[:-1], {"role": "assistant", "content": _REPLY}], add_assistant=False
        )
        if not full.startswith(base) or _REPLY not in marked:
            return None
        closing = marked[marked.index(_REPLY) + len(_REPLY) :]
        # the sequence ends with the last sampled token: an end-of-turn token closes the
        # turn itself (a reply cut by max_tokens needs the whole closing)
        if model.is_eog(last):
            piece = model.token_to_piece(last, special=True).decode("utf-8", "replace")
            if not closing.startswith(piece):
                return None
            closing = closing[len(piece) :]
        tokens = await model.atokenize(closing + full[len(base) :], add_special=False, parse_special=True)
        return tokens, n_cached

    async def _stream(
        self, prompt: Any, resume: bytes | None, on_text: Callable[[str], None] | None
    ) -> RequestOutput:
        final = None
        async for delta in self.engine.stream(prompt, self.params, resume_from=resume, checkpoint=True):
            if delta.text and on_text is not None:
                on_text(delta.text)
            final = delta.output or final
        assert final is not None  # the last delta carries the result
        return final

    async def reply(
        self, text: str, on_text: Callable[[str], None] | None = None, measure_cold: bool = False
    ) -> TurnResult:
        """Answer one user message, streaming the reply's text to ``on_text``."""
        user = {"role": "user", "content": text}
        conv = self.conversation
        resume_turn = conv.resume_next or not self.engine.prefix_cache
        continuation = await self._continuation(user) if resume_turn else None
        prompt: Any
        if continuation is not None:
            (prompt, cached), resume = continuation, conv.checkpoint
        else:  # the whole conversation: the prefix cache holds what the last turn left
            prompt, cached, resume = [*conv.messages, user], 0, None
        try:
            final = await self._stream(prompt, resume, on_text)
        except StateError:
            if resume is None:
                raise
            # the saved state does not fit this engine (other models or options): read it all
            prompt, cached = [*conv.messages, user], 0
            final = await self._stream(prompt, None, on_text)
        m = final.metrics
        conv.messages += [user, {"role": "assistant", "content": final.text}]
        conv.checkpoint, conv.resume_next = final.checkpoint, False
        result = TurnResult(
            final.text,
            final.finish_reason,
            m.completion_tokens,
            m.tokens_per_s,
            m.drafted,
            m.accepted,
            m.ttft,
            m.prompt_tokens - m.cached_tokens,
            cached or m.cached_tokens,
        )
        if measure_cold and result.cached_tokens:
            # the same turn read from scratch, for comparison (one token is enough)
            cold = await self.engine.generate(
                [*conv.messages[:-1]], SamplingParams(max_tokens=1), cache_prompt=False
            )
            result.cold_ttft = cold.metrics.ttft
        return result


async def chat_loop(
    engine: Engine,
    params: SamplingParams,
    *,
    system: str | None = None,
    measure_cold: bool = True,
    stdin: TextIO | None = None,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
) -> int:
    """Read user lines until EOF or /quit; answer each. Returns an exit status."""
    stdin, stdout, stderr = stdin or sys.stdin, stdout or sys.stdout, stderr or sys.stderr
    chat = ChatSession(engine, params, system)
    interactive = stdin.isatty()
    if interactive:
        print("Type a message, or /help.", file=stderr)

    def write(text: str) -> None:
        stdout.write(text)
        stdout.flush()

    while True:
        if interactive:
            write("\n> ")
        line = await anyio.to_thread.run_sync(stdin.readline)
        if not line:
            break
        line = line.strip()
        if not line:
            continue
        if line.startswith("/"):
            cmd, _, arg = line.partition(" ")
            arg = arg.strip()
            if cmd == "/quit":
                break
            elif cmd == "/help":
                print(HELP, file=stderr)
            elif cmd == "/reset":
                chat.reset()
                print("[new conversation]", file=stderr)
            elif cmd == "/save" and arg:
                chat.conversation.save(arg)
                print(f"[saved {len(chat.conversation.messages)} messages to {arg}]", file=stderr)
            elif cmd == "/load" and arg:
                try:
                    chat.conversation = Conversation.load(arg)
                except ValueError as exc:
                    print(f"error: {exc}", file=stderr)
                    continue
                print(f"[loaded {len(chat.conversation.messages)} messages from {arg}]", file=stderr)
            else:
                print(f"unknown command {line!r}\n{HELP}", file=stderr)
            continue
        t0 = time.perf_counter()
        try:
            result = await chat.reply(line, write, measure_cold=measure_cold)
        except SessionError as exc:  # e.g. the conversation no longer fits the context
            print(f"\nerror: {exc}", file=stderr)
            continue
        write("\n")
        print(f"{result.status()} {time.perf_counter() - t0:.1f} s", file=stderr, flush=True)
    return 0
