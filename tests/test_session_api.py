"""The seed's session API beyond the loop: constructors, accessors, what the drafter asks
of the target context, statistics, the error hierarchy, and what a speculative state is
valid for."""

from __future__ import annotations

import dataclasses

import pytest

from engine import _nb_spec
from engine.session import (
    Batch,
    Context,
    ContextConfig,
    DecodeError,
    SessionError,
    SpeculativeConfig,
    SpeculativeSession,
    StateError,
)
from engine.session import errors as session_errors
from tests.conftest import ModelCache
from tests.spec_loop import GreedyLoop, prefill

CTX = ContextConfig(n_ctx=1024, n_seq=2, n_batch=128, n_ubatch=128, threads=2)


def contexts(
    models: ModelCache, target: str, draft: str | None, mtp: bool = False
) -> tuple[Context, Context]:
    # (a hybrid target keeps recurrent snapshots to roll rejected drafts back)
    t = Context.create(
        models(target, mtp=mtp), CTX, n_outputs_max=10, n_outputs_max_per_seq=5, n_rs_seq=4 if mtp else 0
    )
    d = Context.create(models(draft) if draft else t.model, CTX, kind="mtp" if mtp else "default", other=t)
    return t, d


def test_the_seed_constructors_and_accessors(models: ModelCache) -> None:
    t, d = contexts(models, "walk-llama", "walk-llama-eagle3")
    eagle = SpeculativeSession.eagle3(t, d, n_seq=2, n_draft_max=4, n_min=1, p_min=0.25)
    assert (eagle.n_seq, eagle.n_draft_max, eagle.n_min, eagle.p_min) == (2, 4, 1, 0.25)
    assert eagle.config.type == "draft-eagle3" and eagle.target_context is t and eagle.draft_context is d
    assert eagle.need_embd_pre_norm() and not eagle.need_embd()
    t, d = contexts(models, "walk-llama", "walk-llama-dflash")
    dflash = SpeculativeSession.dflash(t, d, n_seq=2)
    assert dflash.config.type == "draft-dflash" and dflash.need_embd_pre_norm() and not dflash.need_embd()
    t, d = contexts(models, "walk-qwen35-mtp", None, mtp=True)
    mtp = SpeculativeSession.mtp(t, d, n_seq=2, n_draft_max=2)
    assert mtp.config.type == "draft-mtp" and mtp.n_draft_max == 2 and mtp.need_embd_pre_norm()
    # drafters that read no hidden states ask for none
    for spec, draft in (("ngram-simple", None), ("draft", "walk-llama")):
        s = SpeculativeSession.open(
            models("walk-llama"),
            SpeculativeConfig(spec, n_seq=2),
            CTX,
            draft_model=models(draft) if draft else None,
        )
        assert not s.need_embd_pre_norm() and not s.need_embd(), spec


def test_print_stats_and_stats(models: ModelCache, capfd: pytest.CaptureFixture[str]) -> None:
    for spec in ("eagle3", "none"):
        s = SpeculativeSession.open(
            models("walk-llama"),
            SpeculativeConfig(spec, n_seq=2, n_draft_max=3),
            CTX,
            draft_model=models("walk-llama-eagle3") if spec == "eagle3" else None,
        )
        loop = GreedyLoop(s)
        loop.start(0, models("walk-llama").tokenize("The quick brown fox"))
        if spec != "none":
            loop.run([0], 12)
        s.print_stats()  # through llama.cpp's log: never stdout
        stats = s.stats()
        assert stats.n_begin == 1 and stats.n_process >= 1
        if spec == "eagle3":
            assert stats.n_drafted >= stats.n_accepted > 0 and stats.accepted_per_pos[0] > 0
    assert capfd.readouterr().out == ""


def test_a_decode_failure_through_the_session_is_a_decode_error(models: ModelCache) -> None:
    s = SpeculativeSession.open(models("walk-llama"), SpeculativeConfig("ngram-simple", n_seq=2), CTX)
    prefill(s, 0, [1000, 2000, 3000])
    b = Batch()
    b.add(1000, 10, 0, True)  # a gap after position 1: llama.cpp refuses the batch
    with pytest.raises(DecodeError) as info:
        s.decode_target_and_process(b)
    assert info.value.code is not None
    ok = Batch()
    ok.add(3000, 2, 0, True)
    s.decode_target_and_process(ok)  # the session goes on


def test_every_native_error_kind_reaches_python_as_its_class() -> None:
    """The translation of every error kind, including the ones that wrap upstream
    exceptions no input reaches (BeginError, AcceptError) and NotQuiescentError (upstream
    in the middle of a draft call)."""
    names = [n for n in session_errors.__all__ if n != "SessionError"]
    for kind in range(len(names)):
        with pytest.raises(SessionError) as info:
            _nb_spec._raise_error_kind(kind)
        assert type(info.value).__name__ in names
        assert str(info.value).endswith(type(info.value).__name__)
    seen = set()
    for kind in range(len(names)):
        try:
            _nb_spec._raise_error_kind(kind)
        except SessionError as exc:
            seen.add(type(exc).__name__)
    assert seen == set(names)
    assert issubclass(session_errors.NotQuiescentError, StateError)


@pytest.mark.parametrize(
    "change", [{"p_min": 0.5}, {"n_seq": 3}, {"backend_sampling": False}, {"ngram_min_hits": 2}, {"n_min": 1}]
)
def test_a_state_is_valid_only_for_its_speculative_config(
    models: ModelCache, change: dict[str, object]
) -> None:
    config = SpeculativeConfig("eagle3", n_seq=2, n_draft_max=3)
    ctx = ContextConfig(n_ctx=1024, n_seq=3, n_batch=128, n_ubatch=128, threads=2)
    s = SpeculativeSession.open(models("walk-llama"), config, ctx, draft_model=models("walk-llama-eagle3"))
    loop = GreedyLoop(s)
    loop.start(0, models("walk-llama").tokenize("Once upon a time"))
    state = s.speculative_state(0)
    whole = s.capture_sequence(0)
    other = SpeculativeSession.open(
        models("walk-llama"),
        dataclasses.replace(config, **change),
        ctx,
        draft_model=models("walk-llama-eagle3"),
    )
    with pytest.raises(StateError, match="another speculative config"):
        other.restore_speculative_state(0, state)
    with pytest.raises(StateError, match="another model or configuration"):
        other.restore_sequence(0, whole)
    s.restore_speculative_state(1, state)  # and the same config takes it
