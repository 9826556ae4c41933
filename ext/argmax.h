// Greedy sampling's argmax over a row of logits, vectorised; no llama.cpp dependency, so that
// tests/test_argmax.py can compile it alone and check it against a scalar scan.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace engine {

// The index of the largest logit: the first on ties, NaN never chosen, 0 when nothing beats
// -inf; what a scalar `if (x[t] > best)` scan returns. Verification reads a whole row of logits
// per sequence and draft, too slow for a scalar scan on a large vocabulary. Here one vector pass
// finds the first block holding the maximum, and a scan of that block finds its index.
inline int32_t first_argmax(const float * x, int32_t n) {
    float best = -std::numeric_limits<float>::infinity();
    int32_t i = 0;
    int32_t best_block = -1;
#if defined(__SSE2__)
    constexpr int32_t block = 64;
    for (; i + block <= n; i += block) {
        // max(x, acc) is acc where x is NaN, so NaN never enters the accumulators
        __m128 a0 = _mm_set1_ps(best), a1 = a0, a2 = a0, a3 = a0;
        for (int32_t j = i; j < i + block; j += 16) {
            a0 = _mm_max_ps(_mm_loadu_ps(x + j), a0);
            a1 = _mm_max_ps(_mm_loadu_ps(x + j + 4), a1);
            a2 = _mm_max_ps(_mm_loadu_ps(x + j + 8), a2);
            a3 = _mm_max_ps(_mm_loadu_ps(x + j + 12), a3);
        }
        __m128 m = _mm_max_ps(_mm_max_ps(a0, a1), _mm_max_ps(a2, a3));
        m = _mm_max_ps(m, _mm_shuffle_ps(m, m, _MM_SHUFFLE(1, 0, 3, 2)));
        m = _mm_max_ps(m, _mm_shuffle_ps(m, m, _MM_SHUFFLE(2, 3, 0, 1)));
        const float block_max = _mm_cvtss_f32(m);
        if (block_max > best) {
            best = block_max;
            best_block = i;
        }
    }
#endif
    int32_t arg = 0;
    if (best_block >= 0) {
        while (x[best_block] != best) ++best_block;
        arg = best_block;
    }
    for (; i < n; ++i) {
        if (x[i] > best) {
            best = x[i];
            arg = i;
        }
    }
    return arg;
}

// first_argmax over the tokens not in `skip` (sorted): the best of the runs between them, the
// first on ties; what the scalar scan returns when it passes over the skipped tokens.
inline int32_t first_argmax_without(const float * x, int32_t n, const std::vector<int32_t> & skip) {
    int32_t arg = 0;
    float best = -std::numeric_limits<float>::infinity();
    int32_t from = 0;
    for (size_t i = 0; i <= skip.size(); ++i) {
        const int32_t to = i < skip.size() ? std::min(skip[i], n) : n;
        if (to > from) {
            const int32_t t = from + first_argmax(x + from, to - from);
            if (x[t] > best) {
                best = x[t];
                arg = t;
            }
        }
        from = std::max(from, to + 1);
    }
    return arg;
}

}  // namespace engine
