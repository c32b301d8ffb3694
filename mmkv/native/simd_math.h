/* Vectorisable float math shared by mmkv's native kernels (see mmkv/native/__init__.py). */
#ifndef MMKV_SIMD_MATH_H
#define MMKV_SIMD_MATH_H

#include <stdint.h>

/* e^x for x <= 0 (a score minus the running max), in a form the compiler vectorises: e^x =
 * 2^n e^f with n = round(x / ln 2), f = x - n ln 2 in [-ln2/2, ln2/2] and e^f by its Taylor
 * polynomial to degree 7 (relative error below 2e-7, float32's own rounding); below -87 the result
 * is 0, as float32's e^x underflows there. */
#pragma omp declare simd notinbranch
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = __builtin_rintf(x * 1.44269504f);
    const float f = (x - n * 0.693145752f) - n * 1.42860677e-6f;
    float e = 1.0f / 5040.0f;
    e = e * f + 1.0f / 720.0f;
    e = e * f + 1.0f / 120.0f;
    e = e * f + 1.0f / 24.0f;
    e = e * f + 1.0f / 6.0f;
    e = e * f + 0.5f;
    e = e * f + 1.0f;
    e = e * f + 1.0f;
    union { float f; int32_t i; } scale = {.i = ((int32_t)n + 127) << 23};
    return x <= -87.0f ? 0.0f : e * scale.f;
}

#endif
