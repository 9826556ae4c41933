"""The vectorised argmax of greedy verification (``ext/argmax.h``), with and without the
end-of-generation tokens, against the scalar scan it replaced, compiled alone: the test
models' vocabularies are multiples of its 64-float block (no tail) and their logits hold no
NaN or infinities, so the engine tests do not reach those cases."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

EXT = Path(__file__).resolve().parent.parent / "ext"

CHECK = r"""
#include "argmax.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

static int32_t scalar(const float * x, int32_t n) {
    float best = -INFINITY;
    int32_t arg = 0;
    for (int32_t t = 0; t < n; ++t) {
        if (x[t] > best) {
            best = x[t];
            arg = t;
        }
    }
    return arg;
}

static int32_t scalar_without(const float * x, int32_t n, const std::vector<int32_t> & skip) {
    float best = -INFINITY;
    int32_t arg = 0;
    for (int32_t t = 0; t < n; ++t) {
        if (x[t] > best && !std::binary_search(skip.begin(), skip.end(), t)) {
            best = x[t];
            arg = t;
        }
    }
    return arg;
}

int main() {
    std::mt19937 rng(7);
    int bad = 0, cases = 0;
    auto check = [&](const std::vector<float> & x) {
        ++cases;
        const int32_t n = static_cast<int32_t>(x.size());
        if (engine::first_argmax(x.data(), n) != scalar(x.data(), n)) ++bad;
        std::vector<int32_t> skip(rng() % 4);  // sorted, maybe repeated, maybe past the end
        for (int32_t & t : skip) t = static_cast<int32_t>(rng() % (n + 2));
        std::sort(skip.begin(), skip.end());
        if (engine::first_argmax_without(x.data(), n, skip) != scalar_without(x.data(), n, skip)) ++bad;
    };
    for (int it = 0; it < 100000; ++it) {
        std::vector<float> x(1 + rng() % 400);
        const unsigned kind = rng() % 4;
        for (float & v : x) {
            const unsigned r = rng() % 16;
            if (kind == 0) v = static_cast<float>(rng() % 5);  // many exact ties
            else if (kind == 1) v = r == 0 ? NAN : r == 1 ? -INFINITY : static_cast<float>(rng() % 9);
            else if (kind == 2) v = r < 8 ? NAN : -INFINITY;  // nothing beats -inf
            else v = r == 0 ? INFINITY : r == 1 ? NAN : std::ldexp(static_cast<float>(rng() % 1000), -5);
        }
        check(x);
    }
    std::vector<float> big(262144);  // Gemma 3's vocabulary, the maximum in the last block
    for (float & v : big) v = std::ldexp(static_cast<float>(rng() % 100000), -7);
    big.back() = 1e9f;
    check(big);
    big.back() = 0.0f;
    check(big);
    std::printf("%d of %d differ\n", bad, cases);
    return bad != 0;
}
"""


def test_vectorised_argmax_returns_what_the_scalar_scan_returns(tmp_path: Path) -> None:
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler (the extension was built elsewhere)")
    src, exe = tmp_path / "check.cpp", tmp_path / "check"
    src.write_text(CHECK)
    subprocess.run([cxx, "-O2", "-std=c++17", f"-I{EXT}", str(src), "-o", str(exe)], check=True)
    run = subprocess.run([str(exe)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.startswith("0 of 100002 differ"), run.stdout
