"""Models, contexts and token batches: the Python face of the native objects.

Every method runs on the runtime's native thread (the calling thread waits with the GIL
released); ``*_async`` variants return immediately and are awaited with
``runtime.wait``.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import _nb_spec
from .chat import ChatOptions, ChatTemplate
from .config import ContextConfig
from .errors import InvalidArgumentError
from .runtime import Runtime

__all__ = ["Batch", "Context", "Model", "ModelInfo", "STATE_SEQ_FLAGS_PARTIAL_ONLY"]

ModelInfo = _nb_spec.ModelInfo
STATE_SEQ_FLAGS_PARTIAL_ONLY: int = _nb_spec.STATE_SEQ_FLAGS_PARTIAL_ONLY


@dataclass
class Batch:
    """Tokens to decode: per entry a token, its position, its sequence, and whether its
    logits are wanted. Keep each sequence's entries contiguous (EAGLE-3 relies on it)."""

    tokens: list[int] = field(default_factory=list)
    pos: list[int] = field(default_factory=list)
    seq: list[int] = field(default_factory=list)
    logits: list[bool] = field(default_factory=list)

    def add(self, token: int, pos: int, seq_id: int, logits: bool = False) -> int:
        """Append one entry; returns its index in the batch."""
        self.tokens.append(token)
        self.pos.append(pos)
        self.seq.append(seq_id)
        self.logits.append(logits)
        return len(self.tokens) - 1

    def add_sequence(self, tokens: Iterable[int], pos0: int, seq_id: int, *, logits: str = "last") -> None:
        """Append consecutive tokens of one sequence from position ``pos0``.

        ``logits``: ``"last"``, ``"all"`` or ``"none"``.
        """
        toks = list(tokens)
        for i, t in enumerate(toks):
            want = logits == "all" or (logits == "last" and i == len(toks) - 1)
            self.add(t, pos0 + i, seq_id, want)

    def clear(self) -> None:
        self.tokens.clear()
        self.pos.clear()
        self.seq.clear()
        self.logits.clear()

    def __len__(self) -> int:
        return len(self.tokens)

    def args(self) -> tuple[list[int], list[int], list[int], list[bool]]:
        return self.tokens, self.pos, self.seq, self.logits


def _fingerprint(path: str) -> str:
    """Identity of a model file: size plus a digest of its first MiB (header + metadata)."""
    h = hashlib.sha256()
    h.update(str(os.path.getsize(path)).encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
    return h.hexdigest()[:32]


class Model:
    """A GGUF model loaded on a runtime's native thread.

    :raises ModelLoadError: missing, empty, truncated or non-GGUF file, or a file the
        pinned llama.cpp would abort on (e.g. an EAGLE-3 draft with more than one layer).
    """

    def __init__(self, runtime: Runtime, native: _nb_spec.Model, fingerprint: str) -> None:
        self.runtime = runtime
        self.native = native
        self.info: _nb_spec.ModelInfo = native.info
        self.fingerprint = fingerprint

    @classmethod
    def load(
        cls,
        runtime: Runtime,
        path: str | os.PathLike[str],
        *,
        n_gpu_layers: int = 0,
        mtp: bool = False,
        vocab_only: bool = False,
    ) -> Model:
        """Load a model; ``mtp=True`` also loads its NextN/MTP layers (for MTP drafting)."""
        p = os.fspath(path)
        native = _nb_spec.Model.load(
            runtime.native, p, n_gpu_layers=n_gpu_layers, load_mtp=mtp, vocab_only=vocab_only
        )
        return cls(runtime, native, _fingerprint(p))

    @property
    def n_vocab(self) -> int:
        return self.info.n_vocab

    def chat_template(self, override: str | None = None) -> ChatTemplate:
        """The chat template messages are rendered with: the GGUF's own (Jinja, through
        llama.cpp's chat module), else llama.cpp's built-in renderer for its architecture;
        ``override`` (Jinja source, or a built-in name) replaces it. Created on first use,
        then kept (for ``override`` None).

        :raises InvalidConfigError: the model has none, or the chat module refuses it.
        """
        if override:
            return ChatTemplate(self, override)
        cached = self.__dict__.get("_chat_template")
        if cached is None:
            cached = self.__dict__["_chat_template"] = ChatTemplate(self)
        return cached

    @property
    def metadata(self) -> dict[str, str]:
        return dict(self.info.metadata)

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        return self.native.tokenize(text, add_special, parse_special)

    async def atokenize(
        self, text: str, *, add_special: bool = True, parse_special: bool = False
    ) -> list[int]:
        """:meth:`tokenize` without blocking the event loop."""
        return list(await self.runtime.wait(self.native.tokenize_async(text, add_special, parse_special)))

    def detokenize(
        self, tokens: Sequence[int], *, remove_special: bool = False, unparse_special: bool = False
    ) -> str:
        """Text of ``tokens`` (invalid UTF-8 at the end is replaced)."""
        return self.detokenize_bytes(
            tokens, remove_special=remove_special, unparse_special=unparse_special
        ).decode("utf-8", "replace")

    def detokenize_bytes(
        self, tokens: Sequence[int], *, remove_special: bool = False, unparse_special: bool = False
    ) -> bytes:
        return self.native.detokenize(list(tokens), remove_special, unparse_special)

    def token_to_piece(self, token: int, *, special: bool = False) -> bytes:
        """The bytes of one token (may be part of a multi-byte character)."""
        return self.native.token_to_piece(token, special)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_assistant: bool = True,
        template: str | None = None,
    ) -> str:
        """Render chat messages (OpenAI's shape) with the model's chat template.

        :raises InvalidArgumentError: malformed messages.
        :raises InvalidConfigError: no usable template.
        """
        options = ChatOptions(add_generation_prompt=add_assistant)
        return self.chat_template(template).render(messages, options).prompt

    async def aapply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_assistant: bool = True,
        template: str | None = None,
    ) -> str:
        """:meth:`apply_chat_template` without blocking the event loop."""
        options = ChatOptions(add_generation_prompt=add_assistant)
        return (await self.chat_template(template).arender(messages, options)).prompt

    def is_eog(self, token: int) -> bool:
        return token in self._eog

    @property
    def _eog(self) -> frozenset[int]:
        eog = self.__dict__.get("_eog_cache")
        if eog is None:
            eog = self.__dict__["_eog_cache"] = frozenset(self.info.eog_tokens)
        return eog


class Context:
    """A llama.cpp context over a model: KV cache for ``n_seq`` sequences.

    ``other`` is the target context a draft context reads from (EAGLE-3, DFlash, MTP).
    """

    def __init__(self, model: Model, native: _nb_spec.Context) -> None:
        self.model = model
        self.native = native

    @classmethod
    def create(
        cls,
        model: Model,
        config: ContextConfig,
        *,
        kind: str = "default",
        other: Context | None = None,
        n_rs_seq: int = 0,
        n_outputs_max: int = 0,
        n_outputs_max_per_seq: int = 0,
    ) -> Context:
        """Create a context. ``kind``: ``"default"`` or ``"mtp"`` (an MTP draft context)."""
        p = config.native()
        p.n_rs_seq = n_rs_seq
        p.n_outputs_max = n_outputs_max
        p.n_outputs_max_per_seq = n_outputs_max_per_seq
        if kind not in ("default", "mtp"):
            raise InvalidArgumentError(f"unknown context kind {kind!r}", reason="bad kind")
        p.kind = _nb_spec.ContextKind.MTP if kind == "mtp" else _nb_spec.ContextKind.DEFAULT
        native = _nb_spec.Context.create(model.native, p, other.native if other else None)
        return cls(model, native)

    @property
    def params(self) -> _nb_spec.ContextParams:
        """The parameters as llama.cpp resolved them (n_ctx may be rounded up)."""
        return self.native.params

    @property
    def n_ctx(self) -> int:
        return self.params.n_ctx

    @property
    def n_seq(self) -> int:
        return self.params.n_seq

    @property
    def n_batch(self) -> int:
        return self.params.n_batch

    @property
    def is_mtp(self) -> bool:
        return self.params.kind == _nb_spec.ContextKind.MTP

    def decode(self, batch: Batch) -> int:
        """Decode a batch; returns the number of outputs (rows of :attr:`logits`).

        :raises InvalidArgumentError: bad tokens, positions or sizes (checked first).
        :raises BadSeqIdError: a sequence id outside ``[0, n_seq)``.
        :raises DecodeError: llama.cpp failed (e.g. the KV cache is full).
        """
        return self.native.decode(*batch.args())

    def decode_async(self, batch: Batch) -> Any:
        """Submit a decode; await the returned ticket with ``runtime.wait``."""
        return self.native.decode_async(*batch.args())

    @property
    def logits(self) -> np.ndarray:
        """Logits of the last decode's outputs, shape ``(n_outputs, n_vocab)``, in batch
        order. A view of llama.cpp's buffer without copying: valid only until the next
        decode on this context; copy it to keep it."""
        return self.native.logits

    @property
    def embeddings(self) -> np.ndarray:
        """Embeddings of the last decode's outputs (context created with embeddings=True);
        a view without copying, valid until the next decode."""
        return self.native.embeddings

    def kv_remove(self, seq_id: int | None = None, p0: int | None = None, p1: int | None = None) -> bool:
        """Remove cells of ``seq_id`` (None: all) in ``[p0, p1)`` (None: open end)."""
        return self.native.kv_remove(
            -1 if seq_id is None else seq_id, -1 if p0 is None else p0, -1 if p1 is None else p1
        )

    def seq_pos_max(self, seq_id: int) -> int:
        """Largest position held for a sequence, -1 when empty."""
        return self.native.seq_pos_max(seq_id)

    def seq_pos_min(self, seq_id: int) -> int:
        return self.native.seq_pos_min(seq_id)

    def state_seq_size(self, seq_id: int, flags: int = 0) -> int:
        return self.native.state_seq_size(seq_id, flags)

    def state_seq_get(self, seq_id: int, flags: int = 0) -> bytes:
        """Exact per-sequence state bytes (KV cells / recurrent state)."""
        return self.native.state_seq_get(seq_id, flags)

    def state_seq_set(self, data: bytes, seq_id: int, flags: int = 0) -> int:
        """Restore per-sequence state; returns bytes read.

        :raises StateError: llama.cpp rejected the bytes.
        """
        return self.native.state_seq_set(data, seq_id, flags)
