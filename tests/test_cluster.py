"""Scale-out on Ray Serve: a real local Ray cluster in this process, two engine replicas on
the tiny models behind the OpenAI ingress, driven over HTTP by the ``openai`` client."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio
import httpx
import openai
import pytest
import ray
import yaml
from anyio.abc import TaskStatus
from ray import serve

from engine.cluster import ClusterConfig, build_app
from engine.cluster.routing import PrefixIndex, prefer, routing_text
from engine.server.protocol import ChatRequest, CompletionRequest
from tests.aio import gather
from tests.test_server import _free_port

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]

MODEL = "tiny"
APP = "engine"


# --- the router's logic, no cluster --------------------------------------------------
def test_the_prefix_index_finds_the_replica_holding_the_longest_prefix() -> None:
    index = PrefixIndex(block=8)
    index.insert("shared: conv one turn one", "a")  # blocks "shared: ", "conv one", "turn one"
    index.insert("shared: conv two turn two", "b")
    assert index.match("shared: conv one turn one, and then") == ("a", 24)
    assert index.match("shared: conv two turn two, and then") == ("b", 24)
    assert index.match("shared: another") == ("b", 8)  # the shared block: whoever held it last
    assert index.match("something else entirely") == (None, 0)
    assert index.match("short") == (None, 0)  # shorter than a block: nothing to match
    index.forget("b")
    assert index.match("shared: conv two turn two") == (None, 0)
    assert index.match("shared: conv one turn one") == (None, 0)  # (b held the shared block last)
    small = PrefixIndex(block=4, capacity=3)
    small.insert("aaaabbbbccccdddd", "x")
    assert len(small) == 3 and small.match("aaaabbbb") == (None, 0)  # the oldest keys went first
    # a conversation's next turn extends its last by whole messages: found at the message's
    # end, though it is not a whole block
    chats = PrefixIndex(block=64)
    turn1 = "a long system prompt shared by everyone, " * 3 + "\x1e" + "customer 1: hello\x1e"
    chats.insert(turn1, "home")
    chats.insert("a long system prompt shared by everyone, " * 3 + "\x1e" + "customer 2: hi\x1e", "away")
    turn2 = turn1 + "an answer\x1e" + "and more\x1e"
    assert chats.match(turn2) == ("home", len(turn1))


def test_the_preferred_replica_unless_its_slots_are_full_and_it_is_much_busier() -> None:
    assert prefer("a", {"a": 3, "b": 1}, slots=4, imbalance=1) == (["a"], ["b"])  # a free slot
    assert prefer("a", {"a": 7, "b": 0}, slots=8, imbalance=2) == (["a"], ["b"])  # still one
    assert prefer("a", {"a": 4, "b": 3}, slots=4, imbalance=2) == (["a"], ["b"])  # full, not much busier
    assert prefer("a", {"a": 6, "b": 1}, slots=4, imbalance=2) == (
        ["b"],
        ["a"],
    )  # full, 5 busier than 2 allows
    assert prefer("a", {"a": None, "b": 5}, slots=4, imbalance=2) == (
        ["a"],
        ["b"],
    )  # unknown load counts as 0
    assert prefer(None, {"a": 1, "b": 1, "c": 2}, slots=4, imbalance=2) == (["a", "b"], ["c"])
    assert prefer("gone", {"a": 2, "b": 1}, slots=4, imbalance=2) == (["b"], ["a"])


def test_the_routing_text_is_the_prompt_or_the_messages_in_order() -> None:
    chat = ChatRequest.model_validate(
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": "sys"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            ],
        }
    )
    assert routing_text(chat) == "sys\x1ehi\x1e"
    assert routing_text(CompletionRequest.model_validate({"model": "m", "prompt": "once"})) == "once"
    assert routing_text(CompletionRequest.model_validate({"model": "m", "prompt": [1, 2]})) == "1 2"


def test_print_config_writes_a_serve_deploy_file(model_paths: dict[str, Path]) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "engine",
            "cluster",
            "--print-config",
            "--model",
            str(model_paths["walk-llama"]),
        ]
        + ["--router", "session", "--replicas", "3", "--replica-cpus", "0.5"],
        capture_output=True,
        text=True,
        check=True,
    )
    deploy = yaml.safe_load(out.stdout)
    app = deploy["applications"][0]
    assert app["import_path"] == "engine.cluster:app_builder"
    config = ClusterConfig(**app["args"])  # what serve deploy hands app_builder
    assert (config.router, config.replicas, config.replica_cpus) == ("session", 3, 0.5)
    assert (
        Path(config.engine["model"]).is_absolute() and config.engine["speculative"]["type"] == "ngram-simple"
    )


# Serve awaits the replica's async __del__; collecting the object later calls it again
# without awaiting it (as in a replica whose process outlives it)
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
async def test_a_replica_reports_its_load_and_fails_its_health_check_once_its_engine_is_gone(
    model_paths: dict[str, Path],
) -> None:
    """The replica class itself (no Serve): routing stats, health, the engine's end."""
    from engine.cluster.deployments import EngineReplica
    from engine.cluster.routing import ReplicaRequest

    engine = {"model": str(model_paths["walk-llama"]), "n_seq": 2, "n_ctx": 256, "speculative": "none"}
    replica = EngineReplica.__new__(EngineReplica)
    await replica.__init__(engine, MODEL, 1)  # type: ignore[misc]
    body = CompletionRequest.model_validate({"model": MODEL, "prompt": "hi", "max_tokens": 3})
    reply = await replica.answer(ReplicaRequest(body, "hi"))
    assert reply["status"] == 200 and reply["body"]["usage"]["completion_tokens"] == 3
    stats = await replica.record_routing_stats()
    assert stats["running"] == 0 and stats["kv_cached"] > 0 and stats["kv_capacity"] == 512
    bad = await replica.answer(
        ReplicaRequest(CompletionRequest.model_validate({"model": MODEL, "prompt": [10**9]}))
    )
    assert bad["status"] == 400 and bad["body"]["error"]["code"] == "invalid_value"
    await replica.check_health()
    await replica.__del__()  # (what Serve calls on stopping it)
    with pytest.raises(RuntimeError, match="not serving"):
        await replica.check_health()


# --- a local Ray cluster ---------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    """Ray and Serve in this process (2 logical CPUs: one per replica); the HTTP base URL."""
    port = _free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def cluster_config(paths: dict[str, Path], router: str, **kw: Any) -> ClusterConfig:
    engine = {"model": str(paths["walk-llama"]), "n_seq": 8, "n_ctx": 1024, "speculative": "none"}
    return ClusterConfig(engine=engine, model_name=MODEL, router=router, replica_cpus=1.0, **kw)


async def run_app(config: ClusterConfig) -> None:
    """Deploy (or update) the app; returns once it is running. (Serve's calls block.)"""
    await anyio.to_thread.run_sync(lambda: serve.run(build_app(config), name=APP, route_prefix="/"))


@contextlib.asynccontextmanager
async def deployed(paths: dict[str, Path], router: str, **kw: Any) -> AsyncIterator[ClusterConfig]:
    config = cluster_config(paths, router, **kw)
    await run_app(config)
    try:
        yield config
    finally:
        await anyio.to_thread.run_sync(lambda: serve.delete(APP))


def api(base: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)


async def conversations(base: str, n: int, turns: int) -> list[list[tuple[str, int]]]:
    """``n`` concurrent conversations of ``turns`` turns, each resending the whole
    conversation: per turn, (the replica that served it, its cached prompt tokens)."""
    async with api(base) as client:

        async def one(i: int) -> list[tuple[str, int]]:
            messages: list[Any] = [
                {"role": "user", "content": f"conversation {i}: tell me about {i * 11}. " * 4}
            ]
            seen = []
            for turn in range(turns):
                raw = await client.chat.completions.with_raw_response.create(
                    model=MODEL, messages=messages, max_tokens=8, temperature=0
                )
                out = raw.parse()
                assert out.usage is not None and out.usage.prompt_tokens_details is not None
                seen.append(
                    (raw.headers["x-engine-replica"], out.usage.prompt_tokens_details.cached_tokens or 0)
                )
                messages += [
                    {"role": "assistant", "content": out.choices[0].message.content},
                    {"role": "user", "content": f"and then {turn}?"},
                ]
            return seen

        return await gather(*(one(i) for i in range(n)))


async def test_prefix_routing_keeps_each_conversation_on_its_replica(
    cluster: str, model_paths: dict[str, Path]
) -> None:
    async with deployed(model_paths, "prefix"):
        turns = await conversations(cluster, 8, 3)
    assert len({replica for conv in turns for replica, _ in conv}) == 2  # both replicas serve
    for conv in turns:
        first = conv[0][0]
        assert all(replica == first and cached > 0 for replica, cached in conv[1:]), conv


async def test_pow2_routing_spreads_conversations_over_the_replicas(
    cluster: str, model_paths: dict[str, Path]
) -> None:
    """The control: without the prefix router, later turns land on either replica."""
    async with deployed(model_paths, "pow2"):
        turns = await conversations(cluster, 8, 3)
    assert len({replica for conv in turns for replica, _ in conv}) == 2
    moved = sum(replica != conv[0][0] for conv in turns for replica, _ in conv[1:])
    assert moved > 0, turns


async def test_session_routing_keeps_a_session_together(cluster: str, model_paths: dict[str, Path]) -> None:
    async with deployed(model_paths, "session"):
        async with httpx.AsyncClient(base_url=cluster, timeout=60) as http:
            served: dict[str, set[str]] = {}
            for i in range(6):
                for session in ("alice", "bob", "carol", "dave"):
                    body = {"model": MODEL, "prompt": f"{session} {i}", "max_tokens": 2}
                    r = await http.post("/v1/completions", json=body, headers={"x-session-id": session})
                    assert r.status_code == 200
                    served.setdefault(session, set()).add(r.headers["x-engine-replica"])
    assert all(len(replicas) == 1 for replicas in served.values()), served


async def test_streams_through_the_proxy_with_the_openai_client(
    cluster: str, model_paths: dict[str, Path]
) -> None:
    async with deployed(model_paths, "prefix"):
        async with api(cluster) as client:
            stream = await client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "hello"}],
                max_tokens=6,
                n=2,
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = [c async for c in stream]  # (the SDK raises on a body cut before [DONE])
            assert {ch.index for c in chunks for ch in c.choices} == {0, 1}
            assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
            whole = await client.completions.create(model=MODEL, prompt="once", max_tokens=4, temperature=0)
            assert (
                whole.choices[0].finish_reason == "length"
                and whole.usage
                and whole.usage.completion_tokens == 4
            )
            with pytest.raises(openai.BadRequestError):
                await client.completions.create(
                    model=MODEL, prompt=[10**9], max_tokens=2
                )  # refused by a replica
            with pytest.raises(openai.NotFoundError):
                await client.completions.create(model="other", prompt="x", max_tokens=2)  # by the ingress


async def replicas_serving(http: httpx.AsyncClient, n: int, prompt: str) -> set[str]:
    """The replicas that served ``n`` short completions one after another (each must succeed)."""
    served = set()
    for i in range(n):
        r = await http.post(
            "/v1/completions", json={"model": MODEL, "prompt": f"{prompt} {i}", "max_tokens": 2}
        )
        assert r.status_code == 200
        served.add(r.headers["x-engine-replica"])
    return served


def _replica_pid(replica_id: str) -> int:
    actor = ray.get_actor(f"SERVE_REPLICA::{APP}#EngineReplica#{replica_id}", namespace="serve")
    return int(ray.get(actor.__ray_call__.remote(lambda _: os.getpid())))


def _running_replicas() -> int:
    status = serve.status().applications[APP].deployments["EngineReplica"]
    return int(status.replica_states.get("RUNNING", 0))


async def test_health_waits_for_the_engine_replicas(cluster: str, model_paths: dict[str, Path]) -> None:
    """A load balancer that polls /health sends nothing before the first deployment has all
    its engine replicas running (the ingress is up long before them)."""
    answers: list[tuple[int, int, str]] = []  # (status, running engine replicas, app status)

    async def poll(http: httpx.AsyncClient) -> None:
        while True:
            with contextlib.suppress(httpx.TransportError):
                code = (await http.get("/health")).status_code
                app = (await anyio.to_thread.run_sync(serve.status)).applications.get(APP)
                if code in (200, 503) and app is not None:
                    running = _running_replicas()
                    answers.append((code, running, str(app.status)))
                    if code == 200:
                        return
            await anyio.sleep(0.05)

    config = cluster_config(model_paths, "pow2")
    try:
        async with httpx.AsyncClient(base_url=cluster, timeout=30) as http, anyio.create_task_group() as tg:
            tg.start_soon(poll, http)
            await run_app(config)
            with anyio.fail_after(30):
                while not answers or answers[-1][0] != 200:
                    await anyio.sleep(0.1)
        code, running, status = answers[-1]
        assert running == 2 and status.endswith("RUNNING"), answers
        # (the status is read after the answer: the 200 is judged by the state just after)
    finally:
        await anyio.to_thread.run_sync(lambda: serve.delete(APP))


async def test_a_killed_replica_fails_only_its_own_streams(
    cluster: str, model_paths: dict[str, Path]
) -> None:
    long = {"model": MODEL, "max_tokens": 900, "ignore_eos": True, "stream": True, "temperature": 0}
    async with deployed(model_paths, "pow2"):
        ends: dict[int, tuple[str, str]] = {}  # stream -> (replica, how it ended)
        started = anyio.Event()

        async def stream(i: int, http: httpx.AsyncClient) -> None:
            async with http.stream("POST", "/v1/completions", json={**long, "prompt": f"story {i}"}) as r:
                replica, end = r.headers["x-engine-replica"], "cut"
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        event = json.loads(line[6:])
                        if "error" in event:
                            end = "error"
                        elif event["choices"] and event["choices"][0]["finish_reason"]:
                            end = event["choices"][0]["finish_reason"]
                        ends.setdefault(i, (replica, "streaming"))
                        if len(ends) == 6:
                            started.set()
                    elif line == "data: [DONE]":
                        end = end if end != "cut" else "done"
                ends[i] = (replica, end)

        async with httpx.AsyncClient(base_url=cluster, timeout=120) as http, anyio.create_task_group() as tg:
            for i in range(6):
                tg.start_soon(stream, i, http)
            with anyio.fail_after(60):
                await started.wait()
            replicas = {replica for replica, _ in ends.values()}
            assert len(replicas) == 2, ends  # both replicas stream
            victim = sorted(replicas)[0]
            os.kill(_replica_pid(victim), signal.SIGKILL)
            killed_at = time.monotonic()
        # every stream of the killed replica got an error, then [DONE], within 60 s; the
        # other replica's streams finished
        assert time.monotonic() - killed_at < 60
        for replica, end in ends.values():
            assert end == ("error" if replica == victim else "length"), ends
        async with httpx.AsyncClient(base_url=cluster, timeout=60) as http:
            for _ in range(4):  # new requests succeed at once (the other replica)
                r = await http.post(
                    "/v1/completions", json={"model": MODEL, "prompt": "again", "max_tokens": 2}
                )
                assert r.status_code == 200
            with anyio.fail_after(120):  # Serve replaces the dead replica
                while _running_replicas() < 2:
                    await anyio.sleep(0.5)
            served = await replicas_serving(http, 20, "after")
            assert victim not in served and len(served) == 2


async def test_a_queue_scales_the_replicas_up_and_idleness_down(
    cluster: str, model_paths: dict[str, Path]
) -> None:
    """Autoscaling between 1 and 2 replicas: more requests than one replica's slots bring
    a second replica; once they stop, it goes again."""
    quick = {
        "upscale_delay_s": 1.0,
        "downscale_delay_s": 2.0,
        "look_back_period_s": 12.0,  # (> the 10 s at which replicas report)
    }
    async with deployed(model_paths, "pow2", min_replicas=1, max_replicas=2, autoscaling=quick):
        body = {"model": MODEL, "prompt": "count", "max_tokens": 48, "ignore_eos": True}
        served: set[str] = set()
        async with httpx.AsyncClient(base_url=cluster, timeout=120) as http:

            async def client(deadline: float) -> None:  # 3 requests for every slot
                while len(served) < 2 and time.monotonic() < deadline:
                    r = await http.post("/v1/completions", json=body)
                    assert r.status_code == 200
                    served.add(r.headers["x-engine-replica"])

            deadline = time.monotonic() + 90
            async with anyio.create_task_group() as tg:
                for _ in range(24):
                    tg.start_soon(client, deadline)
            assert len(served) == 2, "no second replica within 90 s of a queue"

            def replicas() -> dict[str, int]:
                return serve.status().applications[APP].deployments["EngineReplica"].replica_states

            # idle: back to one, and staying there for longer than the look-back period.
            # Serve may start a replica again just after a downscale while its window
            # still holds the queue's load; that flap passes and is not ours to test.
            settled = 15.0
            one_since: float | None = None
            with anyio.fail_after(180):
                while one_since is None or time.monotonic() - one_since < settled:
                    if replicas() == {"RUNNING": 1}:
                        one_since = one_since or time.monotonic()
                    else:
                        one_since = None
                    await anyio.sleep(0.5)
            r = await http.post("/v1/completions", json=body)
            assert r.status_code == 200


async def test_a_downscaled_replica_drains_its_streams(cluster: str, model_paths: dict[str, Path]) -> None:
    """Two replicas down to one: every stream in flight ends whole (the stopped replica
    finishes its own before it goes), and new requests go to the one that stays."""
    body = {"model": MODEL, "max_tokens": 400, "ignore_eos": True, "stream": True}
    async with deployed(model_paths, "pow2", graceful_shutdown_timeout_s=60) as config:
        ends: dict[int, tuple[str, str]] = {}

        async def stream(i: int, http: httpx.AsyncClient, *, task_status: TaskStatus[None]) -> None:
            async with http.stream("POST", "/v1/completions", json={**body, "prompt": f"tale {i}"}) as r:
                replica, end = r.headers["x-engine-replica"], "cut"
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        if i not in ends:
                            ends[i] = (replica, "streaming")
                            task_status.started()
                        choices = json.loads(line[6:]).get("choices") or [{}]
                        end = choices[0].get("finish_reason") or end
                ends[i] = (replica, end)

        async with httpx.AsyncClient(base_url=cluster, timeout=120) as http:
            async with anyio.create_task_group() as tg:
                # streams one after another (each streaming before the next) until both
                # replicas have some: power of two choices sends the next to the idler one
                for i in range(8):
                    with anyio.fail_after(60):
                        await tg.start(stream, i, http)
                    if len({replica for replica, _ in ends.values()}) == 2:
                        break
                assert len({replica for replica, _ in ends.values()}) == 2, ends
                await run_app(replace(config, replicas=1))
            assert all(end == "length" for _, end in ends.values()), ends
            assert len(await replicas_serving(http, 6, "n")) == 1
