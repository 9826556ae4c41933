"""Log-probabilities and logit bias through the engine, against a plain decode's
log-softmax, with and without speculation (real extension, tiny models)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine import Engine, SamplingParams
from engine.scheduler.output import TokenLogprob
from engine.session import Batch, Context, ContextConfig, InvalidConfigError, Model
from tests.aio import gather
from tests.conftest import ModelCache
from tests.helpers import PARITY, config, mixed_requests

pytestmark = pytest.mark.timeout(600)

TOP = 5


def reference_logprobs(model: Model, prompt: list[int], output: list[int]) -> np.ndarray:
    """log-softmax of the target's logits at each output position: one plain decode of
    prompt + output (every position's logits), no speculation, one sequence."""
    tokens = prompt + output[:-1]
    ctx = Context.create(model, ContextConfig(n_ctx=512, n_seq=1, n_batch=512, n_ubatch=512))
    b = Batch()
    for i, t in enumerate(tokens):
        b.add(t, i, 0, i >= len(prompt) - 1)
    ctx.decode(b)
    logits = np.asarray(ctx.logits, dtype=np.float64)
    shifted = logits - logits.max(axis=1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))


def assert_logprobs_match(
    model: Model, entries: list[TokenLogprob], output: list[int], ref: np.ndarray
) -> None:
    assert [e.token_id for e in entries] == output
    for i, e in enumerate(entries):
        row = ref[i]
        assert e.logprob == pytest.approx(row[e.token_id], abs=2e-3), i
        assert len(e.top) == TOP
        values = [c.logprob for c in e.top]
        assert values == sorted(values, reverse=True)
        # the top k are the k largest (ties may order differently)
        assert values == pytest.approx(sorted(row, reverse=True)[:TOP], abs=2e-3), i
        for token, lp, piece in e.top:
            assert lp == pytest.approx(row[token], abs=2e-3), (i, token)
            assert piece == model.token_to_piece(token)
        assert e.piece == model.token_to_piece(e.token_id)


# every drafter, with drafts always right, sometimes right, mostly wrong, and none
@pytest.mark.parametrize(("name", "target", "draft", "spec", "extra"), PARITY, ids=[p[0] for p in PARITY])
async def test_logprobs_equal_a_plain_decodes_log_softmax(
    model_paths: dict[str, Path],
    models: ModelCache,
    name: str,
    target: str,
    draft: str | None,
    spec: str,
    extra: dict[str, int],
) -> None:
    requests = mixed_requests(8, seed=3)
    cfg = config(model_paths, target, draft, spec, 4, spec_extra=extra, draft_policy="fixed")
    async with Engine(cfg) as engine:
        outs = await gather(
            *(engine.generate(p, SamplingParams(max_tokens=n, logprobs=TOP)) for p, n in requests)
        )
        plain = await engine.generate(requests[0][0], SamplingParams(max_tokens=4))
        streamed = []
        async for delta in engine.stream(requests[1][0], SamplingParams(max_tokens=12, logprobs=TOP)):
            assert delta.logprobs is not None and len(delta.logprobs) == len(delta.token_ids)
            streamed.extend(delta.logprobs)
        if spec != "none":  # rows after accepted drafts (after rejected ones: the random draft)
            assert engine.metrics.drafted > 0, name
            assert engine.metrics.accepted > 0 or name == "draft", name
    tm = models(target, mtp=spec == "mtp")
    for (prompt, _), out in zip(requests, outs, strict=True):
        assert out.logprobs is not None
        assert_logprobs_match(tm, out.logprobs, out.token_ids, reference_logprobs(tm, prompt, out.token_ids))
    assert plain.logprobs is None  # not asked for: not computed
    ids = [e.token_id for e in streamed]
    assert_logprobs_match(tm, streamed, ids, reference_logprobs(tm, requests[1][0], ids))


async def test_sampled_tokens_logprobs_and_logit_bias(
    model_paths: dict[str, Path], models: ModelCache
) -> None:
    prompt = list(range(1000, 1040))
    cfg = config(model_paths, "walk-llama", "walk-llama", "draft", 2)
    async with Engine(cfg) as engine:
        # sampling: the sampled token's logprob is still the target's raw distribution
        hot = SamplingParams(max_tokens=16, temperature=1.5, seed=7, logprobs=0)
        sampled = await engine.generate(prompt, hot)
        greedy = await engine.generate(prompt, SamplingParams(max_tokens=4))
        # banning the greedy first token makes the first token something else; a bias on
        # another token makes it the first token
        banned = await engine.generate(
            prompt, SamplingParams(max_tokens=4, logit_bias={greedy.token_ids[0]: float("-inf")})
        )
        pushed = await engine.generate(prompt, SamplingParams(max_tokens=1, logit_bias={4321: 100.0}))
        with pytest.raises(InvalidConfigError, match="logprobs"):
            SamplingParams(logprobs=21)
        with pytest.raises(InvalidConfigError, match="logit_bias"):
            SamplingParams(logit_bias={"a": 1.0})  # type: ignore[dict-item]
        # a token id past the vocabulary fails that request only, the engine goes on
        with pytest.raises(Exception, match="logit_bias token id"):
            await engine.generate(prompt, SamplingParams(max_tokens=2, logit_bias={10**7: 1.0}))
        again = await engine.generate(prompt, SamplingParams(max_tokens=4))
    assert sampled.logprobs is not None
    ref = reference_logprobs(models("walk-llama"), prompt, sampled.token_ids)
    for i, e in enumerate(sampled.logprobs):
        assert e.top == () and e.logprob == pytest.approx(ref[i][e.token_id], abs=2e-3)
    assert banned.token_ids[0] != greedy.token_ids[0]
    assert pushed.token_ids == [4321]
    assert again.token_ids == greedy.token_ids
