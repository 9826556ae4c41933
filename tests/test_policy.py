"""The draft policy as pure logic: how many tokens a sequence drafts for a measured step
cost and its acceptance."""

from __future__ import annotations

import itertools

from engine.scheduler.policy import DraftPolicy


def measured(a_us: float, c_us: float) -> DraftPolicy:
    """A policy that has observed steps costing ``a + c * tokens`` microseconds."""
    policy = DraftPolicy()
    for n in (4, 8, 16, 32, 64, 8, 24):
        policy.observe_step(n, a_us + c_us * n)
    return policy


def test_the_fixed_cost_is_learned_from_step_times() -> None:
    assert abs(measured(1000, 50).base - 20.0) < 1e-6  # base = a / c token-equivalents
    assert DraftPolicy().base == DraftPolicy().default_base  # nothing observed yet


def test_no_drafts_when_the_fixed_cost_per_sequence_is_small_and_acceptance_low() -> None:
    policy = measured(100, 50)  # base 2 token-equivalents, shared by 8 sequences
    assert policy.n_draft(max_k=4, accepted=1, drafted=60, n_decoding=8, step=3) == 0


def test_long_drafts_when_acceptance_is_high_and_the_batch_small() -> None:
    policy = measured(2000, 50)  # base 40: one sequence pays all of it
    assert policy.n_draft(max_k=6, accepted=190, drafted=200, n_decoding=1, step=3) == 6
    # the same acceptance in a big batch: the fixed cost is shared, drafts cost more
    assert policy.n_draft(max_k=6, accepted=190, drafted=200, n_decoding=64, step=3) < 6


def test_a_sequence_that_stopped_drafting_probes() -> None:
    policy = measured(100, 50)
    low = {"max_k": 4, "accepted": 1, "drafted": 60, "n_decoding": 8}
    assert policy.n_draft(**low, step=policy.probe_every) == 1
    assert policy.n_draft(**low, step=policy.probe_every + 1) == 0


def test_the_choice_maximises_expected_tokens_per_cost() -> None:
    """Against brute force over every length, for a grid of costs and acceptances."""
    for a_us, accepted, n_dec, max_k in itertools.product(
        (50, 500, 5000), (0, 10, 40, 58), (1, 4, 32), (1, 3, 6)
    ):
        policy = measured(a_us, 50)
        alpha = policy.alpha(accepted, 60)
        share = policy.base / n_dec

        def value(k: int, alpha: float = alpha, share: float = share) -> float:
            return sum(alpha**i for i in range(k + 1)) / (share + 1 + k)

        best = max(range(max_k + 1), key=lambda k: (value(k), -k))
        got = policy.n_draft(max_k=max_k, accepted=accepted, drafted=60, n_decoding=n_dec, step=1)
        assert abs(value(got) - value(best)) < 1e-12, (a_us, accepted, n_dec, max_k, got, best)


def test_fixed_and_per_stream_kv() -> None:
    assert DraftPolicy(adaptive=False).n_draft(max_k=5, accepted=0, drafted=100, n_decoding=9, step=1) == 5
    split = DraftPolicy(unified_kv=False)
    assert split.n_draft(max_k=5, accepted=100, drafted=100, n_decoding=2, step=1) == 0
