"""No cross-talk between sequences drafted together in one upstream draft call.

The pinned llama.cpp reuses a graph-allocator plan after the set of output tensors
changed; EAGLE-3's per-sequence backend samplers then share one candidates buffer and
every sequence drafts from the last sequence's candidates (see vendor/patches/). These
tests fail without that patch.
"""

from __future__ import annotations

import pytest

from engine.session import ContextConfig, SpeculativeConfig, SpeculativeSession
from tests.conftest import ModelCache
from tests.spec_loop import GreedyLoop

pytestmark = pytest.mark.timeout(300)

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Once upon a time, in a small village,",
    "In the beginning there was",
    "A B C D E F G",
]
N_NEW = 32


def run(
    models: ModelCache,
    target: str,
    draft: str | None,
    spec: str,
    prompts: list[list[int]],
    together: bool,
    n_draft_max: int,
    mtp: bool = False,
) -> GreedyLoop:
    session = SpeculativeSession.open(
        models(target, mtp=mtp),
        SpeculativeConfig(spec, n_seq=len(prompts), n_draft_max=n_draft_max),
        ContextConfig(n_ctx=512 * len(prompts), n_seq=len(prompts), n_batch=256, threads=2),
        draft_model=models(draft) if draft else None,
    )
    loop = GreedyLoop(session)
    for s, p in enumerate(prompts):
        loop.start(s, p)
    seqs = list(range(len(prompts)))
    if together:
        loop.run(seqs, N_NEW)
    else:
        for s in seqs:
            loop.run([s], N_NEW)
    return loop


@pytest.mark.parametrize("n_draft_max", [1, 3])
def test_eagle3_acceptance_alone_equals_concurrent(models: ModelCache, n_draft_max: int) -> None:
    prompts = [models("walk-llama").tokenize(t) for t in TEXTS]
    alone = run(models, "walk-llama", "walk-llama-eagle3", "eagle3", prompts, False, n_draft_max)
    together = run(models, "walk-llama", "walk-llama-eagle3", "eagle3", prompts, True, n_draft_max)
    for s in range(len(prompts)):
        assert alone.outputs[s][:N_NEW] == together.outputs[s][:N_NEW]
        assert alone.accepted[s] > 0
        assert (together.accepted[s], together.drafted[s]) == (alone.accepted[s], alone.drafted[s]), s


@pytest.mark.parametrize(
    "target,draft,spec,mtp",
    [
        ("walk-llama", "walk-llama-eagle3", "eagle3", False),
        ("llama", "llama-dflash", "dflash", False),
        ("walk-qwen35-mtp", None, "mtp", True),
        ("llama", "llama", "draft", False),
    ],
    ids=["eagle3", "dflash", "mtp", "draft-simple"],
)
def test_drafts_alone_equal_drafts_together(
    models: ModelCache, target: str, draft: str | None, spec: str, mtp: bool
) -> None:
    """Stronger than acceptance: every draft token of every round is the same."""
    prompts = [models(target, mtp=mtp).tokenize(t) for t in TEXTS]
    alone = run(models, target, draft, spec, prompts, False, 3, mtp)
    together = run(models, target, draft, spec, prompts, True, 3, mtp)
    for s in range(len(prompts)):
        assert together.outputs[s][:N_NEW] == alone.outputs[s][:N_NEW]
        assert together.drafts[s] == alone.drafts[s], s
