"""Chat through llama.cpp's chat module: the GGUF's own Jinja template, tool calls and
reasoning, on the real extension and tiny models (``llama-tools`` carries Qwen 2.5's
template, with its <tool_call> format, in its GGUF), through the engine and the server."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine import ChatOptions, Engine, EngineConfig, SamplingParams
from engine.session import ChatParser, ChatTemplate, InvalidArgumentError, InvalidConfigError
from tests.conftest import ModelCache
from tests.models.make_models import VENDOR
from tests.test_server import MODEL, client, serving

pytestmark = pytest.mark.timeout(300)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a time zone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["zone"],
        },
    },
}
ASK: list[dict[str, Any]] = [{"role": "user", "content": "What is the weather in Paris?"}]
#: a random-weight model pads a forced call with whitespace the grammar allows
CALL_TOKENS = 320
#: Qwen 3's template: thinking in <think> tags before the answer
THINKING_TEMPLATE = (VENDOR / "models" / "templates" / "Qwen-Qwen3-0.6B.jinja").read_text()


def check_call(name: str, arguments: str, tools: list[dict[str, Any]]) -> None:
    """A call of one of ``tools`` whose arguments parse against its schema (enums included)."""
    tool = next(t["function"] for t in tools if t["function"]["name"] == name)
    args = json.loads(arguments)
    schema = tool["parameters"]
    assert set(args) == set(schema["required"]), args
    for key, value in args.items():
        assert value in schema["properties"][key]["enum"], (key, value)


def tools_config(paths: dict[str, Path], **kw: Any) -> EngineConfig:
    return EngineConfig(model=paths["llama-tools"], n_seq=2, n_ctx=1024, n_batch=512, threads=2, **kw)


def test_the_gguf_template_renders_tools_and_its_parser_streams_calls_in_openai_form(
    models: ModelCache,
) -> None:
    m = models("llama-tools")
    template = m.chat_template()
    assert template.jinja and "tokenizer.chat_template" in template.name
    assert template.caps["supports_tool_calls"]
    rendered = template.render(ASK, ChatOptions(tools=[WEATHER, TIME]))
    assert "get_weather" in rendered.prompt and "get_time" in rendered.prompt
    assert rendered.parse_tool_calls and rendered.grammar.lazy  # "auto": constrained once a call starts
    # the model's answer in the template's format, fed a few characters at a time
    text = 'Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    parser = ChatParser(rendered)
    content, calls = "", []
    for i in range(0, len(text), 5):
        _, c, deltas = parser.update(text[i : i + 5])
        content += c
        calls += deltas
    _, c, deltas = parser.update("", final=True)
    content += c
    calls += deltas
    assert content == "Let me look."
    first, rest = calls[0], calls[1:]
    assert first.id and first.id.startswith("call_") and first.name == "get_weather"  # id and name first
    assert all(d.id is None and d.name is None for d in rest) and len(rest) >= 1  # then arguments
    arguments = "".join(d.arguments for d in calls)
    message = parser.message()
    assert message.content == "Let me look." and len(message.tool_calls) == 1
    assert message.tool_calls[0].arguments == arguments and message.tool_calls[0].id == first.id
    check_call("get_weather", arguments, [WEATHER])
    # history with a call and its result renders in the template's own form
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    prompt = template.render(history, ChatOptions(tools=[WEATHER])).prompt
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in prompt
    with pytest.raises(InvalidArgumentError, match="get_nothing"):
        template.render(ASK, ChatOptions(tools=[WEATHER], tool_choice="get_nothing"))


def test_a_template_the_chat_module_refuses_fails_the_start_naming_it(models: ModelCache) -> None:
    with pytest.raises(InvalidConfigError, match="the template given"):
        ChatTemplate(models("llama"), "{% for x in %}")
    # a template without a tool format takes no tools (they would be dropped silently)
    plain = ChatTemplate(models("llama"), "chatml")
    assert plain.jinja and plain.render(ASK).prompt.endswith("<|im_start|>assistant\n")
    with pytest.raises(InvalidArgumentError, match="no tool format"):
        plain.render(ASK, ChatOptions(tools=[WEATHER]))
    assert "What is the weather" in plain.render(ASK, ChatOptions(tools=[WEATHER], tool_choice="none")).prompt
    with pytest.raises(InvalidArgumentError, match="built-in"):
        models("llama").chat_template().render(ASK, ChatOptions(tools=[WEATHER]))


async def test_required_and_named_calls_are_well_formed_even_from_a_random_model(
    model_paths: dict[str, Path],
) -> None:
    tools = [WEATHER, TIME]
    async with Engine(tools_config(model_paths)) as engine:
        for choice, expect in (
            ("required", None),
            ({"type": "function", "function": {"name": "get_time"}}, "get_time"),
        ):
            # (one call: with parallel calls a random model calls again and again)
            options = ChatOptions(tools=tools, tool_choice=choice, parallel_tool_calls=False)
            out = await engine.generate(ASK, SamplingParams(max_tokens=CALL_TOKENS), chat=options)
            assert out.message is not None and len(out.message.tool_calls) == 1, (out.finish_reason, out.text)
            assert out.finish_reason == "stop" and out.message.content == ""
            call = out.message.tool_calls[0]
            assert expect is None or call.name == expect
            check_call(call.name, call.arguments, tools)
            # streamed: the same calls, each announced (id, name) before its arguments
            seen: dict[int, dict[str, str]] = {}
            final = None
            async for delta in engine.stream(ASK, SamplingParams(max_tokens=CALL_TOKENS), chat=options):
                for d in delta.tool_calls or ():
                    if d.index not in seen:
                        assert d.id and d.name
                        seen[d.index] = {"name": d.name, "arguments": ""}
                    else:
                        assert d.id is None and d.name is None
                    seen[d.index]["arguments"] += d.arguments
                final = delta.output or final
            assert final is not None and final.message is not None
            assert [(c.name, c.arguments) for c in final.message.tool_calls] == [
                (c["name"], c["arguments"]) for c in seen.values()
            ]
            assert [(c.name, c.arguments) for c in final.message.tool_calls] == [
                (c.name, c.arguments) for c in out.message.tool_calls
            ]
        # tools offered but not called ("none"): plain content, no grammar
        out = await engine.generate(
            ASK, SamplingParams(max_tokens=8), chat=ChatOptions(tools=tools, tool_choice="none")
        )
        assert out.message is not None and not out.message.tool_calls and out.text
        with pytest.raises(InvalidArgumentError, match="chat messages only"):
            await engine.generate("text", SamplingParams(max_tokens=2), chat=ChatOptions(tools=tools))


async def test_thinking_comes_back_as_reasoning(model_paths: dict[str, Path]) -> None:
    # a grammar makes the random model answer as a thinking model does
    answer = 'root ::= "<think>\\nThe capital.\\n</think>\\n\\nParis"'
    params = SamplingParams(max_tokens=64, grammar=answer)
    async with Engine(tools_config(model_paths, chat_template=THINKING_TEMPLATE)) as engine:
        out = await engine.generate(ASK, params)
        assert out.message is not None
        assert (out.message.reasoning.strip(), out.text) == ("The capital.", "Paris")
        reasoning, content = "", ""
        async for delta in engine.stream(ASK, params):
            reasoning += delta.reasoning
            content += delta.text
            assert not (delta.reasoning and delta.text)  # the thinking, then the answer
        assert (reasoning, content) == (out.message.reasoning, "Paris")
        # reasoning not separated: the thinking stays in the content, as generated
        out = await engine.generate(ASK, params, chat=ChatOptions(reasoning=False))
        assert out.text.startswith("<think>") and out.text.endswith("Paris")


async def test_tool_calls_and_reasoning_over_http_in_openai_form(model_paths: dict[str, Path]) -> None:
    async with serving(tools_config(model_paths)) as (base, engine), client(base) as api:
        forced: Any = {
            "model": MODEL,
            "messages": ASK,
            "tools": [WEATHER, TIME],
            "tool_choice": "required",
            "max_tokens": CALL_TOKENS,
            "temperature": 0,
            "parallel_tool_calls": False,
        }
        whole = await api.chat.completions.create(**forced)
        choice = whole.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert choice.message.refusal is None and choice.message.tool_calls
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]  # type: ignore[union-attr]
        for name, arguments in calls:
            check_call(name, arguments, [WEATHER, TIME])
        stream = await api.chat.completions.create(**forced, stream=True)
        chunks = [c async for c in stream]
        first = chunks[0].choices[0]
        assert first.delta.role == "assistant" and first.finish_reason is None and first.logprobs is None
        streamed: dict[int, list[str]] = {}
        for c in chunks:
            for d in (c.choices[0].delta.tool_calls or []) if c.choices else []:
                if d.index not in streamed:
                    assert d.id and d.type == "function" and d.function and d.function.name
                    streamed[d.index] = [d.function.name, d.function.arguments or ""]
                else:
                    assert d.id is None and d.function and d.function.name is None
                    streamed[d.index][1] += d.function.arguments or ""
        assert [tuple(v) for v in streamed.values()] == calls
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # a thinking template: reasoning_content, streamed apart from the content; dropped, or
    # left in the content, as the request asks
    answer = 'root ::= "<think>\\nThe capital.\\n</think>\\n\\nParis"'
    grammar = {"grammar": answer}
    async with (
        serving(tools_config(model_paths, chat_template=THINKING_TEMPLATE)) as (base, _),
        client(base) as api,
    ):
        out = await api.chat.completions.create(model=MODEL, messages=ASK, max_tokens=64, extra_body=grammar)  # type: ignore[arg-type]
        msg = out.choices[0].message
        assert (
            msg.content == "Paris" and (msg.model_extra or {})["reasoning_content"].strip() == "The capital."
        )
        out = await api.chat.completions.create(
            model=MODEL,
            messages=ASK,
            max_tokens=64,
            extra_body={**grammar, "include_reasoning": False},  # type: ignore[arg-type]
        )
        assert out.choices[0].message.content == "Paris" and "reasoning_content" not in (
            out.choices[0].message.model_extra or {}
        )
        out = await api.chat.completions.create(
            model=MODEL,
            messages=ASK,
            max_tokens=64,
            extra_body={**grammar, "separate_reasoning": False},  # type: ignore[arg-type]
        )
        assert (out.choices[0].message.content or "").startswith("<think>")
        for stream_reasoning, pieces in ((True, 2), (False, 1)):
            stream = await api.chat.completions.create(
                model=MODEL,
                messages=ASK,
                max_tokens=64,
                stream=True,  # type: ignore[arg-type]
                extra_body={**grammar, "stream_reasoning": stream_reasoning},
            )
            reasoning = [
                (c.choices[0].delta.model_extra or {}).get("reasoning_content")
                async for c in stream
                if c.choices
            ]
            held = [r for r in reasoning if r]
            assert "".join(held).strip() == "The capital." and (
                len(held) >= pieces if stream_reasoning else len(held) == 1
            )


async def test_a_tool_round_trip_through_langchain_bind_tools(model_paths: dict[str, Path]) -> None:
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return f"sunny in {city}"

    async with serving(tools_config(model_paths)) as (base, engine), httpx.AsyncClient() as http:
        llm = ChatOpenAI(
            base_url=f"{base}/v1",
            api_key="unused",
            model=MODEL,
            temperature=0,  # type: ignore[arg-type]
            max_tokens=CALL_TOKENS,
            http_async_client=http,
        )
        called = llm.bind_tools([get_weather], tool_choice="get_weather", parallel_tool_calls=False)
        history: list[Any] = [HumanMessage("What is the weather in Paris?")]
        ai = await called.ainvoke(history)
        assert ai.tool_calls and ai.tool_calls[0]["name"] == "get_weather"  # type: ignore[attr-defined]
        call = ai.tool_calls[0]  # type: ignore[attr-defined]
        assert set(call["args"]) == {"city"}
        history += [ai, ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])]
        answer = await llm.bind_tools([get_weather], tool_choice="none").ainvoke(history)
        assert isinstance(answer.content, str) and answer.content and not answer.tool_calls  # type: ignore[attr-defined]
        usage = answer.response_metadata["token_usage"]
        # the conversation so far was still in the KV cache: only the turn's new tokens were read
        assert usage["prompt_tokens_details"]["cached_tokens"] > 0
