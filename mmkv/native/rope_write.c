/* Rotary embedding of a decoder layer's fused Q/K/V output, and its K and V stored in the paged
 * cache (see mmkv/models/fused_layer.py; built by mmkv/native).
 *
 * Row t of `qkv` holds q_heads query heads, then kv_heads key heads, then kv_heads value heads,
 * `dim` floats each. Query and key heads are rotated as the fused layer's torch path rotates them:
 * out[i] = x[i] * cos[i] + x[(i + dim / 2) % dim] * signed_sin[i] (the sine's first half negated,
 * so the roll stands for transformers' rotate_half), the same products and sum up to the compiler
 * contracting them into a fused multiply-add (float rounding). Queries go to `q_out`
 * ([tokens][q_heads][dim]); keys to row slots[t] and values to row slots[tokens + t] of the float32
 * layer viewed as rows of kv_heads * dim (the torch backend's write_slots). Tokens are spread over
 * OpenMP's threads only when there are enough of them to pay for the team (a prompt chunk).
 */
#include <stdint.h>
#include <string.h>

static inline void rotate_row(float *restrict out, const float *restrict x, const float *restrict c,
                              const float *restrict s, int dim) {
    const int half = dim / 2;
#pragma omp simd
    for (int i = 0; i < half; i++) out[i] = x[i] * c[i] + x[i + half] * s[i];
#pragma omp simd
    for (int i = half; i < dim; i++) out[i] = x[i] * c[i] + x[i - half] * s[i];
}

void mmkv_rope_write(const float *restrict qkv, int64_t qkv_stride, const float *restrict cos,
                     int64_t cos_stride, const float *restrict sin, int64_t sin_stride,
                     float *restrict q_out, float *restrict rows, const int64_t *restrict slots,
                     int64_t tokens, int q_heads, int kv_heads, int dim) {
    const int64_t row = (int64_t)kv_heads * dim;
#pragma omp parallel for if (tokens > 1 && tokens * qkv_stride >= 32768) schedule(static)
    for (int64_t t = 0; t < tokens; t++) {
        const float *x = qkv + t * qkv_stride;
        const float *c = cos + t * cos_stride, *s = sin + t * sin_stride;
        for (int h = 0; h < q_heads; h++)
            rotate_row(q_out + (t * q_heads + h) * dim, x + (int64_t)h * dim, c, s, dim);
        for (int h = 0; h < kv_heads; h++)
            rotate_row(rows + slots[t] * row + (int64_t)h * dim, x + (int64_t)(q_heads + h) * dim, c, s, dim);
        memcpy(rows + slots[tokens + t] * row, x + (int64_t)(q_heads + kv_heads) * dim,
               (size_t)row * sizeof(float));
    }
}
