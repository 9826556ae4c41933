"""The chatbot's turn reuse: the next turn reads only the new tokens (through the engine's
prefix cache, or resuming the saved sequence when there is none), and its reply is what
reading the whole conversation from scratch gives."""

from __future__ import annotations

from pathlib import Path

from engine import Engine, SamplingParams
from engine.chat import ChatSession, Conversation
from engine.session.checkpoint import unpack
from tests.helpers import config

GREEDY = SamplingParams(max_tokens=10, temperature=0.0)


async def test_turns_reuse_the_cache_and_equal_a_cold_read(model_paths: dict[str, Path]) -> None:
    async with Engine(config(model_paths, "llama", None, "none", 2, n_ctx=512)) as engine:
        chat = ChatSession(engine, GREEDY, system="Be brief.")
        first = await chat.reply("hello there, how are you today?")
        assert first.cached_tokens == 0 and first.completion_tokens == 10
        second = await chat.reply("and now?", measure_cold=True)
        # the whole conversation was sent; the cache held the first turn (up to where the
        # reply's text tokenizes differently from the tokens generated)
        assert second.cached_tokens >= first.prompt_tokens and second.cold_ttft is not None
        assert second.prompt_tokens < 24  # read: the reply's end, the closing, the new message
        cold = await engine.generate(chat.conversation.messages[:-1], GREEDY, cache_prompt=False)
        assert cold.text == second.text and cold.metrics.cached_tokens == 0
        third = await chat.reply("one more")
        assert third.cached_tokens > second.cached_tokens


async def test_turns_resume_and_equal_a_cold_read(model_paths: dict[str, Path], tmp_path: Path) -> None:
    """Without a prefix cache each turn resumes from the last reply's checkpoint."""
    cfg = config(model_paths, "walk-llama", None, "none", 2, n_ctx=512, prefix_cache=False)
    async with Engine(cfg) as engine:
        chat = ChatSession(engine, GREEDY, system="Be brief.")
        first = await chat.reply("hello there")
        assert first.cached_tokens == 0 and first.completion_tokens == 10
        ck = chat.conversation.checkpoint
        assert ck is not None
        meta = unpack(ck).meta
        sequence = [*meta["history"], meta["last"]]  # what the next turn continues

        pieces: list[str] = []
        second = await chat.reply("and now?", pieces.append, measure_cold=True)
        assert second.cached_tokens == len(meta["history"]) and second.cold_ttft is not None
        assert 0 < second.prompt_tokens < 40  # only the new turn's tokens were read
        assert "".join(pieces) == second.text == chat.conversation.messages[-1]["content"]
        assert [m["role"] for m in chat.conversation.messages] == [
            "system", "user", "assistant", "user", "assistant"
        ]  # fmt: skip

        # the same tokens read from scratch give the same greedy reply
        meta2 = unpack(chat.conversation.checkpoint or b"").meta
        # the sequence now holds: the first turn, the new tokens, the reply but its last token
        read = meta2["history"][: len(meta2["history"]) - (second.completion_tokens - 1)]
        assert read[: len(sequence)] == sequence and len(read) - len(sequence) == second.prompt_tokens
        cold = await engine.generate(read, GREEDY)
        assert cold.token_ids == [*meta2["history"][len(read) :], meta2["last"]]
        assert cold.text == second.text

        # save, load into a fresh session, continue
        path = tmp_path / "c.json"
        chat.conversation.save(path)
        other = ChatSession(engine, GREEDY)
        other.conversation = Conversation.load(path)
        third = await other.reply("one more")
        assert third.cached_tokens == len(meta2["history"])

        # a damaged saved state is not fatal: the conversation is read again
        other.conversation.checkpoint = b"ENGCKPT1 but not really"
        fourth = await other.reply("still there?")
        assert fourth.cached_tokens == 0 and fourth.completion_tokens == 10
        assert other.conversation.checkpoint is not None and other.conversation.checkpoint.startswith(
            b"ENGCKPT1"
        )


async def test_a_state_from_another_configuration_is_read_again(model_paths: dict[str, Path]) -> None:
    async with Engine(config(model_paths, "walk-llama", None, "none", 2, n_ctx=512)) as engine:
        chat = ChatSession(engine, GREEDY)
        await chat.reply("hello there")
        saved = chat.conversation
    async with Engine(config(model_paths, "walk-llama", None, "none", 2, n_ctx=384)) as other:
        chat = ChatSession(other, GREEDY)
        chat.conversation = saved
        again = await chat.reply("and now?")  # the state does not fit: StateError, then a cold read
        assert again.cached_tokens == 0 and again.completion_tokens == 10
        assert [m["role"] for m in chat.conversation.messages] == ["user", "assistant", "user", "assistant"]
