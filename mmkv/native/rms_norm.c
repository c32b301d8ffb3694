/* RMSNorm of float32 rows (see mmkv/models/fused_layer.py; built by mmkv/native).
 *
 * out[r] = w * (x[r] / sqrt(mean(x[r]^2) + eps)): transformers' RMSNorm in float32, its operations
 * in its order but for the sum of squares, which runs in SIMD lanes (float rounding apart). Rows
 * are spread over OpenMP's threads only when there are enough of them to pay for the team (torch's
 * grain of 32768 elements), so a decode row costs one call and no wake-up.
 */
#include <math.h>
#include <stdint.h>

void mmkv_rms_norm(const float *restrict x, const float *restrict w, float *restrict out,
                   int64_t rows, int64_t n, float eps) {
#pragma omp parallel for if (rows * n >= 32768 && rows > 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *restrict xr = x + r * n;
        float *restrict o = out + r * n;
        float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
        for (int64_t i = 0; i < n; i++) squares += xr[i] * xr[i];
        const float scale = 1.0f / sqrtf(squares / (float)n + eps);
#pragma omp simd
        for (int64_t i = 0; i < n; i++) o[i] = w[i] * (xr[i] * scale);
    }
}
