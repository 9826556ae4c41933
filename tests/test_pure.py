"""The drafting subsystem tests without the native extension, and the scheduler's modules
import without it: in a process where loading the extension fails, the policy's tests pass.
(The scheduler's own logic tests build ``SamplingParams``, whose value rules are native.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PURE_TESTS = ["tests/test_policy.py"]
PURE_MODULES = [
    "engine.scheduler.drafting",
    "engine.scheduler.planner",
    "engine.scheduler.params",
    "engine.scheduler.request",
    "engine.scheduler.output",
    "engine.scheduler.scheduler",
]

# a finder that refuses the extension, installed before anything imports it
_RUN = """
import importlib, importlib.abc, sys

class NoExtension(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "engine._nb_spec":
            raise ImportError("the native extension is blocked in this test")
        return None

sys.meta_path.insert(0, NoExtension())
import pytest
rc = pytest.main(["-q", "-p", "no:cacheprovider", *{tests!r}])
for module in {modules!r}:
    importlib.import_module(module)
assert "engine._nb_spec" not in sys.modules
sys.exit(rc)
"""


def test_the_drafting_subsystem_runs_without_the_extension() -> None:
    code = _RUN.format(modules=PURE_MODULES, tests=PURE_TESTS)
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert " passed" in done.stdout and "error" not in done.stdout.lower(), done.stdout[-2000:]
