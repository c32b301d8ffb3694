/* Each row's most likely token and its probability (see mmkv/sampler.py; built by mmkv/native).
 *
 * For float32 logits rows: the first index of the row's largest value (torch's argmax; the first
 * NaN, if any, as there) and, if probs is given, softmax's value there, 1 / sum(exp(l - max))
 * (NaN for a row with a NaN). Each pass over a row runs in SIMD lanes: the maximum, the search for
 * its first index (branch-free but for the exit), and the sum of exponentials, which come from a
 * polynomial that vectorises where libm's expf does not (without fast-math), within a few units in
 * the last place of expf; so the probability is torch's up to float rounding.
 */
#include <math.h>
#include <stdint.h>

/* exp(x) for x <= 0: x = k ln2 + r with |r| <= ln2 / 2 (about), e^r by its Taylor series to r^7
 * (relative error below 1e-7 there), times 2^k built in the exponent bits. Where 2^k would not be
 * a normal float (x below about -87, -inf included) the result is 0, which is all exp(x) adds to
 * a sum that holds 1. Written without branches (a clamp or a select stops gcc vectorising). */
static inline float exp_nonpositive(float x) {
    const int32_t k = (int32_t)(x * 1.44269504f - 0.5f);
    const float n = (float)k;
    const float r = (x - n * 0.693145752f) - n * 1.42860677e-6f; /* ln 2 in two parts */
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    union { uint32_t bits; float value; } scale = {.bits = ((uint32_t)k + 127u) << 23}, out;
    out.value = p * scale.value;
    out.bits &= (uint32_t) - (int32_t)(k > -126);
    return out.value;
}

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
