/* Batched decode attention that reads the paged KV cache in place (see mmkv/attention/native.py;
 * built by mmkv/native).
 *
 * Cache layout (one layer): [num_blocks][2][block_size][kv_heads][row], K then V in a page, a row
 * being head_dim values of the cache's format (cache/kv_format.py): float32, bfloat16, int8
 * codes followed by their bfloat16 scale, or fp8 e4m3. A bfloat16 or fp8 page is decoded into
 * float32 scratch as it is attended (the rows this call reads, one page at a time); int8 keys are
 * attended as they are stored (integer dot products against the query rounded to 16 bits) and
 * int8 values widened unscaled, each row's scale joining its weight; so no decoded copy of the
 * cache is ever made. For each sequence s and KV head h, the m * G query rows (m queries, G query
 * heads per KV head) attend the sequence's keys in `pages[s]` (`lens[s]` tokens, the first at
 * absolute position `key_start[s]`): a key at position p is visible to a query at position q when
 * p <= q (and p > q - window with a window). The softmax runs online, page by page (running max,
 * sum and weighted V sum per row), starting from a given state when the rows already attended
 * other keys (a cascade's shared pages): state (lse, out) is the same as (max = lse, sum = 1,
 * acc = out), so the result is attention over the union of both key sets.
 *
 * Work items are a sequence's pages for a range of its KV heads (all of them unless there are too
 * few sequences to keep every thread busy): a page's rows for those heads are read in one sweep,
 * and the next page is prefetched while this one is attended, since the pages a decode step reads
 * have mostly left the caches since they were written (a run of its lines per row attended, so
 * the prefetches overlap the arithmetic).
 */
#include <math.h>
#include <omp.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd_math.h"

static inline float dot(const float *restrict a, const float *restrict b, int n) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int i = 0; i < n; i++) acc += a[i] * b[i];
    return acc;
}

#if defined(__AVX512F__)
/* Sixteen keys' lane-wise partial sums folded into one register of their sixteen sums, in key
 * order (4 levels of shuffle and add) instead of each key's sum reduced on its own. */
static inline __attribute__((always_inline)) __m512 fold16(const __m512 acc[16]) {
    __m512 pairs[8], quads[4], halves[2];
    for (int i = 0; i < 8; i++)  /* per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] */
        pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(acc[2 * i], acc[2 * i + 1]),
                                 _mm512_unpackhi_ps(acc[2 * i], acc[2 * i + 1]));
    for (int i = 0; i < 4; i++)  /* per lane: one partial sum of each of 4 keys, in order */
        quads[i] = _mm512_add_ps(_mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0x44),
                                 _mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0xEE));
    for (int i = 0; i < 2; i++)  /* lanes 0+1 and 2+3 of two registers */
        halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0x88),
                                  _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], 0x88),
                         _mm512_shuffle_f32x4(halves[0], halves[1], 0xDD));
}
#endif

#if defined(__AVX2__)
/* Eight keys' lane-wise partial sums folded into one register of their eight sums, in key order
 * (two levels of horizontal adds and a cross-lane add). */
static inline __attribute__((always_inline)) __m256 fold8(const __m256 acc[8]) {
    /* [k0 01, k0 23, k1 01, k1 23 | k0 45, k0 67, k1 45, k1 67] and so on */
    const __m256 pairs0 = _mm256_hadd_ps(acc[0], acc[1]), pairs1 = _mm256_hadd_ps(acc[2], acc[3]);
    const __m256 pairs2 = _mm256_hadd_ps(acc[4], acc[5]), pairs3 = _mm256_hadd_ps(acc[6], acc[7]);
    /* [k0 0-3, k1 0-3, k2 0-3, k3 0-3 | k0 4-7, k1 4-7, k2 4-7, k3 4-7], then keys 4-7 */
    const __m256 quads0 = _mm256_hadd_ps(pairs0, pairs1), quads1 = _mm256_hadd_ps(pairs2, pairs3);
    return _mm256_add_ps(_mm256_permute2f128_ps(quads0, quads1, 0x20),
                         _mm256_permute2f128_ps(quads0, quads1, 0x31));
}

/* score[t0 .. t0 + n) = sums * scale (n <= 8); returns the largest of them. */
static inline float store8(float *restrict score, __m256 sums, __m256 scale, int n) {
    float lanes[8], largest = -INFINITY;
    _mm256_storeu_ps(lanes, _mm256_mul_ps(sums, scale));
    for (int t = 0; t < n && t < 8; t++) {
        score[t] = lanes[t];
        largest = lanes[t] > largest ? lanes[t] : largest;
    }
    return largest;
}
#endif

#if defined(__AVX512F__)
/* score[0 .. n) = the first n lanes of `scores` (n <= 16); returns `best` raised to their largest. */
static inline __m512 store16(float *restrict score, __m512 scores, int n, __m512 best) {
    const __mmask16 live = (__mmask16)((1u << (n < 16 ? n : 16)) - 1);
    _mm512_mask_storeu_ps(score, live, scores);
    return _mm512_mask_max_ps(best, live, best, scores);
}
#endif

/* score[t] = scale * (q . k[t * stride ...]) for t in [start, end); returns the largest. */
static inline float page_scores(float *restrict score, const float *restrict q, const float *restrict k,
                               int64_t stride, int start, int end, int dim, float scale) {
#if defined(__AVX512F__)
    if (dim % 16 == 0) {  /* sixteen keys at a time, each key's products summed lane-wise */
        __m512 best = _mm512_set1_ps(-INFINITY);
        for (int t0 = start; t0 < end; t0 += 16) {
            const int n = end - t0 < 16 ? end - t0 : 16;
            __m512 acc[16];
#pragma GCC unroll 16
            for (int t = 0; t < 16; t++) {  /* past the range, its last key again (not stored) */
                acc[t] = _mm512_setzero_ps();
                const float *row = k + (t0 + (t < n ? t : n - 1)) * stride;
                for (int i = 0; i < dim; i += 16)
                    acc[t] = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), _mm512_loadu_ps(row + i), acc[t]);
            }
            best = store16(score + t0, _mm512_mul_ps(fold16(acc), _mm512_set1_ps(scale)), n, best);
        }
        return _mm512_reduce_max_ps(best);
    }
#endif
#if defined(__AVX2__) && defined(__FMA__)
    if (dim % 8 == 0) {  /* eight keys at a time, as above with 8-wide registers */
        float best = -INFINITY;
        for (int t0 = start; t0 < end; t0 += 8) {
            const int n = end - t0 < 8 ? end - t0 : 8;
            __m256 acc[8];
#pragma GCC unroll 8
            for (int t = 0; t < 8; t++) {
                acc[t] = _mm256_setzero_ps();
                const float *row = k + (t0 + (t < n ? t : n - 1)) * stride;
                for (int i = 0; i < dim; i += 8)
                    acc[t] = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(row + i), acc[t]);
            }
            const float largest = store8(score + t0, fold8(acc), _mm256_set1_ps(scale), n);
            best = largest > best ? largest : best;
        }
        return best;
    }
#endif
    float best = -INFINITY;
    for (int t = start; t < end; t++) {
        score[t] = dot(q, k + t * stride, dim) * scale;
        best = score[t] > best ? score[t] : best;
    }
    return best;
}

/* The largest magnitude a query row's 16-bit codes may take for int8 keys of `dim` values: a
 * dot product's 32-bit sum then cannot overflow (dim * limit * 127 < 2^31). */
static inline int query_code_limit(int dim) {
    const int64_t fits = INT32_MAX / (127 * (int64_t)dim);
    return fits < 32767 ? (int)fits : 32767;
}

/* q16 = round(q / step) with step = max |q| / query_code_limit(dim); returns step (0 for a zero
 * row). Rounding the query to 16 bits costs it about 1/65534 of its largest element, a
 * hundredth of what int8 keys already cost (1/254 of theirs). */
static float quantize_query(int16_t *restrict q16, const float *restrict q, int dim) {
    float largest = 0.0f;
    for (int i = 0; i < dim; i++) largest = fabsf(q[i]) > largest ? fabsf(q[i]) : largest;
    const float step = largest / (float)query_code_limit(dim);
    const float inverse = step > 0.0f ? 1.0f / step : 0.0f;
    for (int i = 0; i < dim; i++) q16[i] = (int16_t)lrintf(q[i] * inverse);
    return step;
}

/* score[t] = scale * kscale[t * kscale_stride] * (q16 . codes of key t) for t in [start, end),
 * the key rows `stride` bytes apart: int8 keys attended without decoding them, their dot products
 * summed in 32-bit integers (16-bit query times 8-bit code, pairs summed per lane). Returns the
 * largest score. */
static inline float int8_page_scores(float *restrict score, const int16_t *restrict q16,
                                    const int8_t *restrict k, int64_t stride, const float *restrict kscale,
                                    int64_t kscale_stride, int start, int end, int dim, float scale) {
    int t = start;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    if (dim % 32 == 0 && dim <= 512) {
        __m512 best = _mm512_set1_ps(-INFINITY);
        __m512i query[16];  /* the row's codes, 32 a register (dim <= 512 here) */
        for (int i = 0; i < dim / 32 && i < 16; i++) query[i] = _mm512_loadu_si512((const void *)(q16 + 32 * i));
        for (; t < end; t += 16) {
            const int n = end - t < 16 ? end - t : 16;
            __m512 acc[16];
#pragma GCC unroll 16
            for (int j = 0; j < 16; j++) {  /* past the range, its last key again (not stored) */
                const int8_t *row = k + (t + (j < n ? j : n - 1)) * stride;
                __m512i sum = _mm512_setzero_si512();
                for (int i = 0; i < dim / 32; i++) {
                    const __m512i codes = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(row + 32 * i)));
#if defined(__AVX512VNNI__)
                    sum = _mm512_dpwssd_epi32(sum, query[i], codes);
#else
                    sum = _mm512_add_epi32(sum, _mm512_madd_epi16(query[i], codes));
#endif
                }
                acc[j] = _mm512_cvtepi32_ps(sum);
            }
            const __mmask16 live = (__mmask16)((1u << n) - 1);
            const __m512 key_scales = _mm512_mask_i32gather_ps(
                _mm512_setzero_ps(), live,
                _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                   _mm512_set1_epi32((int)kscale_stride)),
                kscale + t * kscale_stride, 4);
            best = store16(score + t, _mm512_mul_ps(_mm512_mul_ps(fold16(acc), key_scales), _mm512_set1_ps(scale)),
                           n, best);
        }
        return _mm512_reduce_max_ps(best);
    }
#endif
#if defined(__AVX2__)
    if (dim % 16 == 0) {
        float best = -INFINITY;
        for (; t < end; t += 8) {
            const int n = end - t < 8 ? end - t : 8;
            __m256 acc[8];
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) {
                const int8_t *row = k + (t + (j < n ? j : n - 1)) * stride;
                __m256i sum = _mm256_setzero_si256();
                for (int i = 0; i < dim; i += 16) {
                    const __m256i codes = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(row + i)));
                    const __m256i query = _mm256_loadu_si256((const __m256i *)(q16 + i));
                    sum = _mm256_add_epi32(sum, _mm256_madd_epi16(query, codes));
                }
                acc[j] = _mm256_cvtepi32_ps(sum);
            }
            float key_scales[8] = {0};
            for (int j = 0; j < 8 && t + j < end; j++) key_scales[j] = kscale[(t + j) * kscale_stride];
            const float largest = store8(score + t, _mm256_mul_ps(fold8(acc), _mm256_loadu_ps(key_scales)),
                                         _mm256_set1_ps(scale), end - t);
            best = largest > best ? largest : best;
        }
        return best;
    }
#endif
    float best = -INFINITY;
    for (; t < end; t++) {
        const int8_t *row = k + t * stride;
        int32_t sum = 0;
#pragma omp simd reduction(+ : sum)
        for (int i = 0; i < dim; i++) sum += (int32_t)q16[i] * row[i];
        score[t] = (float)sum * kscale[t * kscale_stride] * scale;
        best = score[t] > best ? score[t] : best;
    }
    return best;
}

/* a += sum over t in [start, end) of w[t] * v[t * stride ...]: elements of `a` held in registers
 * across the keys, several independent sums at a time. */
static inline void weighted_sum(float *restrict a, const float *restrict w, const float *restrict v,
                                int64_t stride, int start, int end, int dim) {
    int i = 0;
#if defined(__AVX512F__)
    for (; i + 64 <= dim; i += 64) {
        __m512 x0 = _mm512_loadu_ps(a + i), x1 = _mm512_loadu_ps(a + i + 16);
        __m512 x2 = _mm512_loadu_ps(a + i + 32), x3 = _mm512_loadu_ps(a + i + 48);
        for (int t = start; t < end; t++) {
            const __m512 wt = _mm512_set1_ps(w[t]);
            const float *row = v + t * stride + i;
            x0 = _mm512_fmadd_ps(wt, _mm512_loadu_ps(row), x0);
            x1 = _mm512_fmadd_ps(wt, _mm512_loadu_ps(row + 16), x1);
            x2 = _mm512_fmadd_ps(wt, _mm512_loadu_ps(row + 32), x2);
            x3 = _mm512_fmadd_ps(wt, _mm512_loadu_ps(row + 48), x3);
        }
        _mm512_storeu_ps(a + i, x0), _mm512_storeu_ps(a + i + 16, x1);
        _mm512_storeu_ps(a + i + 32, x2), _mm512_storeu_ps(a + i + 48, x3);
    }
#endif
    for (; i + 16 <= dim; i += 16) {
        float x[16];
        for (int l = 0; l < 16; l++) x[l] = a[i + l];
        for (int t = start; t < end; t++) {
            const float wt = w[t], *row = v + t * stride + i;
#pragma omp simd
            for (int l = 0; l < 16; l++) x[l] += wt * row[l];
        }
        for (int l = 0; l < 16; l++) a[i + l] = x[l];
    }
#if defined(__AVX2__) && defined(__FMA__)
    for (; i + 8 <= dim; i += 8) {  /* what the 16-wide loop left: 8 of a 24-wide head */
        __m256 x = _mm256_loadu_ps(a + i);
        for (int t = start; t < end; t++)
            x = _mm256_fmadd_ps(_mm256_set1_ps(w[t]), _mm256_loadu_ps(v + t * stride + i), x);
        _mm256_storeu_ps(a + i, x);
    }
#endif
    for (; i < dim; i++) {
        float x = a[i];
        for (int t = start; t < end; t++) x += w[t] * v[t * stride + i];
        a[i] = x;
    }
}

static inline void scale_row(float *restrict y, float a, int n) {
#pragma omp simd
    for (int i = 0; i < n; i++) y[i] *= a;
}

enum { FORMAT_F32 = 0, FORMAT_BF16 = 1, FORMAT_INT8 = 2, FORMAT_FP8 = 3 };

/* Widen `count` bfloat16 values to float32. */
static void widen_bf16(float *restrict dst, const uint16_t *restrict src, int64_t count) {
    uint32_t *out = (uint32_t *)dst;
#pragma omp simd
    for (int64_t i = 0; i < count; i++) out[i] = (uint32_t)src[i] << 16;
}

/* The scale of each of `rows` int8 rows (dim codes, then the row's bfloat16 scale), as float32. */
static void int8_row_scales(float *restrict scales, const int8_t *restrict src, int64_t rows, int dim) {
    for (int64_t r = 0; r < rows; r++) {
        uint16_t bits;
        memcpy(&bits, src + r * (dim + 2) + dim, sizeof bits);
        const uint32_t wide = (uint32_t)bits << 16;
        memcpy(scales + r, &wide, sizeof wide);
    }
}

/* Widen the codes of `rows` int8 rows to float32, unscaled (the rows' scales are applied to the
 * weights that multiply them). */
static void widen_int8_codes(float *restrict dst, const int8_t *restrict src, int64_t rows, int dim) {
    for (int64_t r = 0; r < rows; r++) {
        const int8_t *row = src + r * (dim + 2);
        float *out = dst + r * dim;
        int i = 0;
#if defined(__AVX512F__)
        for (; i + 16 <= dim; i += 16)
            _mm512_storeu_ps(out + i, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + i)))));
#elif defined(__AVX2__)
        for (; i + 8 <= dim; i += 8)
            _mm256_storeu_ps(out + i, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(row + i)))));
#endif
        for (; i < dim; i++) out[i] = (float)row[i];
    }
}

/* Decode `count` fp8 e4m3 bytes. A normal magnitude's float32 bits are its exponent and mantissa
 * moved up 20 bits with the exponent rebased (+120); a subnormal (exponent 0) is its mantissa
 * times 2^-9. The vector paths build those bits; the rest reads the table of every byte's value.
 * (0x7f and 0xff, e4m3fn's NaNs, decode as +-480 on the vector paths: the cache never stores
 * them, as writing saturates at +-448.) */
static void widen_fp8(float *restrict dst, const uint8_t *restrict src, int64_t count,
                      const float *restrict table) {
    int64_t i = 0;
#if defined(__AVX512F__)
    const __m512i low7 = _mm512_set1_epi32(0x7f), rebase = _mm512_set1_epi32(120 << 23);
    for (; i + 16 <= count; i += 16) {
        const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(src + i)));
        const __m512i magnitude = _mm512_and_si512(b, low7);
        const __m512 normal = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32(magnitude, 20), rebase));
        const __m512 subnormal = _mm512_mul_ps(_mm512_cvtepi32_ps(magnitude), _mm512_set1_ps(0x1p-9f));
        const __mmask16 small = _mm512_cmplt_epi32_mask(magnitude, _mm512_set1_epi32(8));
        const __m512i value = _mm512_castps_si512(_mm512_mask_blend_ps(small, normal, subnormal));
        const __m512i sign = _mm512_slli_epi32(_mm512_andnot_si512(low7, b), 24);
        _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_or_si512(value, sign)));
    }
#elif defined(__AVX2__)
    const __m256i low7 = _mm256_set1_epi32(0x7f), rebase = _mm256_set1_epi32(120 << 23);
    for (; i + 8 <= count; i += 8) {
        const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(src + i)));
        const __m256i magnitude = _mm256_and_si256(b, low7);
        const __m256 normal = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(magnitude, 20), rebase));
        const __m256 subnormal = _mm256_mul_ps(_mm256_cvtepi32_ps(magnitude), _mm256_set1_ps(0x1p-9f));
        const __m256 small = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(8), magnitude));
        const __m256i value = _mm256_castps_si256(_mm256_blendv_ps(normal, subnormal, small));
        const __m256i sign = _mm256_slli_epi32(_mm256_andnot_si256(low7, b), 24);
        _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_or_si256(value, sign)));
    }
#endif
    for (; i < count; i++) dst[i] = table[src[i]];
}

/* Every e4m3fn byte's value: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is
 * subnormal, and all ones in both fields is NaN (no infinities). */
static void fp8_table(float *table) {
    for (int b = 0; b < 256; b++) {
        const int exponent = (b >> 3) & 15, mantissa = b & 7;
        float value = exponent == 0 ? ldexpf((float)mantissa / 8.0f, -6)
                                    : ldexpf(1.0f + (float)mantissa / 8.0f, exponent - 7);
        if (exponent == 15 && mantissa == 7) value = NAN;
        table[b] = b & 128 ? -value : value;
    }
}

/* Bytes of one row of `dim` values in `format`. */
static inline int64_t row_bytes(int format, int dim) {
    switch (format) {
        case FORMAT_F32: return 4 * (int64_t)dim;
        case FORMAT_BF16: return 2 * (int64_t)dim;
        case FORMAT_INT8: return (int64_t)dim + 2;
        default: return dim;
    }
}

/* Prefetch the `part`-th of `parts` equal runs of the cache lines in [start, start + bytes). */
static inline void prefetch_part(const char *start, int64_t bytes, int part, int parts) {
    const int64_t lines = (bytes + 63) / 64;
    for (int64_t line = lines * part / parts; line < lines * (part + 1) / parts; line++)
        __builtin_prefetch(start + 64 * line, 0, 3);
}

typedef struct {
    const float *q;            /* [d][m][q_heads][dim] */
    const char *cache;         /* the layer */
    int format;                /* FORMAT_* */
    const float *fp8_values;   /* FORMAT_FP8: every byte's value */
    const int64_t *pages;      /* [d][max_pages] */
    int64_t max_pages;
    const int64_t *lens, *key_start, *positions;
    int m, group, block_size, q_heads, kv_heads, dim;
    float scale;
    int64_t window;            /* 0: none */
    const float *init_out;     /* [d][kv_heads][m * group][dim] or NULL */
    const float *init_lse;     /* [d][kv_heads][m * group] or NULL */
    float *out;                /* like q */
} Problem;

/* Sequence s, KV heads [h0, h1), prefetching `next_page` (the thread's next item's first page)
 * to begin with. Rows: (head, query j, query head g), r = ((h - h0) * m + j) * G + g. */
static inline __attribute__((always_inline)) void attend(
    const Problem *p, int64_t s, int h0, int h1, const int64_t *next_page, float *work, int dim) {
    const int m = p->m, group = p->group, bs = p->block_size;
    const int heads = h1 - h0, rows_per_head = m * group, rows = heads * rows_per_head;
    float *acc = work;                                  /* [rows][dim] */
    float *mx = acc + (int64_t)rows * dim;              /* [rows] */
    float *sum = mx + rows;                             /* [rows] */
    float *score = sum + rows;                          /* [block_size] */
    float *widened = score + bs;                        /* [2][block_size][kv_heads][dim], decoded */
    float *scales = widened + 2 * (int64_t)bs * p->kv_heads * dim;  /* int8: [2][block_size][kv_heads] */
    float *query_step = scales + 2 * (int64_t)bs * p->kv_heads;     /* int8: [rows] */
    int16_t *q16 = (int16_t *)(query_step + rows);                  /* int8: [rows][dim] */
    const int64_t state0 = (s * p->kv_heads + h0) * rows_per_head;
    for (int r = 0; r < rows; r++) {
        const float lse = p->init_lse ? p->init_lse[state0 + r] : -INFINITY;
        if (lse > -INFINITY) {
            memcpy(acc + (int64_t)r * dim, p->init_out + (state0 + r) * dim, sizeof(float) * dim);
            mx[r] = lse, sum[r] = 1.0f;
        } else {
            memset(acc + (int64_t)r * dim, 0, sizeof(float) * dim);
            mx[r] = -INFINITY, sum[r] = 0.0f;
        }
    }
    const int64_t token = (int64_t)p->kv_heads * dim;  /* values from one token to the next */
    const int64_t token_bytes = (int64_t)p->kv_heads * row_bytes(p->format, dim);
    const int64_t page_bytes = 2 * (int64_t)bs * token_bytes;
    const int64_t len = p->lens[s], num_pages = (len + bs - 1) / bs;
    const int64_t *pages = p->pages + s * p->max_pages;
    const int64_t *positions = p->positions + s * m;
    const float *q = p->q + s * m * p->q_heads * dim;
    const int int8 = p->format == FORMAT_INT8;
    for (int r = 0; r < rows && int8; r++) {
        const int h = h0 + r / rows_per_head, j = (r % rows_per_head) / group, g = r % group;
        query_step[r] = quantize_query(q16 + (int64_t)r * dim, q + ((int64_t)j * p->q_heads + (int64_t)h * group + g) * dim, dim);
    }
    if (next_page) prefetch_part(p->cache + *next_page * page_bytes, page_bytes, 0, 1);
    for (int64_t pg = 0; pg < num_pages; pg++) {
        const int count = (int)(len - pg * bs < bs ? len - pg * bs : bs);
        const char *page = p->cache + pages[pg] * page_bytes;
        /* the next page comes in a run of lines per row attended, not all at once: a burst of
         * prefetches stalls on the core's outstanding misses, and a large page would push out
         * the one being attended */
        const char *ahead = pg + 1 < num_pages ? p->cache + pages[pg + 1] * page_bytes : NULL;
        const float *k = NULL, *v;
        const int64_t stride = token;  /* floats from one token's row to the next */
        if (p->format == FORMAT_F32) {
            k = (const float *)page, v = (const float *)page + (int64_t)bs * token;
        } else if (int8) {  /* keys read as codes; values widened unscaled; both rows' scales */
            const int64_t page_rows = (int64_t)count * p->kv_heads;
            int8_row_scales(scales, (const int8_t *)page, page_rows, dim);
            int8_row_scales(scales + (int64_t)bs * p->kv_heads, (const int8_t *)page + bs * token_bytes, page_rows, dim);
            widen_int8_codes(widened, (const int8_t *)page + bs * token_bytes, page_rows, dim);
            v = widened;
        } else {
            for (int half = 0; half < 2; half++) {  /* K, then V */
                const char *src = page + half * (int64_t)bs * token_bytes;
                float *dst = widened + half * (int64_t)bs * token;
                if (p->format == FORMAT_BF16)
                    widen_bf16(dst, (const uint16_t *)src, (int64_t)count * token);
                else
                    widen_fp8(dst, (const uint8_t *)src, (int64_t)count * token, p->fp8_values);
            }
            k = widened, v = widened + (int64_t)bs * token;
        }
        const int64_t first = p->key_start[s] + pg * bs;
        for (int r = 0; r < rows; r++) {
            if (ahead) prefetch_part(ahead, page_bytes, r, rows);
            const int h = h0 + r / rows_per_head, j = (r % rows_per_head) / group, g = r % group;
            const int64_t pos = positions[j];
            const int end = (int)(pos - first + 1 < count ? pos - first + 1 : count);
            int start = 0;
            if (p->window > 0 && pos - p->window + 1 > first) start = (int)(pos - p->window + 1 - first);
            if (end <= start) continue;
            const float page_max = int8 ?
                int8_page_scores(score, q16 + (int64_t)r * dim, (const int8_t *)page + h * row_bytes(FORMAT_INT8, dim),
                                 p->kv_heads * row_bytes(FORMAT_INT8, dim), scales + h, p->kv_heads, start, end,
                                 dim, p->scale * query_step[r]) :
                page_scores(score, q + ((int64_t)j * p->q_heads + (int64_t)h * group + g) * dim,
                            k + (int64_t)h * dim, stride, start, end, dim, p->scale);
            const float *vh = v + (int64_t)h * dim;
            float *a = acc + (int64_t)r * dim;
            if (page_max > mx[r]) {
                const float correction = expf(mx[r] - page_max);
                sum[r] *= correction;
                scale_row(a, correction, dim);
                mx[r] = page_max;
            }
            const float row_max = mx[r];
            float page_sum = 0.0f;
#pragma omp simd reduction(+ : page_sum)
            for (int t = start; t < end; t++) {
                score[t] = exp_nonpositive(score[t] - row_max);
                page_sum += score[t];
            }
            sum[r] += page_sum;
            if (int8)  /* each value row's scale joins its weight */
                for (int t = start; t < end; t++) score[t] *= scales[((int64_t)bs + t) * p->kv_heads + h];
            weighted_sum(a, score, vh, stride, start, end, dim);
        }
    }
    float *out = p->out + s * m * p->q_heads * dim;
    for (int r = 0; r < rows; r++) {
        const int h = h0 + r / rows_per_head, j = (r % rows_per_head) / group, g = r % group;
        float *o = out + ((int64_t)j * p->q_heads + (int64_t)h * group + g) * dim;
        const float inv = sum[r] > 0.0f ? 1.0f / sum[r] : 0.0f;
        const float *a = acc + (int64_t)r * dim;
#pragma omp simd
        for (int i = 0; i < dim; i++) o[i] = a[i] * inv;
    }
}

/* q, out: [d][m][q_heads][dim] float32; pages: [d][max_pages]; lens, key_start: [d];
 * positions: [d][m]; init_out: [d][kv_heads][m * G][dim] and init_lse: [d][kv_heads][m * G]
 * (both NULL when no rows start from a state; lse -inf for rows that do not). Returns 0, or -1
 * when scratch memory could not be had. */
int mmkv_paged_decode(const float *q, const void *cache, int format, const int64_t *pages,
                      int64_t max_pages, const int64_t *lens, const int64_t *key_start,
                      const int64_t *positions, int d, int m, int block_size, int q_heads,
                      int kv_heads, int dim, float scale, int64_t window, const float *init_out,
                      const float *init_lse, float *out) {
    float fp8_values[256];
    if (format == FORMAT_FP8) fp8_table(fp8_values);
    const Problem p = {q, (const char *)cache, format, fp8_values, pages, max_pages, lens, key_start, positions,
                       m, q_heads / kv_heads, block_size, q_heads, kv_heads, dim, scale, window,
                       init_out, init_lse, out};
    const int threads = omp_get_max_threads();
    /* split each sequence's heads into `chunks` ranges when sequences alone leave threads idle */
    int chunks = d >= 2 * threads ? 1 : (2 * threads + d - 1) / d;
    if (chunks > kv_heads) chunks = kv_heads;
    const int heads_per_chunk = (kv_heads + chunks - 1) / chunks;
    const int64_t rows = (int64_t)heads_per_chunk * m * p.group;
    const int64_t work_size = rows * dim + 2 * rows + block_size
                              + 2 * (int64_t)block_size * kv_heads * (dim + 1)  /* widened pages, scales */
                              + rows + (rows * dim + 1) / 2;  /* int8: query steps and 16-bit queries */
    float *scratch = malloc(sizeof(float) * work_size * threads);
    if (!scratch) return -1;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t item = 0; item < (int64_t)d * chunks; item++) {
        const int h0 = (int)(item % chunks) * heads_per_chunk;
        const int h1 = h0 + heads_per_chunk < kv_heads ? h0 + heads_per_chunk : kv_heads;
        const int64_t s = item / chunks;
        const int64_t *next_page = s + 1 < d ? pages + (s + 1) * max_pages : NULL;
        float *work = scratch + work_size * omp_get_thread_num();
        if (h0 >= h1) continue;
        /* the common head sizes get their own copy of the loops, unrolled for that size */
        if (dim == 64) attend(&p, s, h0, h1, next_page, work, 64);
        else if (dim == 128) attend(&p, s, h0, h1, next_page, work, 128);
        else attend(&p, s, h0, h1, next_page, work, dim);
    }
    free(scratch);
    return 0;
}
