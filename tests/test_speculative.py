"""The seed's loop with every drafter: greedy output identical to plain greedy decoding."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from engine.session import ContextConfig, SpeculativeConfig, SpeculativeSession
from tests.conftest import ModelCache
from tests.spec_loop import greedy_plain_margins, speculative_greedy, tie_safe_prefix

pytestmark = pytest.mark.timeout(300)

TEXTS = [
    "The quick brown fox jumps over the lazy dog. Once upon a time,",
    "In a small village by the sea there lived",
    "1, 2, 3, 4, 5, 6,",
]
N_NEW = 24

# (name, target, draft, spec type, extra config, load target with MTP layers)
CASES = [
    ("draft-simple", "llama", "llama", "draft-simple", {}, False),
    ("eagle3", "llama", "llama-eagle3", "eagle3", {}, False),
    ("eagle3-walk", "walk-llama", "walk-llama-eagle3", "eagle3", {}, False),
    ("dflash", "llama", "llama-dflash", "dflash", {}, False),
    ("mtp", "qwen35-mtp", None, "mtp", {}, True),
    ("mtp-walk", "walk-qwen35-mtp", None, "mtp", {}, True),
    (
        "ngram-simple",
        "walk-llama-cycle6",
        None,
        "ngram-simple",
        {"ngram_size_n": 2, "ngram_size_m": 4},
        False,
    ),
    ("ngram-mod", "walk-llama-cycle6", None, "ngram-mod", {}, False),
]


def open_session(
    models: ModelCache,
    target: str,
    draft: str | None,
    spec: str,
    extra: dict[str, int],
    mtp: bool,
    n_seq: int,
    n_draft_max: int = 4,
) -> SpeculativeSession:
    tm = models(target, mtp=mtp)
    dm = models(draft) if draft else None
    cfg = SpeculativeConfig(spec, n_seq=n_seq, n_draft_max=n_draft_max, **extra)
    return SpeculativeSession.open(
        tm,
        cfg,
        ContextConfig(n_ctx=512 * n_seq, n_seq=n_seq, n_batch=256, n_ubatch=256, threads=2),
        draft_model=dm,
    )


@pytest.mark.parametrize("name,target,draft,spec,extra,mtp", CASES, ids=[c[0] for c in CASES])
def test_speculative_greedy_equals_plain_greedy(
    models: ModelCache, name: str, target: str, draft: str | None, spec: str, extra: dict[str, int], mtp: bool
) -> None:
    tm = models(target, mtp=mtp)
    prompts = [tm.tokenize(t) for t in TEXTS]
    session = open_session(models, target, draft, spec, extra, mtp, n_seq=len(prompts))
    run = speculative_greedy(session, prompts, N_NEW)
    compared = 0
    for prompt, out in zip(prompts, run.outputs, strict=True):
        exp, margins = greedy_plain_margins(tm, prompt, N_NEW)
        k = tie_safe_prefix(margins)  # random weights: exact up to the first near-tie
        assert out[:k] == exp[:k], name
        compared += k
    assert compared >= 0.75 * len(prompts) * N_NEW
    assert session.is_quiescent()
    stats = session.stats()
    assert stats.n_drafted == sum(run.drafted)
    assert stats.n_accepted == sum(run.accepted)
    if name in ("draft-simple", "eagle3-walk", "mtp-walk", "ngram-simple"):
        # drafts that can predict the target: acceptance must be real, not zero
        assert sum(run.accepted) > 0, (name, run.drafted, run.accepted)
        assert run.rounds < len(prompts) * N_NEW


def test_draft_simple_self_draft_accepts_nearly_everything(models: ModelCache) -> None:
    tm = models("llama")
    prompts = [tm.tokenize(t) for t in TEXTS[:2]]
    session = open_session(models, "llama", "llama", "draft-simple", {}, False, n_seq=2)
    run = speculative_greedy(session, prompts, 32)
    drafted, accepted = sum(run.drafted), sum(run.accepted)
    assert drafted > 0
    assert accepted / drafted >= 0.95, (accepted, drafted)


def test_batched_draft_is_one_call_for_all_sequences(models: ModelCache) -> None:
    tm = models("walk-llama")
    prompts = [tm.tokenize(t) for t in TEXTS]
    session = open_session(models, "walk-llama", "walk-llama-eagle3", "eagle3", {}, False, n_seq=3)
    run = speculative_greedy(session, prompts, 12)
    # one upstream draft call per round, whatever the number of sequences
    assert session.stats().n_draft_calls <= run.rounds


# Feeds one 480-token prompt batch to an EAGLE-3 drafter and prints how many MiB the
# process's resident memory grew by. The drafter's encoder and decoder each see every token.
_FEED_ONE_PROMPT = """
import sys
from engine.session import Batch, ContextConfig, Model, Runtime, SpeculativeConfig, SpeculativeSession
from tests.helpers import rss_mib

rt = Runtime()
target, draft = (Model.load(rt, p) for p in sys.argv[1:3])
session = SpeculativeSession.open(
    target,
    SpeculativeConfig("eagle3", n_seq=1, n_draft_max=4),
    ContextConfig(n_ctx=1024, n_seq=1, n_batch=512, n_ubatch=512, threads=2),
    draft_model=draft,
)
before = rss_mib()
b = Batch()
b.add_sequence([1] + [100 + i % 300 for i in range(479)], 0, 0, logits="none")
session.decode_target_and_process(b)
print(rss_mib() - before)
"""


def test_feeding_eagle3_a_prompt_computes_and_keeps_no_logits_per_token(model_paths: dict[str, Path]) -> None:
    """The drafter's decoder computes logits only for the rows asked for, and its encoder
    reserves no room for logits or samples: on a 128k vocabulary each would be hundreds of
    MiB for a 480-token prompt (about 1.2 GiB in all before patch 0012)."""
    paths = [str(model_paths[m]) for m in ("walk-llama", "walk-llama-eagle3")]
    run = subprocess.run(
        [sys.executable, "-c", _FEED_ONE_PROMPT, *paths],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert float(run.stdout) < 64, run.stdout


def _greedy_steps(
    session: SpeculativeSession, prompt: list[int], steps: int, shadow: int, n_draft: int = 0
) -> list:
    """One sequence through the engine step: its prompt, then ``steps`` single-token steps,
    each asking for ``shadow`` drafts in shadow (and ``n_draft`` verified ones). Returns each
    decoding step's output."""
    from engine import _nb_spec
    from engine.scheduler.native import sampler_params, step_runner
    from engine.scheduler.params import SamplingParams

    runner = step_runner(session)
    plan = _nb_spec.StepPlan()
    plan.configure(0, sampler_params(SamplingParams(temperature=0.0), 0))
    plan.work(0, prompt, 0, True, 0, True)
    out = runner.step_async(plan).result().outputs[0]
    n_past, outputs = len(prompt), []
    for _ in range(steps):
        plan = _nb_spec.StepPlan()
        plan.work(0, [out.tokens[-1]], n_past, True, n_draft, False, 0, shadow)
        result = runner.step_async(plan).result()
        if result.errors:  # (refused: the caller reads why)
            return [result]
        out = result.outputs[0]
        n_past += len(out.tokens)
        outputs.append(out)
    return outputs


def test_shadow_drafts_are_drafted_but_never_verified(models: ModelCache) -> None:
    """An ngram-simple drafter asked in shadow drafts as it would for real, but the step
    verifies none of it: the output is plain greedy's, no proposal is left pending, and the
    session counts no drafts. On a model whose greedy walk cycles, the shadow drafts are
    what the sequence emits next."""
    prompt = models("walk-llama-cycle6").tokenize(TEXTS[2])
    spec = ("walk-llama-cycle6", None, "ngram-simple", {"ngram_size_n": 2, "ngram_size_m": 4}, False)
    session = open_session(models, *spec, n_seq=1)
    assert session.can_shadow()
    shadowed = _greedy_steps(session, prompt, 24, shadow=4)
    assert session.is_quiescent() and session.stats().n_drafts == 0
    plain = _greedy_steps(open_session(models, *spec, n_seq=1), prompt, 24, shadow=0)
    emitted = [out.tokens[0] for out in shadowed]
    assert emitted == [out.tokens[0] for out in plain]
    assert all(out.drafted == 0 and out.produced == 0 and len(out.tokens) == 1 for out in shadowed)
    drafts = [(i, list(out.shadow)) for i, out in enumerate(shadowed) if out.shadow]
    assert drafts and all(len(d) <= 4 for _, d in drafts)
    assert not any(out.shadow for out in plain)
    for i, draft in drafts[-4:]:  # (the walk has cycled by then: every n-gram draft is right)
        assert emitted[i : i + len(draft)] == draft[: len(emitted) - i]


def test_the_rest_of_a_short_draft_is_drafted_in_shadow(models: ModelCache) -> None:
    """An item that drafts 2 tokens and asks for 5 in shadow gets one draft of up to 5: the
    step verifies its first 2 (the session counts only those), and returns all of it. The
    output stays plain greedy's."""
    prompt = models("walk-llama-cycle6").tokenize(TEXTS[2])
    spec = ("walk-llama-cycle6", None, "ngram-simple", {"ngram_size_n": 2, "ngram_size_m": 8}, False)
    session = open_session(models, *spec, n_seq=1)
    outs = _greedy_steps(session, prompt, 16, shadow=5, n_draft=2)
    drafted = [out for out in outs if out.drafted]
    assert drafted and all(out.drafted <= 2 for out in outs)
    assert any(len(out.shadow) > out.drafted for out in drafted)  # (the rest, unverified)
    assert session.stats().n_drafted == sum(out.drafted for out in outs)
    for out in outs:
        assert len(out.shadow) <= 5
        # (the rows verified the shadow's first tokens: the accepted ones are its own)
        assert list(out.shadow[: out.accepted]) == list(out.tokens[: out.accepted])
        if out.drafted:
            assert len(out.shadow) >= out.drafted
    emitted = [t for out in outs for t in out.tokens]
    plain = _greedy_steps(open_session(models, *spec, n_seq=1), prompt, len(emitted), shadow=0)
    assert emitted == [out.tokens[0] for out in plain]


def test_a_shadow_draft_is_refused_where_it_cannot_be_one(models: ModelCache) -> None:
    """Shadow drafts need a drafter whose state does not follow what is verified (ngram-mod's
    does): otherwise the step refuses the item with a typed error and goes on."""
    prompt = models("walk-llama-cycle6").tokenize(TEXTS[2])
    for n_draft in (0, 2):
        mod = open_session(models, "walk-llama-cycle6", None, "ngram-mod", {}, False, n_seq=1)
        assert not mod.can_shadow()
        (refused,) = _greedy_steps(mod, prompt, 1, shadow=4, n_draft=n_draft)
        assert [e.kind for e in refused.errors] == ["InvalidArgumentError"]
        assert "cannot draft in shadow" in refused.errors[0].message
    assert mod.is_quiescent()
