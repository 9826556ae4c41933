"""``python -m engine``: the commands work end to end on tiny models; errors are one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "engine", *args],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=Path(__file__).parent.parent,
    )


def test_bench_on_a_tiny_model(model_paths: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    done = run_cli(
        "bench",
        "--model",
        str(model_paths["walk-llama-cycle6"]),
        "--streams",
        "1,2",
        "--spec",
        "none,ngram-simple",
        "--requests",
        "2",
        "--max-tokens",
        "12",
        "--n-ctx",
        "256",
        "--threads",
        "2",
        "--json",
        str(out),
    )
    assert done.returncode == 0, done.stderr
    assert "raw tok/s" in done.stdout and "ngram-simple" in done.stdout
    rows = json.loads(out.read_text())
    assert [(r["n_streams"], r["speculative"]) for r in rows] == [
        (1, "none"),
        (2, "none"),
        (1, "ngram-simple"),
        (2, "ngram-simple"),
    ]
    assert all(r["tokens"] == r["requests"] * 12 and r["raw_decode_tokens_per_s"] > 0 for r in rows)
    assert rows[-1]["acceptance_rate"] > 0  # the cycle repeats: n-gram drafts are accepted


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
