"""Every error variant is raised by the misuse that should raise it, and the process lives.

Several of these inputs make the pinned llama.cpp abort the whole process when they reach
it (noted per case); the session must refuse them first.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import _nb_spec
from engine.session import (
    AcceptedTooManyError,
    BadSeqIdError,
    Batch,
    Context,
    ContextConfig,
    DecodeError,
    DraftError,
    IncompatibleContextsError,
    InitError,
    InvalidArgumentError,
    InvalidConfigError,
    Model,
    ModelLoadError,
    NoPendingProposalError,
    ProcessError,
    PromptTooLongError,
    ProposalPendingError,
    Runtime,
    SessionError,
    SpeculativeConfig,
    SpeculativeSession,
    StateError,
)
from tests.conftest import ModelCache
from tests.spec_loop import prefill

pytestmark = pytest.mark.timeout(180)

CTX = ContextConfig(n_ctx=512, n_seq=2, n_batch=128, n_ubatch=128, threads=2)


# --- files ---------------------------------------------------------------------------


def test_unloadable_files_are_typed_errors(
    runtime: Runtime, tmp_path: Path, model_paths: dict[str, Path]
) -> None:
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"definitely not a model" * 100)
    good = model_paths["llama"].read_bytes()
    header_cut = tmp_path / "header-cut.gguf"
    header_cut.write_bytes(good[:200])
    data_cut = tmp_path / "data-cut.gguf"
    data_cut.write_bytes(good[: len(good) // 2])
    cases = {
        tmp_path / "missing.gguf": "no such file",
        tmp_path: "is a directory",
        empty: "empty",
        junk: "not a GGUF",
        header_cut: "truncated or corrupt",
        data_cut: "truncated",
        model_paths["bad-unknown-arch"]: "llama.cpp refused",
        # each of these aborts the process inside the pinned llama.cpp when loaded/used:
        model_paths["bad-eagle3-two-layers-ids"]: "exactly three target extraction layers",
        model_paths["bad-eagle3-2layers"]: "block_count 1",  # eagle3.cpp GGML_ASSERT(n_layer == 1)
        model_paths["bad-dflash-nomask"]: "mask_token_id",  # get_sub_batch abort at the first draft
        model_paths["bad-qwen35-conv-f16"]: "ssm_conv1d",  # ops.cpp GGML_ASSERT at the first decode
    }
    for path, message in cases.items():
        with pytest.raises(ModelLoadError, match=message):
            Model.load(runtime, path)
    assert issubclass(ModelLoadError, InitError)
    assert runtime.ping() == runtime.thread_id


@pytest.mark.parametrize(
    "draft,spec,message",
    [
        ("bad-eagle3-layer-range", "eagle3", "three supported target extraction sites"),  # GGML_ABORT
        ("bad-eagle3-hidden", "eagle3", "target_hidden_size"),  # get_sub_batch abort
        ("bad-eagle3-vocab", "eagle3", "vocabulary"),  # get_sub_batch abort
        ("bad-dflash-layer", "dflash", "DFlash target layer"),  # llama-graph GGML_ASSERT
        ("bad-dflash-embd", "dflash", "embedding size"),  # ggml_can_repeat GGML_ASSERT
        ("llama-other-vocab", "draft", "vocabulary"),
    ],
)
def test_incompatible_drafts_are_refused_before_llama_cpp(
    models: ModelCache, draft: str, spec: str, message: str
) -> None:
    with pytest.raises(IncompatibleContextsError, match=message):
        SpeculativeSession.open(
            models("llama"), SpeculativeConfig(spec, n_seq=2), CTX, draft_model=models(draft)
        )


def test_mtp_needs_nextn_layers(models: ModelCache) -> None:
    with pytest.raises(InitError, match="NextN"):
        SpeculativeSession.open(models("llama"), SpeculativeConfig("mtp", n_seq=2), CTX)


def test_eagle3_file_as_draft_simple_is_refused(models: ModelCache) -> None:
    with pytest.raises(IncompatibleContextsError, match="draft-eagle3"):
        SpeculativeSession.open(
            models("llama"), SpeculativeConfig("draft", n_seq=2), CTX, draft_model=models("llama-eagle3")
        )


# --- configs and contexts --------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"n_seq": 0},
        {"n_draft_max": 0},
        {"n_draft_max": -3},
        {"n_min": 4, "n_draft_max": 3},
        {"p_min": -0.1},
        {"p_min": 1.5},
        {"p_min": float("nan")},
        {"type": "no-such-drafter"},
    ],
)
def test_invalid_speculative_configs(kwargs: dict[str, object]) -> None:
    with pytest.raises(InvalidConfigError):
        SpeculativeConfig(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"n_seq": 0},
        {"n_ctx": 4, "n_seq": 8},
        {"n_batch": 0},
        {"n_ubatch": 600, "n_batch": 512},
        {"threads": -1},
        {"threads": 0},
        {"n_ctx": -1},
        {"n_seq": True},
        {"n_batch": 2**40},
        {"n_ubatch": "8"},
    ],
)
def test_invalid_context_configs(kwargs: dict[str, int]) -> None:
    with pytest.raises(InvalidConfigError):
        ContextConfig(**kwargs)


def test_a_context_rule_reads_the_same_before_and_at_the_native_context() -> None:
    """One rule, one place: ContextConfig applies the native context's own rules."""
    with pytest.raises(InvalidConfigError) as python_side:
        ContextConfig(n_ctx=512, n_seq=2, n_batch=64, n_ubatch=128)
    params = ContextConfig(n_ctx=512, n_seq=2, n_batch=64, n_ubatch=64).native()
    params.n_ubatch = 128
    with pytest.raises(InvalidConfigError) as native_side:
        _nb_spec.validate_context_params(params)
    assert str(python_side.value) == str(native_side.value)
    assert "n_ubatch must be in [1, n_batch=64], got 128" in str(python_side.value)


def test_context_checks_of_the_seed(models: ModelCache) -> None:
    llama = models("llama")
    target = Context.create(llama, ContextConfig(n_ctx=512, n_seq=2, n_batch=4, n_ubatch=4))
    # batch capacity must hold [last, d1..dk]
    with pytest.raises(IncompatibleContextsError, match="n_batch"):
        SpeculativeSession(target, None, SpeculativeConfig("ngram-simple", n_seq=2, n_draft_max=4))
    # target sequence capacity
    with pytest.raises(IncompatibleContextsError, match="sequences"):
        SpeculativeSession(target, None, SpeculativeConfig("ngram-simple", n_seq=3, n_draft_max=3))
    # EAGLE-3: a draft context made without the target as its other context
    with pytest.raises(IncompatibleContextsError, match="other context"):
        Context.create(models("llama-eagle3"), CTX)
    # the draft's sequence count must equal n_seq
    big = Context.create(llama, CTX, n_outputs_max=10, n_outputs_max_per_seq=5)
    draft = Context.create(models("llama-eagle3"), ContextConfig(n_ctx=512, n_seq=1), other=big)
    with pytest.raises(IncompatibleContextsError, match="draft context holds"):
        SpeculativeSession(big, draft, SpeculativeConfig("eagle3", n_seq=2))
    # n-gram drafters take no draft context
    with pytest.raises(IncompatibleContextsError, match="no draft context"):
        SpeculativeSession(big, draft, SpeculativeConfig("ngram-mod", n_seq=1))
    # config errors come before context errors
    with pytest.raises(InvalidConfigError):
        SpeculativeSession(big, draft, SpeculativeConfig("eagle3", n_seq=2, n_draft_max=0))


# --- the lifecycle ---------------------------------------------------------------------


@pytest.fixture()
def walk_session(models: ModelCache) -> SpeculativeSession:
    return SpeculativeSession.open(
        models("walk-llama"),
        SpeculativeConfig("eagle3", n_seq=2, n_draft_max=3),
        CTX,
        draft_model=models("walk-llama-eagle3"),
    )


def test_lifecycle_rules(walk_session: SpeculativeSession, models: ModelCache) -> None:
    s = walk_session
    prompt = models("walk-llama").tokenize("The quick brown fox")
    prefill(s, 0, prompt)
    n_past, last = len(prompt) - 1, prompt[-1]

    for bad in (-1, 2, 1000):
        with pytest.raises(BadSeqIdError) as info:
            s.draft(bad, n_past, last)
        assert info.value.seq_id == bad and info.value.n_seq == 2
        with pytest.raises(BadSeqIdError):
            s.accept(bad, 0)
        with pytest.raises(BadSeqIdError):
            s.begin(bad, prompt)
        with pytest.raises(BadSeqIdError):
            s.speculative_state(bad)

    with pytest.raises(NoPendingProposalError) as nope:
        s.accept(0, 0)
    assert nope.value.seq_id == 0
    with pytest.raises(DraftError, match="exceeds"):
        s.draft(1, 5, last)  # nothing was processed for sequence 1
    with pytest.raises(InvalidArgumentError):
        s.draft(0, n_past, models("walk-llama").n_vocab)  # id_last outside the vocabulary

    drafts = s.draft(0, n_past, last)
    assert drafts and s.pending(0) == len(drafts) and not s.is_quiescent()
    with pytest.raises(ProposalPendingError) as pending:
        s.draft(0, n_past, last)
    assert pending.value.seq_id == 0
    with pytest.raises(ProposalPendingError):
        s.begin(1, prompt)
    with pytest.raises(ProposalPendingError):
        s.speculative_state(1)
    with pytest.raises(ProposalPendingError):
        s.capture_sequence(0)
    with pytest.raises(AcceptedTooManyError) as many:
        s.accept(0, len(drafts) + 1)
    assert many.value.accepted == len(drafts) + 1 and many.value.proposed == len(drafts)

    # verification may decode while the proposal is pending
    b = Batch()
    b.add(last, n_past, 0, True)
    for i, t in enumerate(drafts):
        b.add(t, n_past + 1 + i, 0, True)
    s.decode_target(b)
    s.process(b)
    with pytest.raises(ProcessError):
        s.process(b)  # a decoded batch is harvested once
    s.accept(0, 0)
    assert s.is_quiescent() and s.pending(0) is None

    with pytest.raises(PromptTooLongError) as too_long:
        s.begin(0, [1] * (s.target_context.n_ctx + 1))
    assert too_long.value.size == s.target_context.n_ctx + 1
    assert too_long.value.maximum == s.target_context.n_ctx

    other = Batch()
    other.add(1, 0, 1, False)
    with pytest.raises(ProcessError):
        s.process(other)  # not the batch that was decoded


def test_decode_errors(models: ModelCache) -> None:
    ctx = Context.create(models("llama"), ContextConfig(n_ctx=256, n_seq=2, n_batch=256, n_ubatch=256))
    per_seq = ctx.n_ctx // 2
    b = Batch()
    b.add_sequence(list(range(1000, 1000 + per_seq)), 0, 0, logits="none")
    ctx.decode(b)
    more = Batch()
    more.add_sequence([5, 6, 7], per_seq, 0, logits="last")  # sequence 0 has no cells left
    with pytest.raises(DecodeError) as full:
        ctx.decode(more)
    assert full.value.code is not None
    for bad, match in [((-1, 0, 0), "token id"), ((5, -1, 0), "position"), ((5, 10_000, 0), "position")]:
        b = Batch()
        b.add(*bad, True)
        with pytest.raises(InvalidArgumentError, match=match):
            ctx.decode(b)
    b = Batch()
    b.add(5, 0, 7, True)
    with pytest.raises(BadSeqIdError):
        ctx.decode(b)
    with pytest.raises(InvalidArgumentError, match="empty"):
        ctx.decode(Batch())
    b = Batch()
    b.add_sequence(list(range(300)), 0, 1, logits="none")
    with pytest.raises(InvalidArgumentError, match="n_batch"):
        ctx.decode(b)
    # the context still works for the other sequence
    ok = Batch()
    ok.add_sequence([5, 6, 7], 0, 1, logits="last")
    assert ctx.decode(ok) == 1


def test_state_errors(walk_session: SpeculativeSession, models: ModelCache) -> None:
    s = walk_session
    prompt = models("walk-llama").tokenize("Once upon a time")
    prefill(s, 0, prompt)
    for garbage in (b"", b"junk", b"ESPS" + b"\0" * 40):
        with pytest.raises(StateError):
            s.restore_speculative_state(0, garbage)
        with pytest.raises(StateError):
            s.restore_sequence(0, garbage)
    with pytest.raises(StateError):
        s.target_context.state_seq_set(b"\x01\x02\x03", 0)
    assert isinstance(StateError("x"), SessionError)
