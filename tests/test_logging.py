"""The library is a guest in its user's process: its logs go through the standard logging
module under ``engine``, nothing of it reaches stdout, and it configures nothing globally."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from engine import Engine, SamplingParams
from engine.session import Runtime
from tests.helpers import config

SCRIPT = """
import json, logging, sys
import anyio
from engine import Engine, EngineConfig, SamplingParams, SpeculativeConfig
{logging_setup}

async def main():
    config = EngineConfig(
        model=sys.argv[1], speculative=SpeculativeConfig("ngram-simple", ngram_size_n=2, ngram_size_m=4),
        n_seq=2, n_ctx=256, threads=2,
    )
    async with Engine(config) as engine:
        out = await engine.generate([1000, 2000, 3000], SamplingParams(max_tokens=8))
        async for _ in engine.stream([1000, 2001], SamplingParams(max_tokens=4)):
            pass
    print(json.dumps({{"tokens": out.token_ids, "finish": out.finish_reason}}))

anyio.run(main)
"""


@pytest.mark.parametrize(
    "setup", ["", "logging.basicConfig(level=logging.DEBUG)"], ids=["no-config", "debug"]
)
def test_a_script_that_prints_json_prints_only_its_json(model_paths: dict[str, Path], setup: str) -> None:
    script = textwrap.dedent(SCRIPT.format(logging_setup=setup))
    run = subprocess.run(
        [sys.executable, "-c", script, str(model_paths["walk-llama-cycle6"])],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert len(lines) == 1, run.stdout  # nothing but the script's own output
    assert json.loads(lines[0])["finish"] == "length"
    if setup:  # the application asked for everything: the events went where it said (stderr)
        assert "request.finished" in run.stderr and "engine.started" in run.stderr
    else:  # quiet below WARNING unless configured
        assert "request.finished" not in run.stderr


async def test_events_are_standard_log_records_under_engine(
    model_paths: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    root_handlers = list(logging.getLogger().handlers)
    with caplog.at_level(logging.DEBUG, logger="engine"):
        async with Engine(config(model_paths, "walk-llama")) as engine:
            await engine.generate([1000, 2000], SamplingParams(max_tokens=4), request_id="x")
    finished = [r for r in caplog.records if getattr(r, "engine", {}).get("event") == "request.finished"]
    assert len(finished) == 1
    record = finished[0]
    assert record.name.startswith("engine") and record.levelno == logging.INFO
    assert record.engine["request_id"] == "x" and record.engine["completion_tokens"] == 4  # type: ignore[attr-defined]
    assert record.getMessage().startswith("request.finished request_id='x'")
    assert logging.getLogger().handlers == root_handlers  # nothing configured globally


async def test_a_second_engine_sharing_the_cpus_is_warned_about(
    model_paths: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    """Two engines whose CPU threads outnumber the CPUs slow each other (each leads its own
    OpenMP team): the second one's start says so, once; one engine alone says nothing."""
    cpus = len(os.sched_getaffinity(0))
    cfg = dataclasses.replace(config(model_paths, "walk-llama"), threads=cpus)

    def warnings() -> list[logging.LogRecord]:
        return [r for r in caplog.records if getattr(r, "engine", {}).get("event") == "engine.cpus_shared"]

    with caplog.at_level(logging.WARNING, logger="engine"):
        async with Engine(cfg):
            assert warnings() == []
            async with Engine(cfg):
                (warned,) = warnings()
                assert warned.engine["engines"] == 2 and warned.engine["cpus"] == cpus  # type: ignore[attr-defined]
        async with Engine(cfg):  # (the others closed)
            assert len(warnings()) == 1
        with Runtime() as runtime:  # engines sharing one native thread share its team
            async with Engine(cfg, runtime=runtime), Engine(cfg, runtime=runtime):
                assert len(warnings()) == 1
