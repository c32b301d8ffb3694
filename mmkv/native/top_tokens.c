/* Each row's most likely token and its probability (see mmkv/sampler.py; built by mmkv/native).
 *
 * For float32 logits rows: the first index of the row's largest value (torch's argmax; the first
 * NaN, if any, as there) and, if probs is given, softmax's value there, 1 / sum(exp(l - max))
 * (NaN for a row with a NaN). Each pass over a row runs in SIMD lanes: the maximum, the search for
 * its first index (branch-free but for the exit), and the sum of exponentials, which come from
 * simd_math.h's polynomial (libm's expf does not vectorise without fast-math), within float32's
 * rounding of expf; so the probability is torch's up to float rounding.
 */
#include <math.h>
#include <stdint.h>

#include "simd_math.h"

void mmkv_top_tokens(const float *restrict logits, int64_t rows, int64_t vocab, int64_t stride,
                     int64_t *restrict tokens, float *restrict probs) {
    for (int64_t r = 0; r < rows; r++) {
        const float *restrict l = logits + r * stride;
        float best = -INFINITY;
        int nan = 0;
#pragma omp simd reduction(max : best) reduction(| : nan)
        for (int64_t i = 0; i < vocab; i++) {
            best = l[i] > best ? l[i] : best;
            nan |= l[i] != l[i];
        }
        int64_t token = 0;
        if (nan)
            while (l[token] == l[token]) token++;
        else
            while (token < vocab - 1 && l[token] != best) token++;
        tokens[r] = token;
        if (probs) {
            float total = 0.0f;
#pragma omp simd reduction(+ : total)
            for (int64_t i = 0; i < vocab; i++) total += exp_nonpositive(l[i] - best);
            probs[r] = nan ? NAN : 1.0f / total;
        }
    }
}
