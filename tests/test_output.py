"""The output path: the pure decision (no native call), and the stop-state contract on the
real engine: after a stop, the saved state is exactly what the caller saw, for every
drafter, and a resumed turn equals a cold read of those tokens."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from engine import Engine, SamplingParams
from engine.scheduler.output import FinishReason, StopRules, TextAssembler, process_output
from engine.session.checkpoint import unpack
from tests.aio import gather
from tests.conftest import ModelCache
from tests.helpers import PARITY, config
from tests.spec_loop import greedy_plain

pytestmark = pytest.mark.timeout(600)

EOG = 99


@dataclass
class Seq:
    """What the output path reads and writes of a request."""

    text: TextAssembler
    output_ids: list[int] = field(default_factory=list)
    history: list[int] = field(default_factory=list)
    last: int | None = None


@dataclass
class Verified:
    tokens: list[int]
    pieces: list[bytes]
    logprobs: list[tuple[float, list[tuple[int, float, bytes]]]] = field(default_factory=list)


def verified(*tokens: int) -> Verified:
    return Verified(list(tokens), [f" t{t}".encode() for t in tokens])


def rules(
    max_tokens: int = 100, stop_ids: tuple[int, ...] = (), n_ctx: int = 1000, eog: bool = True
) -> StopRules:
    return StopRules(frozenset({EOG}) if eog else frozenset(), frozenset(stop_ids), max_tokens, n_ctx)


def seq(stop: tuple[str, ...] = (), history: int = 5) -> Seq:
    return Seq(TextAssembler(stop), history=list(range(history)))


def test_all_verified_tokens_are_kept_without_a_stop() -> None:
    s = seq()
    out = process_output(s, verified(10, 11, 12), rules())
    assert (out.keep, out.token_ids, out.finish_reason) == (3, [10, 11, 12], None)
    assert s.history == [0, 1, 2, 3, 4, 10, 11] and s.last == 12  # drafts in the KV cache, then the last


def test_a_stop_token_inside_accepted_drafts_keeps_the_state_at_the_stop() -> None:
    s = seq()
    out = process_output(s, verified(10, 7, 12, 13), rules(stop_ids=(7,)))
    assert (out.keep, out.token_ids, out.finish_reason) == (2, [10], "stop")
    # saved state = prompt + emitted + the stop token; 12 and 13 are rolled back
    assert [*s.history, s.last] == [0, 1, 2, 3, 4, 10, 7]
    assert out.text == " t10"


def test_end_of_generation_unless_ignored() -> None:
    s = seq()
    out = process_output(s, verified(10, EOG, 12), rules())
    assert (out.keep, out.token_ids, out.finish_reason) == (2, [10], "stop")
    s = seq()
    out = process_output(s, verified(10, EOG, 12), rules(eog=False))  # ignore_eos
    assert (out.keep, out.token_ids, out.finish_reason) == (3, [10, EOG, 12], None)


def test_a_stop_string_keeps_the_token_that_completed_it_and_cuts_its_text() -> None:
    s = seq(stop=("t11 t",))
    out = process_output(s, verified(10, 11, 12, 13), rules())
    assert (out.keep, out.token_ids, out.finish_reason) == (3, [10, 11, 12], "stop")
    assert out.text == " t10 " and s.text.text == " t10 "
    assert s.last == 12 and s.history[-2:] == [10, 11]


def test_max_tokens_and_the_context_end() -> None:
    s = seq()
    s.output_ids = [1] * 8
    out = process_output(s, verified(10, 11, 12), rules(max_tokens=10))
    assert (out.keep, out.token_ids, out.finish_reason) == (2, [10, 11], "length")
    s = seq(history=998)
    out = process_output(s, verified(10, 11), rules(n_ctx=1000))
    assert (out.keep, out.finish_reason) == (2, "length")  # 999 tokens in the KV cache: full
    s = seq(history=990)
    assert process_output(s, verified(10, 11), rules(n_ctx=1000)).finish_reason is None


def test_text_is_held_back_until_whole_and_released_at_the_end() -> None:
    s = Seq(TextAssembler(()))
    piece = "é".encode()
    out = process_output(s, Verified([1], [piece[:1]]), rules())
    assert out.text == "" and out.token_ids == [1]
    out = process_output(s, Verified([2, EOG], [piece[1:], b""]), rules())
    assert out.text == "é" and out.finish_reason == FinishReason.STOP.value


# --- the contract on the engine ------------------------------------------------------------

#: every drafter of the parity test (walk targets: greedy is exact), each on one backend
CONTRACT = [(*p, ("asyncio", "trio")[i % 2]) for i, p in enumerate(PARITY)]


@pytest.mark.parametrize(
    ("name", "target", "draft", "spec", "extra", "anyio_backend"), CONTRACT, ids=[c[0] for c in CONTRACT]
)
async def test_the_saved_state_after_a_stop_is_what_the_caller_saw(
    model_paths: dict[str, Path],
    models: ModelCache,
    name: str,
    target: str,
    draft: str | None,
    spec: str,
    extra: dict[str, int],
    anyio_backend: str,
) -> None:
    tm = models(target, mtp=spec == "mtp")
    rng = random.Random(3)
    starts = [[rng.randrange(1000, 20000) for _ in range(rng.randrange(2, 12))] for _ in range(12)]
    # prompts that already hold a stretch of their continuation: n-gram drafts from the start
    prompts = [[*p, *greedy_plain(tm, p, 8)] for p in starts]
    full = [greedy_plain(tm, p, 24) for p in prompts]
    cfg = config(model_paths, target, draft, spec, 4, n_ctx=256, spec_extra=extra, draft_policy="fixed")
    async with Engine(cfg) as engine:

        async def stopped(i: int) -> None:
            prompt, tokens = prompts[i], full[i]
            j = rng.randrange(2, 20)  # where the stop falls
            if i % 2:  # a stop token id: not handed out, but in the state
                params = SamplingParams(max_tokens=24, stop_token_ids=(tokens[j],))
                k = tokens.index(tokens[j])
                seen, state = tokens[:k], tokens[: k + 1]
            else:  # a stop string: the text of token j (the token that completes it is kept)
                stop = tm.token_to_piece(tokens[j]).decode()
                params = SamplingParams(max_tokens=24, stop=(stop,))
                seen = state = None
            out = await engine.generate(prompt, params, checkpoint=True)
            assert out.finish_reason == "stop" and out.checkpoint is not None
            if seen is None:
                text = tm.detokenize(tokens)
                cut = text.index(stop)
                assert out.text == text[:cut]
                seen = state = out.token_ids
                assert seen == tokens[: len(seen)] and stop in tm.detokenize(seen)
            assert out.token_ids == seen
            meta = unpack(out.checkpoint).meta
            assert [*meta["history"], meta["last"]] == [*prompt, *state], (name, i)
            # the next turn reads the saved state: equal to reading it all from scratch
            more = [rng.randrange(1000, 20000) for _ in range(3)]
            resumed = await engine.generate(more, SamplingParams(max_tokens=8), resume_from=out.checkpoint)
            assert resumed.token_ids == greedy_plain(tm, [*prompt, *state, *more], 8), (name, i)

        await gather(*(stopped(i) for i in range(len(prompts))))
        m = engine.metrics
        # no batch was refused: a state with rows past the stop would make the resumed
        # prefill's positions inconsistent (the step retries alone, which would hide it)
        assert m.isolated_failures == 0 and m.draft_failures == 0, (name, m)
        if name in ("draft-self", "mtp", "ngram", "eagle3", "dflash"):
            assert m.cut_tokens > 0, name  # stops did fall inside accepted drafts
