"""The speculative session: the seed API (``Eagle3Session`` / ``MtpSession``) in Python.

One type drives every upstream drafter: EAGLE-3 and DFlash (a separate draft model behind
a Default context that reads the target's hidden states), MTP (the target's own NextN
layers behind an MTP context), draft-simple (a separate small model) and the n-gram
drafters (no draft context). The loop is the seed's::

    session.decode_target_and_process(batch)      # target decode + hidden-state harvest
    drafts = session.draft(seq, n_past, last)     # or draft_many(...) for many sequences
    ... verify drafts on the target ...
    session.accept(seq, n_accepted)

Lifecycle rules are enforced before llama.cpp sees anything: a sequence with a pending
proposal cannot draft again (:class:`ProposalPendingError`); ``accept`` needs a pending
proposal (:class:`NoPendingProposalError`) and at most its length
(:class:`AcceptedTooManyError`); ``begin`` and state capture/restore need quiescence.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .. import _nb_spec
from .checkpoint import SequenceCheckpoint, pack, unpack
from .config import ContextConfig, SpeculativeConfig
from .errors import InvalidConfigError, StateError
from .model import Batch, Context, Model

__all__ = ["SpeculativeSession", "SpecStats"]

SpecStats = _nb_spec.SpecStats


def _opt(v: int | None) -> int:
    return -1 if v is None else v


class SpeculativeSession:
    """A speculative-decoding session over a target context (and a draft context)."""

    def __init__(self, target: Context, draft: Context | None, config: SpeculativeConfig) -> None:
        """Validate and create. Config errors come first (:class:`InvalidConfigError`), then
        context checks (:class:`IncompatibleContextsError`), then upstream init
        (:class:`InitError`)."""
        self._target = target
        self._draft = draft
        self._config = config
        self.native = _nb_spec.SpecSession.create(
            target.native, draft.native if draft else None, config.native()
        )

    # --- construction in the seed's vocabulary -----------------------------------------
    @classmethod
    def eagle3(
        cls, target: Context, draft: Context, n_seq: int = 1, n_draft_max: int = 3, **kw: Any
    ) -> SpeculativeSession:
        """EAGLE-3: ``draft`` is a Default context over an EAGLE-3 draft model created with
        ``other=target``."""
        return cls(target, draft, SpeculativeConfig("draft-eagle3", n_seq, n_draft_max, **kw))

    @classmethod
    def dflash(
        cls, target: Context, draft: Context, n_seq: int = 1, n_draft_max: int = 3, **kw: Any
    ) -> SpeculativeSession:
        """DFlash (DFlash2 checkpoints are detected from their metadata)."""
        return cls(target, draft, SpeculativeConfig("draft-dflash", n_seq, n_draft_max, **kw))

    @classmethod
    def mtp(
        cls, target: Context, draft: Context, n_seq: int = 1, n_draft_max: int = 3, **kw: Any
    ) -> SpeculativeSession:
        """MTP: ``draft`` is an MTP context over the target model itself."""
        return cls(target, draft, SpeculativeConfig("draft-mtp", n_seq, n_draft_max, **kw))

    @classmethod
    def open(
        cls,
        target_model: Model,
        config: SpeculativeConfig,
        context: ContextConfig,
        draft_model: Model | None = None,
    ) -> SpeculativeSession:
        """Create the target context and the draft context that ``config.type`` needs, with
        the parameters upstream uses for that type, and the session over them."""
        if context.n_seq < config.n_seq:
            raise InvalidConfigError(
                f"context n_seq {context.n_seq} < speculative n_seq {config.n_seq}",
                reason="n_seq mismatch",
            )
        config.check_draft_model(draft_model is not None)
        n_draft = 0 if config.type == "none" else config.n_draft_max
        per_seq = min(context.n_batch, 1 + n_draft)
        hybrid = target_model.info.is_recurrent or target_model.info.is_hybrid
        target = Context.create(
            target_model,
            context,
            n_rs_seq=n_draft if hybrid else 0,
            n_outputs_max=min(context.n_batch, context.n_seq * per_seq),
            n_outputs_max_per_seq=per_seq,
        )
        draft: Context | None = None
        if config.needs_draft_model or config.is_mtp:
            assert draft_model is not None or config.is_mtp
            block = config.n_draft_max + 1 if config.is_block_draft else 1
            dcfg = ContextConfig(
                n_ctx=target.n_ctx,
                n_seq=config.n_seq,
                n_batch=context.n_batch,
                n_ubatch=context.n_ubatch,
                threads=context.threads,
                kv_unified=context.kv_unified,
            )
            draft = Context.create(
                draft_model or target_model,
                dcfg,
                kind="mtp" if config.is_mtp else "default",
                other=target,
                n_outputs_max=min(dcfg.n_batch, config.n_seq * block),
                n_outputs_max_per_seq=block if config.backend_sampling else 1,
            )
        return cls(target, draft, config)

    # --- accessors ---------------------------------------------------------------------
    @property
    def config(self) -> SpeculativeConfig:
        return self._config

    @property
    def n_seq(self) -> int:
        return self._config.n_seq

    @property
    def n_draft_max(self) -> int:
        return self._config.n_draft_max

    @property
    def n_min(self) -> int:
        return self._config.n_min

    @property
    def p_min(self) -> float:
        return self._config.p_min

    @property
    def target_context(self) -> Context:
        return self._target

    @property
    def draft_context(self) -> Context | None:
        return self._draft

    def need_embd(self) -> bool:
        """Whether the drafter turned on post-norm embeddings on the target context
        (``llama_set_embeddings``; no upstream drafter does)."""
        return bool(self.native.need_embd())

    def drafter_sync(self) -> str:
        """How the drafter keeps up with the target in the engine step: ``none`` (n-gram
        drafters), ``catch_up`` (a draft model) or ``stream`` (hidden-state drafters)."""
        return str(self.native.drafter_sync())

    def can_shadow(self) -> bool:
        """Whether the engine step may ask the drafter for drafts it does not verify (only
        ngram-simple: its drafts depend on the history alone, and accepting does nothing)."""
        return bool(self.native.can_shadow())

    def need_embd_pre_norm(self) -> bool:
        """Whether the drafter turned on pre-norm hidden-state extraction on the target
        (layer inputs, the NextN hidden state: EAGLE-3, DFlash, MTP); read from the target
        context after the drafter configured it."""
        return bool(self.native.need_embd_pre_norm())

    # --- the loop ----------------------------------------------------------------------
    def decode_target(self, batch: Batch) -> None:
        """Decode on the target (allowed while proposals are pending: verification).

        :raises DecodeError: llama.cpp failed.
        """
        self.native.decode_target(*batch.args(), process=False)

    def process(self, batch: Batch) -> None:
        """Hand a just-decoded target batch to the drafter (harvests hidden states).

        :raises ProcessError: the backend failed.
        """
        self.native.process(*batch.args())

    def decode_target_and_process(self, batch: Batch) -> None:
        """:meth:`decode_target` then :meth:`process`, in one native call."""
        self.native.decode_target(*batch.args(), process=True)

    def begin(self, seq_id: int, prompt: Sequence[int]) -> None:
        """Start a fresh generation on ``seq_id`` with the prompt just decoded.

        :raises BadSeqIdError, ProposalPendingError, PromptTooLongError, BeginError:
        """
        self.native.begin(seq_id, list(prompt))

    def draft(self, seq_id: int, n_past: int, id_last: int) -> list[int]:
        """Draft up to ``n_draft_max`` tokens after ``id_last`` for one sequence.

        ``n_past``: tokens of ``seq_id`` already in the target KV cache.

        :raises BadSeqIdError, ProposalPendingError, DraftError:
        """
        return self.native.draft(seq_id, n_past, id_last)

    def draft_many(self, requests: Sequence[tuple[int, ...]]) -> list[list[int]]:
        """Draft for many sequences in ONE upstream draft call.

        ``requests``: ``(seq_id, n_past, id_last[, n_max])`` each; returns the drafts in
        request order.
        """
        return self.native.draft_many([list(r) for r in requests])

    def accept(self, seq_id: int, n_accepted: int) -> None:
        """Report how many of the pending proposal's tokens the target accepted (0: none).

        :raises NoPendingProposalError, AcceptedTooManyError, AcceptError:
        """
        self.native.accept(seq_id, n_accepted)

    def is_quiescent(self) -> bool:
        """True when no sequence has a pending proposal."""
        return self.native.is_quiescent()

    def pending(self, seq_id: int) -> int | None:
        """Length of ``seq_id``'s pending proposal, None when there is none."""
        return self.native.pending(seq_id)

    def print_stats(self) -> None:
        """Log upstream's statistics through llama.cpp's log."""
        self.native.print_stats()

    def stats(self) -> SpecStats:
        """Counters as data: drafts, drafted/accepted tokens, acceptance per position, times."""
        return self.native.stats()

    def history(self, seq_id: int) -> list[int]:
        """Tokens the session knows to be in the target for ``seq_id`` (by position)."""
        return self.native.history(seq_id)

    # --- state -------------------------------------------------------------------------
    def speculative_state(self, seq_id: int) -> bytes:
        """Versioned per-sequence drafter state (and the token history the drafters read).
        Capture target and draft states at the same quiescent boundary.

        :raises ProposalPendingError: a proposal is pending somewhere.
        :raises NotQuiescentError: upstream is in the middle of a draft call.
        :raises StateError: this drafter keeps no per-sequence state (as the seed: capture
            the whole sequence with :meth:`capture_sequence` instead).
        """
        return self.native.speculative_state(seq_id)

    def restore_speculative_state(self, seq_id: int, state: bytes) -> None:
        """Restore what :meth:`speculative_state` captured (restore target/draft first).

        :raises StateError: wrong version, other config, corrupted bytes.
        """
        self.native.restore_speculative_state(seq_id, state)

    def clear_target_kv_cache_seq(
        self, seq_id: int | None = None, p0: int | None = None, p1: int | None = None
    ) -> bool:
        """Remove a target KV range (None: all sequences / open ends)."""
        return self.native.clear_target_kv(_opt(seq_id), _opt(p0), _opt(p1))

    def clear_draft_kv_cache_seq(
        self, seq_id: int | None = None, p0: int | None = None, p1: int | None = None
    ) -> bool:
        """Remove a draft KV range."""
        return self.native.clear_draft_kv(_opt(seq_id), _opt(p0), _opt(p1))

    def target_state_seq_get_size_ext(self, seq_id: int, flags: int = 0) -> int:
        return self._target.state_seq_size(seq_id, flags)

    def target_state_seq_get_data_ext(self, seq_id: int, flags: int = 0) -> bytes:
        return self._target.state_seq_get(seq_id, flags)

    def target_state_seq_set_data_ext(self, data: bytes, seq_id: int, flags: int = 0) -> int:
        return self._target.state_seq_set(data, seq_id, flags)

    def draft_state_seq_get_size_ext(self, seq_id: int, flags: int = 0) -> int:
        return self._require_draft().state_seq_size(seq_id, flags)

    def draft_state_seq_get_data_ext(self, seq_id: int, flags: int = 0) -> bytes:
        return self._require_draft().state_seq_get(seq_id, flags)

    def draft_state_seq_set_data_ext(self, data: bytes, seq_id: int, flags: int = 0) -> int:
        return self._require_draft().state_seq_set(data, seq_id, flags)

    def _require_draft(self) -> Context:
        if self._draft is None:
            raise StateError("this session has no draft context", reason="no draft context")
        return self._draft

    # --- whole-sequence checkpoints ----------------------------------------------------
    def fingerprint(self) -> dict[str, Any]:
        """What a sequence checkpoint of this session is valid for."""
        return {
            "target_model": self._target.model.fingerprint,
            "draft_model": self._draft.model.fingerprint if self._draft else None,
            "spec": self._config.digest(),
            "n_ctx_seq": self._target.n_ctx // self._target.n_seq,
        }

    def capture_sequence(self, seq_id: int, meta: dict[str, Any] | None = None) -> bytes:
        """Target + draft + speculative state of one sequence as checkpoint bytes.

        :raises ProposalPendingError: not at a quiescent point.
        """
        sections = self.native.capture_sequence(seq_id)
        return pack(SequenceCheckpoint(self.fingerprint(), sections, dict(meta or {})))

    def restore_sequence(self, seq_id: int, data: bytes) -> dict[str, Any]:
        """Replace ``seq_id``'s state with a checkpoint; returns the checkpoint's meta.

        Everything is validated before anything changes: a corrupted or foreign checkpoint
        raises :class:`StateError` and leaves the session as it was.
        """
        ck = unpack(data, self.fingerprint(), with_draft=self._draft is not None)
        s = ck.sections
        self.native.restore_sequence(seq_id, s["target"], s.get("draft", b""), s["spec"])
        return ck.meta
