"""Sampling: each sampler parameter does what llama.cpp's own sampler chain does (checked
against a numpy reference on the same logits), and speculation does not change the
distribution of what is generated (lossless), with a real draft that differs from the
target and positions that go through draft verification."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from engine import Engine, SamplingParams
from engine.session import Batch, Context, ContextConfig, Model
from tests.aio import gather
from tests.conftest import ModelCache
from tests.helpers import config

pytestmark = pytest.mark.timeout(300)

PROMPT = [1000, 2000, 3000, 4000]


def chi2_p_value(observed: list[int], expected: list[float]) -> float:
    """Chi-square test p-value (Wilson-Hilferty approximation); bins with small expected
    counts are pooled first."""
    pairs = sorted(zip(expected, observed, strict=True), reverse=True)
    bins: list[tuple[float, int]] = []
    for e, o in pairs:
        if bins and bins[-1][0] < 5:
            bins[-1] = (bins[-1][0] + e, bins[-1][1] + o)
        else:
            bins.append((e, o))
    stat = sum((o - e) ** 2 / e for e, o in bins if e > 0)
    dof = len(bins) - 1
    if dof <= 0:
        return 1.0
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def two_sample_p_value(x: list[int], y: list[int]) -> float:
    """Are two samples from one distribution? Chi-square homogeneity over the tokens seen
    at least 10 times in both together (the rest pooled in one cell)."""
    cx, cy = Counter(x), Counter(y)
    common = [t for t in set(cx) | set(cy) if cx[t] + cy[t] >= 10]
    hx = [cx[t] for t in common] + [sum(v for t, v in cx.items() if t not in common)]
    hy = [cy[t] for t in common] + [sum(v for t, v in cy.items() if t not in common)]
    na, nb = sum(hx), sum(hy)
    stat, dof = 0.0, -1
    for a, b in zip(hx, hy, strict=True):
        if a + b:
            ea, eb = (a + b) * na / (na + nb), (a + b) * nb / (na + nb)
            stat += (a - ea) ** 2 / ea + (b - eb) ** 2 / eb
            dof += 1
    if dof <= 0:
        return 1.0
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


# --- a numpy reference of llama.cpp's sampler chain -----------------------------------------


def reference(
    logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> dict[int, float]:
    """Token probabilities after top-k, top-p, min-p (at temperature 1), then temperature:
    the order and rules of llama.cpp's default chain."""
    ids = np.arange(len(logits))
    lg = logits.astype(np.float64)
    if top_k > 0:
        keep = np.argsort(-lg, kind="stable")[:top_k]
        ids, lg = ids[keep], lg[keep]
    if top_p < 1.0:
        order = np.argsort(-lg, kind="stable")
        ids, lg = ids[order], lg[order]
        p = np.exp(lg - lg.max())
        p /= p.sum()
        last = int(np.searchsorted(np.cumsum(p), top_p)) + 1
        ids, lg = ids[:last], lg[:last]
    if min_p > 0.0:
        keep = lg >= lg.max() + math.log(min_p)
        ids, lg = ids[keep], lg[keep]
    p = np.exp((lg - lg.max()) / temperature)
    p /= p.sum()
    return {int(t): float(q) for t, q in zip(ids, p, strict=True)}


def first_logits(model: Model, prompt: list[int]) -> np.ndarray:
    ctx = Context.create(model, ContextConfig(n_ctx=256, threads=2), n_outputs_max=1, n_outputs_max_per_seq=1)
    b = Batch()
    b.add_sequence(prompt, 0, 0, logits="last")
    ctx.decode(b)
    return np.array(ctx.logits[-1])


SAMPLERS = [
    {"temperature": 1.0, "top_k": 3},
    {"temperature": 1.0, "top_p": 0.6},
    {"temperature": 1.0, "min_p": 0.05},
    {"temperature": 0.6, "top_k": 8, "top_p": 0.9},
]


@pytest.mark.parametrize("sampling", SAMPLERS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
async def test_top_k_top_p_min_p_and_temperature_match_llama_cpp(
    model_paths: dict[str, Path], models: ModelCache, sampling: dict[str, float]
) -> None:
    n = 400
    expected = reference(first_logits(models("llama-soft"), PROMPT), **sampling)  # type: ignore[arg-type]
    assert 2 <= len(expected) < 50  # a distribution with something to compare
    async with Engine(config(model_paths, "llama-soft", None, "none", 8)) as engine:
        outs = await gather(
            *(engine.generate(PROMPT, SamplingParams(max_tokens=1, seed=i, **sampling)) for i in range(n))  # type: ignore[arg-type]
        )
    got = Counter(o.token_ids[0] for o in outs)
    assert set(got) <= set(expected), set(got) - set(expected)  # nothing outside the kept set
    tokens = sorted(expected, key=lambda t: -expected[t])
    p = chi2_p_value([got[t] for t in tokens], [n * expected[t] for t in tokens])
    assert p > 1e-3, (p, {t: (got[t], round(n * expected[t], 1)) for t in tokens[:8]})


def penalized_greedy(
    model: Model, prompt: list[int], n: int, rep: float, freq: float, pres: float, last_n: int
) -> tuple[list[int], list[float]]:
    """Greedy decoding with llama.cpp's penalty rules (over the last ``last_n`` tokens,
    prompt included), and each step's margin between the best two tokens."""
    ctx = Context.create(model, ContextConfig(n_ctx=256, threads=2), n_outputs_max=1, n_outputs_max_per_seq=1)
    b = Batch()
    b.add_sequence(prompt, 0, 0, logits="last")
    ctx.decode(b)
    seen, out, margins = list(prompt), [], []
    for _ in range(n):
        lg = np.array(ctx.logits[-1], dtype=np.float64)
        for t, c in Counter(seen[-last_n:]).items():
            lg[t] = lg[t] * rep if lg[t] <= 0 else lg[t] / rep
            lg[t] -= c * freq + pres
        tok = int(np.argmax(lg))
        out.append(tok)
        margins.append(
            float(lg[tok] - max(lg[:tok].max(initial=-np.inf), lg[tok + 1 :].max(initial=-np.inf)))
        )
        seen.append(tok)
        b = Batch()
        b.add(tok, len(seen) - 1, 0, True)
        ctx.decode(b)
    return out, margins


PENALTIES = [
    {"repetition_penalty": 1.6},
    {"presence_penalty": 6.0},
    {"frequency_penalty": 3.0},
]


@pytest.mark.parametrize("spec", ["none", "draft"])
@pytest.mark.parametrize("penalty", PENALTIES, ids=lambda p: next(iter(p)))
async def test_penalties_match_llama_cpp(
    model_paths: dict[str, Path], models: ModelCache, spec: str, penalty: dict[str, float]
) -> None:
    """Greedy with a penalty equals a numpy reference of the penalty on the same logits,
    and differs from greedy without it (the penalty acts); with speculation the drafts
    (plain greedy tokens of the same model) are verified under the penalty."""
    tm = models("llama")
    prompts = [[1000 + 13 * i, 2000, 3000 + i] for i in range(6)]
    n = 24
    rep, pres, freq = (
        penalty.get(k, d)
        for k, d in (("repetition_penalty", 1.0), ("presence_penalty", 0.0), ("frequency_penalty", 0.0))
    )
    refs = [penalized_greedy(tm, p, n, rep, freq, pres, last_n=64) for p in prompts]
    plain = [penalized_greedy(tm, p, n, 1.0, 0.0, 0.0, last_n=64)[0] for p in prompts]
    cfg = config(model_paths, "llama", "llama" if spec == "draft" else None, spec, 4, draft_policy="fixed")
    async with Engine(cfg) as engine:
        outs = await gather(
            *(engine.generate(p, SamplingParams(max_tokens=n, penalty_last_n=64, **penalty)) for p in prompts)  # type: ignore[arg-type]
        )
        compared = 0
        for out, (ref, margins) in zip(outs, refs, strict=True):
            k = next((i for i, m in enumerate(margins) if m < 0.05), n)  # up to the first near-tie
            assert out.token_ids[:k] == ref[:k]
            compared += k
        assert compared >= 3 * n  # most of it compared
        assert any(o.token_ids != b for o, b in zip(outs, plain, strict=True))  # the penalty acted
        if spec == "draft":
            assert engine.metrics.drafted > engine.metrics.accepted > 0


async def test_sampling_is_lossless_with_a_real_draft(model_paths: dict[str, Path]) -> None:
    """At temperature 1, the tokens at every position (the first from the prompt's logits,
    the next ones through draft verification) have the same distribution with a draft
    model as without; the draft is another model (llama-soft's weights with twice its
    logits: often right, sometimes wrong), the two arms use independent seeds. A third arm
    at another temperature shows the test can tell distributions apart."""
    n, n_tokens = 500, 4
    arms: dict[str, list[list[int]]] = {}
    for arm, spec, draft, temperature, seed0 in (
        ("plain", "none", None, 1.0, 0),
        ("speculative", "draft", "llama-soft-sharp", 1.0, 10_000),
        ("control", "none", None, 0.7, 20_000),
    ):
        cfg = config(model_paths, "llama-soft", draft, spec, 8, draft_policy="fixed")
        async with Engine(cfg) as engine:
            outs = await gather(
                *(
                    engine.generate(
                        PROMPT, SamplingParams(max_tokens=n_tokens, temperature=temperature, seed=seed0 + i)
                    )
                    for i in range(n)
                )
            )
            arms[arm] = [o.token_ids for o in outs]
            if spec == "draft":
                m = engine.metrics
                assert 0.2 * m.drafted < m.accepted < 0.9 * m.drafted, (m.accepted, m.drafted)
    for pos in range(n_tokens):
        plain = [s[pos] for s in arms["plain"]]
        p = two_sample_p_value(plain, [s[pos] for s in arms["speculative"]])
        assert p > 1e-3, (pos, p)
    controls = [
        two_sample_p_value([s[pos] for s in arms["plain"]], [s[pos] for s in arms["control"]])
        for pos in range(n_tokens)
    ]
    assert min(controls) < 1e-3, controls  # a real difference is detected
    assert len({tuple(s) for s in arms["plain"]}) > 100  # temperature 1 really samples
