"""Per-sequence state: capture at a quiescent point, clear, restore, continue exactly."""

from __future__ import annotations

import pytest

from engine.session import (
    ContextConfig,
    ProposalPendingError,
    SpeculativeConfig,
    SpeculativeSession,
    StateError,
)
from tests.conftest import ModelCache
from tests.spec_loop import GreedyLoop

pytestmark = pytest.mark.timeout(300)

PROMPT = "The quick brown fox jumps over the lazy dog."
CTX = ContextConfig(n_ctx=1024, n_seq=2, n_batch=128, n_ubatch=128, threads=2)
N_TOTAL = 28

CASES = [
    ("eagle3", "walk-llama", "walk-llama-eagle3", "eagle3", {}, False),
    ("mtp", "walk-qwen35-mtp", None, "mtp", {}, True),
    ("draft-simple", "llama", "llama", "draft", {}, False),
    (
        "ngram-simple",
        "walk-llama-cycle6",
        None,
        "ngram-simple",
        {"ngram_size_n": 2, "ngram_size_m": 4},
        False,
    ),
]


def make(
    models: ModelCache,
    target: str,
    draft: str | None,
    spec: str,
    extra: dict[str, int],
    mtp: bool,
    n_draft_max: int = 3,
) -> SpeculativeSession:
    return SpeculativeSession.open(
        models(target, mtp=mtp),
        SpeculativeConfig(spec, n_seq=2, n_draft_max=n_draft_max, **extra),
        CTX,
        draft_model=models(draft) if draft else None,
    )


@pytest.mark.parametrize("name,target,draft,spec,extra,mtp", CASES, ids=[c[0] for c in CASES])
def test_capture_clear_restore_continue(
    models: ModelCache, name: str, target: str, draft: str | None, spec: str, extra: dict[str, int], mtp: bool
) -> None:
    prompt = models(target, mtp=mtp).tokenize(PROMPT)

    reference = GreedyLoop(make(models, target, draft, spec, extra, mtp))
    reference.start(0, prompt)
    reference.run([0], N_TOTAL)
    expected = reference.outputs[0][:N_TOTAL]

    loop = GreedyLoop(make(models, target, draft, spec, extra, mtp))
    session = loop.session
    loop.start(0, prompt)
    loop.run([0], 10)
    head = list(loop.outputs[0])
    checkpoint = session.capture_sequence(0, {"last": loop.last[0], "n_past": loop.n_past[0]})

    # corrupted and foreign checkpoints are refused, and nothing changes
    flipped = bytearray(checkpoint)
    flipped[len(flipped) // 2] ^= 0x10
    for bad in (bytes(flipped), checkpoint[:-1], checkpoint[:100], b"ENGCKPT2" + checkpoint[8:]):
        with pytest.raises(StateError):
            session.restore_sequence(1, bad)
    foreign = make(models, target, draft, spec, extra, mtp, n_draft_max=2)
    with pytest.raises(StateError, match="another model or configuration"):
        foreign.restore_sequence(0, checkpoint)
    assert foreign.target_context.seq_pos_max(0) == -1

    # move the sequence: clear slot 0, restore into slot 1, continue there
    session.clear_target_kv_cache_seq(0)
    if session.draft_context is not None:
        session.clear_draft_kv_cache_seq(0)
    assert session.target_context.seq_pos_max(0) == -1
    meta = session.restore_sequence(1, checkpoint)
    assert session.target_context.seq_pos_max(1) == meta["n_past"] - 1
    loop.resume(1, meta["last"], meta["n_past"])
    loop.run([1], N_TOTAL - len(head))
    assert (head + loop.outputs[1])[:N_TOTAL] == expected


def test_state_capture_needs_quiescence(models: ModelCache) -> None:
    session = make(models, "walk-llama", "walk-llama-eagle3", "eagle3", {}, False)
    loop = GreedyLoop(session)
    prompt = models("walk-llama").tokenize(PROMPT)
    loop.start(0, prompt)
    assert session.draft(0, loop.n_past[0], loop.last[0])
    with pytest.raises(ProposalPendingError):
        session.capture_sequence(0)
    with pytest.raises(ProposalPendingError):
        session.restore_speculative_state(0, b"")
    session.accept(0, 0)
    assert session.capture_sequence(0)


def test_raw_state_round_trip(models: ModelCache) -> None:
    """The seed's raw per-context state calls, target and draft, and the speculative state
    (which upstream holds for EAGLE-3: its deferred boundary)."""
    session = make(models, "walk-llama", "walk-llama-eagle3", "eagle3", {}, False)
    loop = GreedyLoop(session)
    loop.start(0, models("walk-llama").tokenize(PROMPT))
    loop.run([0], 4)
    size = session.target_state_seq_get_size_ext(0)
    data = session.target_state_seq_get_data_ext(0)
    draft_size = session.draft_state_seq_get_size_ext(0)
    draft_data = session.draft_state_seq_get_data_ext(0)
    assert len(data) == size > 0 and len(draft_data) == draft_size > 0
    spec_state = session.speculative_state(0)
    history = session.history(0)
    assert session.draft_context is not None
    draft_pos = session.draft_context.seq_pos_max(0)
    session.clear_target_kv_cache_seq(0)
    session.clear_draft_kv_cache_seq(0)
    assert session.target_state_seq_set_data_ext(data, 1) == size
    assert session.draft_state_seq_set_data_ext(draft_data, 1) == draft_size
    assert session.target_context.seq_pos_max(1) == loop.n_past[0] - 1
    assert session.draft_context.seq_pos_max(1) == draft_pos >= 0
    session.restore_speculative_state(1, spec_state)
    assert session.history(1) == history
    # the restored sequence continues exactly
    loop.resume(1, loop.last[0], loop.n_past[0])
    loop.run([1], 8)
    expected = GreedyLoop(make(models, "walk-llama", "walk-llama-eagle3", "eagle3", {}, False))
    expected.start(0, models("walk-llama").tokenize(PROMPT))
    got = loop.outputs[0] + loop.outputs[1]
    expected.run([0], len(got))
    assert got == expected.outputs[0][: len(got)]


def test_speculative_state_needs_state_upstream(models: ModelCache) -> None:
    """As the seed: a drafter that keeps no per-sequence state (the n-gram ones) has no
    speculative state to capture (StateError); the whole sequence still captures."""
    session = make(models, "llama", None, "ngram-mod", {}, False)
    loop = GreedyLoop(session)
    loop.start(0, models("llama").tokenize(PROMPT))
    with pytest.raises(StateError, match="keeps no per-sequence"):
        session.speculative_state(0)
    assert session.capture_sequence(0)
    with pytest.raises(StateError, match="no draft context"):
        session.draft_state_seq_get_size_ext(0)
