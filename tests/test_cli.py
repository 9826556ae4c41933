"""``python -m engine``: the commands work end to end on tiny models; errors are one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)


def run_cli(*args: str, input: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "engine", *args],
        input=input,
        capture_output=True,
        text=True,
        timeout=240,
        cwd=Path(__file__).parent.parent,
    )


def run_example(name: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, f"examples/{name}", *args],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=Path(__file__).parent.parent,
    )


TINY = ("--n-ctx", "256", "--threads", "2")


def ramp_shortfall(n_streams: int, max_tokens: int) -> int:
    """Tokens the ramp's first requests leave out: client k asks (k + 1) / N of max_tokens."""
    return sum(max_tokens - -(-max_tokens * (k + 1) // n_streams) for k in range(n_streams - 1))


def test_bench_on_a_tiny_model(model_paths: dict[str, Path], tmp_path: Path) -> None:
    done = run_cli(
        "bench",
        "--model",
        str(model_paths["walk-llama-cycle6"]),
        "--streams",
        "1,2",
        "--spec",
        "none,ngram-simple",
        "--requests",
        "4",
        "--max-tokens",
        "24",  # (n-grams of 4 on a 6-token cycle: the first match comes at token 10)
        "--prompts",
        "copy",
        "--out",
        str(tmp_path),
        *TINY,
    )
    assert done.returncode == 0, done.stderr
    assert "raw tok/s" in done.stdout and "ngram-simple" in done.stdout and "e2e" in done.stdout
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["settings"]["prompts"] == "copy" and report["machine"]["cores"] >= 1
    assert report["command"].startswith("python -m engine bench --model")
    rows = report["results"]
    assert [(r["n_streams"], r["speculative"]) for r in rows] == [  # interleaved per N
        (1, "none"),
        (1, "ngram-simple"),
        (2, "none"),
        (2, "ngram-simple"),
    ]
    assert "speculation on ÷ off" in done.stdout
    assert [(u["n_streams"], u["speculative"]) for u in report["speedups"]] == [
        (1, "ngram-simple"),
        (2, "ngram-simple"),
    ]
    for r in rows:  # (the first requests ramp: at N = 2 they ask 12 and 24 tokens)
        assert r["tokens"] == r["requests"] * 24 - ramp_shortfall(r["n_streams"], 24)
        assert r["raw_decode_tokens_per_s"] > 0
        assert 0 < r["ttft_p50"] <= r["ttft_p99"] and 0 < r["e2e_p50"] <= r["e2e_p99"]
    # the cycle repeats: n-gram drafts are accepted where a draft row is cheapest, at one stream
    # (at two, a machine under load can price this short run's drafts out: nothing drafted)
    assert rows[1]["acceptance_rate"] > 0
    png = (tmp_path / "bench.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000


def test_bench_interleaved_keeps_an_engine_per_variant(model_paths: dict[str, Path], tmp_path: Path) -> None:
    """``--interleave``: every repeat of an N runs on the same engines, in A, B, B, A order,
    each sending the next requests of the sequence."""
    common = (
        "bench",
        "--model",
        str(model_paths["walk-llama-cycle6"]),
        "--streams",
        "2",
        "--out",
        str(tmp_path),
    )
    refused = run_cli(*common, "--interleave", "--duration", "1", *TINY)
    assert refused.returncode != 0 and "--interleave takes --requests" in refused.stderr
    done = run_cli(
        *common,
        "--spec",
        "none,ngram-simple",
        "--requests",
        "4",
        "--repeats",
        "3",
        "--max-tokens",
        "24",
        "--prompts",
        "copy",
        "--interleave",
        *TINY,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["settings"]["interleave"] is True
    rows = report["results"]
    assert [r["speculative"] for r in rows] == [
        "none",
        "ngram-simple",
        "ngram-simple",
        "none",
        "none",
        "ngram-simple",
    ]
    sent = [r["prompt_tokens"] for r in rows]  # (each repeat: the same requests to every variant)
    assert sent[0::2] == sent[1::2] and len(set(sent[0::2])) == 3  # (the next ones: not repeat 1's again)
    assert "median of 3 interleaved repeats" in done.stdout


def test_load_test_example_for_a_duration_with_a_prompt_file(
    model_paths: dict[str, Path], tmp_path: Path
) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "one two three"}\n{"prompt": "four five"}\n')
    done = run_example(
        "load_test.py",
        "--model",
        str(model_paths["walk-llama"]),
        "--streams",
        "3",
        "--spec",
        "none",
        "--duration",
        "1.5",
        "--max-tokens",
        "8",
        "--prompts",
        str(prompts),
        "--out",
        str(tmp_path / "out"),
        *TINY,
    )
    assert done.returncode == 0, done.stderr
    (row,) = json.loads((tmp_path / "out" / "bench.json").read_text())["results"]
    assert row["requests"] >= 3 and row["tokens"] == 8 * row["requests"] - ramp_shortfall(3, 8)
    assert row["seconds"] >= 1.5
    bad = run_cli("bench", "--prompts", str(tmp_path / "missing.txt"), "--model", str(model_paths["llama"]))
    assert bad.returncode == 1 and bad.stderr.startswith("error: prompts:") and "Traceback" not in bad.stderr


def test_chat_reuses_the_previous_turn_and_survives_save_and_load(
    model_paths: dict[str, Path], tmp_path: Path
) -> None:
    saved = tmp_path / "conversation.json"
    args = ("--model", str(model_paths["walk-llama"]), "--max-tokens", "8", "--temperature", "0", *TINY)
    first = run_cli("chat", *args, input=f"hello there\nhow are you\n/save {saved}\n")
    assert first.returncode == 0, first.stderr
    status = [line for line in first.stderr.splitlines() if line.startswith("[8 tokens")]
    assert len(status) == 2, first.stderr
    assert "prompt tokens" in status[0]  # the first turn reads its prompt
    assert " cached" in status[1] and "cold start" in status[1]  # the second resumes it
    assert len(first.stdout.strip().splitlines()) == 2 and saved.exists()
    # a new process continues the saved conversation without re-reading it
    second = run_cli("chat", *args, input=f"/load {tmp_path / 'nope.json'}\n/load {saved}\nand then\n")
    assert second.returncode == 0, second.stderr
    assert "error: cannot load" in second.stderr and "[loaded 4 messages" in second.stderr
    (status,) = [line for line in second.stderr.splitlines() if line.startswith("[8 tokens")]
    assert " cached" in status, second.stderr


def test_run_streams_a_completion(model_paths: dict[str, Path]) -> None:
    done = run_cli(
        "run",
        "Once upon a time",
        "--model",
        str(model_paths["walk-llama"]),
        "--max-tokens",
        "8",
        "--spec",
        "none",
        "--n-ctx",
        "128",
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() and "finish=length" in done.stderr


def test_errors_are_one_line(tmp_path: Path) -> None:
    done = run_cli("run", "hi", "--model", str(tmp_path / "missing.gguf"))
    assert done.returncode == 1
    assert done.stderr.strip().startswith("error: cannot load model") and "Traceback" not in done.stderr
