"""Configuration of contexts and speculative sessions, validated on construction."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .errors import InvalidConfigError

if TYPE_CHECKING:
    from .. import _nb_spec

    #: upstream speculative type names (from the native core)
    SPEC_TYPES: tuple[str, ...]

__all__ = [
    "SPEC_TYPES",
    "ContextConfig",
    "SpeculativeConfig",
    "canonical_spec_type",
]

#: the short names we accept for upstream's speculative type names
_ALIASES = {
    "draft": "draft-simple",
    "eagle3": "draft-eagle3",
    "dflash": "draft-dflash",
    "dspark": "draft-dspark",
    "mtp": "draft-mtp",
    "ngram": "ngram-simple",
}


@functools.cache
def _spec_types() -> tuple[str, ...]:
    """Upstream's speculative type names, from the native core (loaded on first use, so that
    this module imports without the extension)."""
    from .. import _nb_spec

    return tuple(_nb_spec.SPEC_TYPES)


def __getattr__(name: str) -> Any:
    if name == "SPEC_TYPES":
        return _spec_types()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def canonical_spec_type(name: str) -> str:
    """Map a speculative type name or alias (``eagle3``, ``mtp``...) to upstream's name.

    :raises InvalidConfigError: for an unknown name.
    """
    t = _ALIASES.get(name, name)
    if t not in _spec_types():
        known = ", ".join(_spec_types() + tuple(_ALIASES))
        raise InvalidConfigError(
            f"unknown speculative type {name!r} (known: {known})", reason="unknown speculative type"
        )
    return t


def check(ok: bool, message: str) -> None:
    """A configuration rule: :class:`InvalidConfigError` with ``message`` when it fails."""
    if not ok:
        raise InvalidConfigError(message, reason=message)


def check_uint32(name: str, value: object) -> None:
    """The type rule before a value crosses to the native side, whose rules say the rest."""
    check(
        isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**32,
        f"{name} must be a non-negative integer, got {value!r}",
    )


@dataclass(frozen=True)
class ContextConfig:
    """Size and threading of a llama.cpp context.

    ``n_ctx`` is shared by all ``n_seq`` sequences (each gets ``n_ctx // n_seq`` cells).
    """

    n_ctx: int = 4096
    n_seq: int = 1
    n_batch: int = 512
    n_ubatch: int | None = None  #: None = min(512, n_batch)
    threads: int | None = None  #: CPU threads; None = all cores
    embeddings: bool = False
    #: one KV buffer for all sequences. llama.cpp then decodes any batch shape as one
    #: micro-batch; per-sequence streams (False) need the same number of tokens for every
    #: sequence of a micro-batch, so uneven drafts split a step into several passes.
    kv_unified: bool = False
    #: compute every row of a batch with the same kernels and reduction order whatever else
    #: the batch holds (its size, its other sequences, prompt rows or decodes), so a
    #: sequence's logits do not depend on what it was batched with (the CPU backend's
    #: batch-invariant mode, vendor/patches/0010: a few % slower)
    batch_invariant: bool = False

    def __post_init__(self) -> None:
        for name in ("n_ctx", "n_seq", "n_batch"):
            check_uint32(name, getattr(self, name))
        if self.n_ubatch is None:
            object.__setattr__(self, "n_ubatch", min(512, self.n_batch))
        check_uint32("n_ubatch", self.n_ubatch)
        check(
            self.threads is None or (isinstance(self.threads, int) and self.threads >= 1),
            f"threads must be >= 1 (or None for all cores), got {self.threads!r}",
        )
        check(isinstance(self.batch_invariant, bool), "batch_invariant must be a bool")
        from .. import _nb_spec

        # the size rules live once, natively (the context applies them too)
        _nb_spec.validate_context_params(self.native())

    def native(self) -> _nb_spec.ContextParams:
        """These sizes as the native context takes them."""
        from .. import _nb_spec

        p = _nb_spec.ContextParams()
        p.n_ctx = self.n_ctx
        p.n_batch = self.n_batch
        p.n_ubatch = self.n_ubatch or self.n_batch
        p.n_seq = self.n_seq
        p.n_threads = self.threads or 0  # 0: all cores, natively
        p.embeddings = self.embeddings
        p.kv_unified = self.kv_unified
        p.batch_invariant = self.batch_invariant
        return p

    @property
    def n_ctx_seq(self) -> int:
        """Cells each sequence can hold."""
        return self.n_ctx // self.n_seq


@dataclass(frozen=True)
class SpeculativeConfig:
    """What to draft with and how much. Defaults are upstream's (n_max 3, n_min 0, p_min 0).

    ``type`` is an upstream name (``draft-eagle3``...) or an alias (``eagle3``, ``dflash``,
    ``mtp``, ``draft``, ``ngram``).
    """

    type: str = "none"
    n_seq: int = 1
    n_draft_max: int = 3
    n_min: int = 0
    p_min: float = 0.0
    #: draft-side sampling on the backend (upstream default: on)
    backend_sampling: bool = True
    #: n-gram drafters: key length and draft length (upstream defaults 12 / 48)
    ngram_size_n: int = 12
    ngram_size_m: int = 48
    ngram_min_hits: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "type", canonical_spec_type(self.type))
        for name in ("n_seq", "n_draft_max", "n_min", "ngram_size_n", "ngram_size_m", "ngram_min_hits"):
            value = getattr(self, name)
            check(
                isinstance(value, int) and -(2**31) <= value < 2**31,
                f"{name} must be a 32-bit integer, got {value!r}",
            )
        check(
            isinstance(self.p_min, (int, float)) and not math.isnan(self.p_min),
            "p_min must be a number",
        )
        from .. import _nb_spec

        # one set of rules: the native validator (InvalidConfigError with the reason)
        _nb_spec.validate_spec_config(self.native())

    def native(self) -> _nb_spec.SpecConfig:
        from .. import _nb_spec

        c = _nb_spec.SpecConfig()
        c.type = self.type
        c.n_seq = self.n_seq
        c.n_draft_max = self.n_draft_max
        c.n_min = self.n_min
        c.p_min = float(self.p_min)
        c.backend_sampling = self.backend_sampling
        c.ngram_size_n = self.ngram_size_n
        c.ngram_size_m = self.ngram_size_m
        c.ngram_min_hits = self.ngram_min_hits
        return c

    @property
    def needs_draft_model(self) -> bool:
        """A separate draft model file is needed (draft-simple, EAGLE-3, DFlash, DSpark)."""
        from .. import _nb_spec

        return bool(_nb_spec.spec_type_needs_draft_model(self.type))

    def check_draft_model(self, given: bool) -> None:
        """:raises InvalidConfigError: a draft model is missing, or given to a type that takes none."""
        if self.needs_draft_model and not given:
            raise InvalidConfigError(
                f"speculative type {self.type} needs a draft model", reason="no draft model"
            )
        if given and not self.needs_draft_model:
            raise InvalidConfigError(
                f"speculative type {self.type} takes no draft model", reason="unexpected draft model"
            )

    def digest(self) -> int:
        """What state taken under this config is valid for: a digest of every field."""
        from .. import _nb_spec

        return int(_nb_spec.spec_config_digest(self.native()))

    @staticmethod
    def describe_types() -> str:
        """The speculative types and what each needs, for help texts."""
        from .. import _nb_spec

        short = {v: k for k, v in _ALIASES.items()}
        needs = _nb_spec.spec_type_needs_draft_model
        alone = [short.get(t, t) for t in _spec_types() if t != "draft-mtp" and not needs(t)]
        drafted = [short.get(t, t) for t in _spec_types() if needs(t)]
        return (
            f"{', '.join(alone)} (no draft model); {', '.join(drafted)} (need a draft model); "
            "mtp (models with NextN layers)"
        )

    @property
    def is_mtp(self) -> bool:
        return self.type == "draft-mtp"

    @property
    def is_block_draft(self) -> bool:
        """DFlash-style drafts decode a whole block per sequence in one pass."""
        return self.type in ("draft-dflash", "draft-dspark")
