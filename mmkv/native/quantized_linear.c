/* Linear layers over quantized weights for a few rows (see mmkv/quantization/linear.py; built by
 * mmkv/native): y[r][o] = bias[o] + sum_i x[r][i] * w[o][i], x and y float32, w in one of
 * mmkv/quantization/formats.py's layouts, read once per call and decoded in registers.
 *
 *   int8: w[o][i] = codes[o][i] * scale[o]. The codes are widened to float32 and multiplied into
 *         per-row accumulators; the channel's scale multiplies the finished sum.
 *   int4: w[o][i] = q * scale[o][g] + offset[o][g] (g = i / group), two codes per byte (input
 *         2j in the low nibble, 2j + 1 in the high one). A group's weights are decoded to
 *         float32 once (q * scale + offset, fused) and used by every row, whose inputs are split
 *         into even and odd ones first so the low and high nibbles of a run of bytes meet their
 *         inputs in lane order.
 *   int8 in groups: w[o][i] = codes[o][i] * scale[o][g] + offset[o][g], each code widened to
 *         float32 and decoded with one fused multiply-add.
 *
 * A grouped layout's scales and offsets are group_values: float16 or float32, per group or in two
 * levels (a value shared by k groups times an int8 code per group), expanded to float32 for a
 * block of channels at a time (expand_groups) before its codes are read.
 *
 * Work items are blocks of output channels (OpenMP, static): a block's codes stay in cache while
 * every row of x (in tiles of up to four) passes over them, so each weight byte leaves memory
 * once per call. Decoding is memory-bound: a step reads every weight once, and these kernels read
 * a quarter (int8) or a little over an eighth (int4, group 32) of float32's bytes.
 *
 * Activations stay float32: no int8 dot product (VNNI) is used, since it would need the rows
 * quantized too, and the layer would no longer compute x @ w.T of its dequantized weight.
 */
#include <omp.h>
#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define ROW_TILE 4
#define CHANNEL_BLOCK 4

/* A block's codes are a few short runs (a row per channel), too short for the hardware
 * prefetcher to learn before each ends: while a block is read, each read asks for the same place
 * in the next block (``block`` bytes on), so its codes are in cache when its turn comes. */
#define PREFETCH_NEXT_BLOCK(p, block) __builtin_prefetch((const char *)(p) + (block))

/* TILE (a tile call naming r and R) over the rows in tiles of ROW_TILE and the rest in one tile
 * of 1-3; R is a constant in each, so the always-inline tiles unroll. */
#define OVER_ROW_TILES(rows, TILE)                                                               \
    do {                                                                                         \
        int64_t r = 0;                                                                           \
        for (; r + ROW_TILE <= (rows); r += ROW_TILE) { const int R = ROW_TILE; TILE; }          \
        switch ((rows) - r) {                                                                    \
        case 3: { const int R = 3; TILE; } break;                                                \
        case 2: { const int R = 2; TILE; } break;                                                \
        case 1: { const int R = 1; TILE; } break;                                                \
        }                                                                                        \
    } while (0)

/* The body of a grouped kernel's channels [o, o + C): the block's scales and offsets expanded
 * to float32 once (sc, mn: [C][groups]), then TILE (naming sc, mn, r and R) over the rows. */
#define GROUPED_CHANNELS(TILE)                                                                   \
    const int64_t groups = in / group;                                                           \
    float sc[CHANNEL_BLOCK * groups], mn[CHANNEL_BLOCK * groups];                                \
    expand_groups(scale, o, C, groups, sc);                                                      \
    expand_groups(offset, o, C, groups, mn);                                                     \
    OVER_ROW_TILES(rows, TILE)

/* name(x, rows, in, codes, scale, offset, group, bias, y, out, o, C): a grouped kernel's channels
 * [o, o + C), TILE (a tile function over GROUPED_CHANNELS's names) over its rows. */
#define DEFINE_GROUPED_CHANNELS(name, row_type, code_type, TILE)                                 \
    static void name(const row_type *x, int64_t rows, int64_t in, const code_type *codes,        \
                     const group_values *scale, const group_values *offset, int64_t group,       \
                     const float *bias, float *y, int64_t out, int64_t o, const int C) {         \
        GROUPED_CHANNELS(TILE(x, in, codes, sc, mn, group, bias, y, out, o, r, C, R));           \
    }

/* A tile's sums (VALUE, naming c and k) plus the bias, into y's rows [r, r + R) and channels
 * [o, o + C). */
#define STORE_TILE(VALUE)                                                                        \
    for (int c = 0; c < C; c++)                                                                  \
        for (int k = 0; k < R; k++) y[(r + k) * out + o + c] = (VALUE) + (bias ? bias[o + c] : 0.0f)

/* CHANNELS (a call naming o and C) over out's channels, blocks in parallel: whole blocks of
 * CHANNEL_BLOCK, and a last partial block a channel at a time. */
#define OVER_CHANNEL_BLOCKS(out, CHANNELS)                                                       \
    do {                                                                                         \
        const int64_t blocks = ((out) + CHANNEL_BLOCK - 1) / CHANNEL_BLOCK;                      \
        _Pragma("omp parallel for schedule(static)")                                             \
        for (int64_t b = 0; b < blocks; b++) {                                                   \
            if ((b + 1) * CHANNEL_BLOCK <= (out)) {                                              \
                const int64_t o = b * CHANNEL_BLOCK;                                             \
                const int C = CHANNEL_BLOCK;                                                     \
                CHANNELS;                                                                        \
            } else {                                                                             \
                for (int64_t o = b * CHANNEL_BLOCK; o < (out); o++) { const int C = 1; CHANNELS; } \
            }                                                                                    \
        }                                                                                        \
    } while (0)

/* name(x, rows, in): a new array of each row's even inputs, then its odd ones (NULL when out of
 * memory), so an int4 kernel's low and high nibbles meet their inputs in lane order. */
#define DEFINE_EVEN_ODD_SPLIT(name, type)                                                        \
    static __attribute__((unused)) type *name(const type *x, int64_t rows, int64_t in) {        \
        type *xs = malloc(sizeof(type) * rows * in);                                             \
        if (xs)                                                                                  \
            for (int64_t r = 0; r < rows; r++)                                                   \
                for (int64_t j = 0; j < in / 2; j++) {                                           \
                    xs[r * in + j] = x[r * in + 2 * j];                                          \
                    xs[r * in + in / 2 + j] = x[r * in + 2 * j + 1];                             \
                }                                                                                \
        return xs;                                                                               \
    }
DEFINE_EVEN_ODD_SPLIT(split_floats, float)
DEFINE_EVEN_ODD_SPLIT(split_bfloat16, uint16_t)

static inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
    union { uint32_t u; float f; } v;
    if (exponent == 0x1F) {
        v.u = sign | 0x7F800000u | (mantissa << 13);
    } else if (exponent) {
        v.u = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else {  /* zero or subnormal: mantissa * 2^-24 */
        v.f = (float)mantissa * 5.9604645e-8f;
        v.u |= sign;
    }
    return v.f;
#endif
}

/* n float16 values at h as float32 at f. */
static void halves_to_floats(const uint16_t *restrict h, int64_t n, float *restrict f) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(f + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(h + i))));
#endif
    for (; i < n; i++) f[i] = half_to_float(h[i]);
}

/* A grouped weight's scales (or offsets), mmkv/quantization/formats.py's group_values: group g
 * of channel o has values[o][g / (groups / count)] times codes[o][g] (times 1 without codes). */
typedef struct {
    const void *values;   /* float16 or float32 [out][count]; NULL: every value is 0 */
    const int8_t *codes;  /* int8 [out][groups], or NULL */
    int64_t count;        /* values per channel, dividing groups */
    int64_t float32;      /* 1: values are float32, 0: float16 */
} group_values;

/* Channels [o, o + channels)'s group values as float32 at out, [channels][groups]. Two levels
 * (per > 1: a K-quant's super-block scale over its eight groups) go a shared value at a time,
 * each times its groups' codes in one vector pass: the block's setup then costs little beside its
 * codes' decoding. */
static void expand_groups(const group_values *v, int64_t o, int64_t channels, int64_t groups,
                          float *restrict out) {
    const int64_t n = channels * groups;
    if (!v->values) {
        memset(out, 0, sizeof(float) * n);
        return;
    }
    const int64_t per = groups / v->count;
    if (per > 1) {
        const int64_t shared = channels * v->count;
        float values[shared];
        if (v->float32)
            memcpy(values, (const float *)v->values + o * v->count, sizeof(float) * shared);
        else
            halves_to_floats((const uint16_t *)v->values + o * v->count, shared, values);
        const int8_t *restrict q = v->codes ? v->codes + o * groups : NULL;
        for (int64_t s = 0; s < shared; s++) {
            float *restrict row = out + s * per;
            int64_t j = 0;
#if defined(__AVX2__)
            const __m256 value = _mm256_set1_ps(values[s]);
            for (; j + 8 <= per; j += 8)
                _mm256_storeu_ps(row + j, q ? _mm256_mul_ps(value, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                                  _mm_loadl_epi64((const __m128i *)(q + s * per + j)))))
                                            : value);
#endif
            for (; j < per; j++) row[j] = q ? values[s] * (float)q[s * per + j] : values[s];
        }
        return;
    }
    if (v->float32)
        memcpy(out, (const float *)v->values + o * groups, sizeof(float) * n);
    else
        halves_to_floats((const uint16_t *)v->values + o * groups, n, out);
    if (v->codes) {
        const int8_t *restrict q = v->codes + o * groups;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) out[i] *= (float)q[i];
    }
}

#if defined(__AVX512F__)
#define LANES 16
typedef __m512 vec;
#define vzero() _mm512_setzero_ps()
#define vload(p) _mm512_loadu_ps(p)
#define vset1(v) _mm512_set1_ps(v)
#define vfma(a, b, c) _mm512_fmadd_ps(a, b, c)
#define vsum(v) _mm512_reduce_add_ps(v)
/* sixteen int8 codes at p as float32 */
#define vint8(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))
/* sixteen bytes at p as int32 lanes */
#define vbytes(p) _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p)))
#define vlow(b) _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)))
#define vhigh(b) _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4))
#elif defined(__AVX2__)
#define LANES 8
typedef __m256 vec;
#define vzero() _mm256_setzero_ps()
#define vload(p) _mm256_loadu_ps(p)
#define vset1(v) _mm256_set1_ps(v)
#define vfma(a, b, c) _mm256_fmadd_ps(a, b, c)
static inline float vsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#define vint8(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#define vbytes(p) _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
#define vlow(b) _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15)))
#define vhigh(b) _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4))
#endif

/* ---- int8 ------------------------------------------------------------------------------------ */

/* Channels [o, o + C) for rows [r, r + R) (C, R compile-time constants after inlining). */
static inline __attribute__((always_inline)) void int8_tile(
    const float *restrict x, int64_t in, const int8_t *restrict codes, const float *restrict scale,
    const float *restrict bias, float *restrict y, int64_t out, int64_t o, int64_t r, const int C,
    const int R) {
    float total[CHANNEL_BLOCK][ROW_TILE];
    int64_t i = 0;
#if defined(LANES)
    vec acc[CHANNEL_BLOCK][ROW_TILE];
    for (int c = 0; c < C; c++)
        for (int k = 0; k < R; k++) acc[c][k] = vzero();
    for (; i + LANES <= in; i += LANES) {
        vec w[CHANNEL_BLOCK];
        for (int c = 0; c < C; c++) {
            const int8_t *p = codes + (o + c) * in + i;
            PREFETCH_NEXT_BLOCK(p, C * in);
            w[c] = vint8(p);
        }
        for (int k = 0; k < R; k++) {
            const vec xv = vload(x + (r + k) * in + i);
            for (int c = 0; c < C; c++) acc[c][k] = vfma(xv, w[c], acc[c][k]);
        }
    }
    for (int c = 0; c < C; c++)
        for (int k = 0; k < R; k++) total[c][k] = vsum(acc[c][k]);
#else
    for (int c = 0; c < C; c++)
        for (int k = 0; k < R; k++) total[c][k] = 0.0f;
#endif
    for (int c = 0; c < C; c++)
        for (int k = 0; k < R; k++) {
            float tail = 0.0f;
            const int8_t *wc = codes + (o + c) * in;
            const float *xr = x + (r + k) * in;
#pragma omp simd reduction(+ : tail)
            for (int64_t j = i; j < in; j++) tail += xr[j] * (float)wc[j];
            const float b = bias ? bias[o + c] : 0.0f;
            y[(r + k) * out + o + c] = (total[c][k] + tail) * scale[o + c] + b;
        }
}

static void int8_channels(const float *x, int64_t rows, int64_t in, const int8_t *codes,
                          const float *scale, const float *bias, float *y, int64_t out, int64_t o,
                          const int C) {
    OVER_ROW_TILES(rows, int8_tile(x, in, codes, scale, bias, y, out, o, r, C, R));
}

int mmkv_int8_linear(const float *x, int64_t rows, int64_t in, const int8_t *codes, const float *scale,
                     const float *bias, float *y, int64_t out) {
    OVER_CHANNEL_BLOCKS(out, int8_channels(x, rows, in, codes, scale, bias, y, out, o, C));
    return 0;
}

/* ---- int4 ------------------------------------------------------------------------------------ */

/* Channels [o, o + C) for rows [r, r + R); xs holds each row's even inputs then its odd ones
 * (in / 2 each); sc and mn the block's scales and offsets as float32, [C][groups]. With AVX-512 a
 * group's sixteen possible weights (q * scale + offset, q = 0..15) are one register, and each
 * nibble picks its weight from it (vpermps reads an index's low four bits), in place of widening,
 * converting and scaling every code. */
static inline __attribute__((always_inline)) void int4_tile(
    const float *restrict xs, int64_t in, const uint8_t *restrict codes, const float *restrict sc,
    const float *restrict mn, int64_t group, const float *restrict bias, float *restrict y,
    int64_t out, int64_t o, int64_t r, const int C, const int R) {
    const int64_t half = in / 2, groups = in / group, bytes = group / 2;
    float total[CHANNEL_BLOCK][ROW_TILE];
#if defined(LANES)
    vec acc[CHANNEL_BLOCK][ROW_TILE];
    for (int c = 0; c < C; c++)
        for (int k = 0; k < R; k++) acc[c][k] = vzero();
#if defined(__AVX512F__)
    const __m512 codes16 = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#endif
    for (int64_t g = 0; g < groups; g++) {
#if defined(__AVX512F__)
        vec table[CHANNEL_BLOCK];
        for (int c = 0; c < C; c++)
            table[c] = vfma(codes16, vset1(sc[c * groups + g]), vset1(mn[c * groups + g]));
#else
        vec s[CHANNEL_BLOCK], m[CHANNEL_BLOCK];
        for (int c = 0; c < C; c++) s[c] = vset1(sc[c * groups + g]), m[c] = vset1(mn[c * groups + g]);
#endif
        for (int64_t j = g * bytes; j < (g + 1) * bytes; j += LANES) {
            vec lo[CHANNEL_BLOCK], hi[CHANNEL_BLOCK];
            for (int c = 0; c < C; c++) {
                const uint8_t *p = codes + (o + c) * half + j;
                PREFETCH_NEXT_BLOCK(p, C * half);
#if defined(__AVX512F__)
                const __m512i b = vbytes(p);
                lo[c] = _mm512_permutexvar_ps(b, table[c]);
                hi[c] = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table[c]);
#else
                const __m256i b = vbytes(p);
                lo[c] = vfma(vlow(b), s[c], m[c]);
                hi[c] = vfma(vhigh(b), s[c], m[c]);
#endif
            }
            for (int k = 0; k < R; k++) {
                const vec even = vload(xs + (r + k) * in + j), odd = vload(xs + (r + k) * in + half + j);
                for (int c = 0; c < C; c++) acc[c][k] = vfma(odd, hi[c], vfma(even, lo[c], acc[c][k]));
            }
        }
    }
    for (int c = 0; c < C; c++)
        for (int k = 0; k < R; k++) total[c][k] = vsum(acc[c][k]);
#else
    for (int c = 0; c < C; c++)
        for (int k = 0; k < R; k++) {
            float sum = 0.0f;
            for (int64_t g = 0; g < groups; g++) {
                const float s = sc[c * groups + g], m = mn[c * groups + g];
                for (int64_t j = g * bytes; j < (g + 1) * bytes; j++) {
                    const uint8_t q = codes[(o + c) * half + j];
                    sum += xs[(r + k) * in + j] * ((float)(q & 15) * s + m);
                    sum += xs[(r + k) * in + half + j] * ((float)(q >> 4) * s + m);
                }
            }
            total[c][k] = sum;
        }
#endif
    STORE_TILE(total[c][k]);
}

DEFINE_GROUPED_CHANNELS(int4_channels, float, uint8_t, int4_tile)

/* Returns 0, or -1 (nothing computed) when a group is not a whole number of vector loads of
 * bytes (2 * LANES inputs) or does not divide the inputs. */
int mmkv_int4_linear(const float *x, int64_t rows, int64_t in, const uint8_t *codes,
                     const group_values *scale, const group_values *offset, int64_t group,
                     const float *bias, float *y, int64_t out) {
#if defined(LANES)
    if (group % (2 * LANES)) return -1;
#endif
    if (group < 2 || group % 2 || in % group) return -1;
    float *xs = split_floats(x, rows, in);
    if (!xs) return -1;
    OVER_CHANNEL_BLOCKS(out, int4_channels(xs, rows, in, codes, scale, offset, group, bias, y, out, o, C));
    free(xs);
    return 0;
}

/* ---- int8 in groups ---------------------------------------------------------------------------- */

/* Channels [o, o + C) for rows [r, r + R); sc and mn the block's scales and offsets as float32,
 * [C][groups]. Each group's codes are decoded (q * scale + offset) a vector at a time. */
static inline __attribute__((always_inline)) void int8_group_tile(
    const float *restrict x, int64_t in, const int8_t *restrict codes, const float *restrict sc,
    const float *restrict mn, int64_t group, const float *restrict bias, float *restrict y,
    int64_t out, int64_t o, int64_t r, const int C, const int R) {
    const int64_t groups = in / group;
    float total[CHANNEL_BLOCK][ROW_TILE];
#if defined(LANES)
    vec acc[CHANNEL_BLOCK][ROW_TILE];
    for (int c = 0; c < C; c++)
        for (int k = 0; k < R; k++) acc[c][k] = vzero();
    for (int64_t g = 0; g < groups; g++) {
        vec s[CHANNEL_BLOCK], m[CHANNEL_BLOCK];
        for (int c = 0; c < C; c++) s[c] = vset1(sc[c * groups + g]), m[c] = vset1(mn[c * groups + g]);
        for (int64_t i = g * group; i < (g + 1) * group; i += LANES) {
            vec w[CHANNEL_BLOCK];
            for (int c = 0; c < C; c++) {
                const int8_t *p = codes + (o + c) * in + i;
                PREFETCH_NEXT_BLOCK(p, C * in);
                w[c] = vfma(vint8(p), s[c], m[c]);
            }
            for (int k = 0; k < R; k++) {
                const vec xv = vload(x + (r + k) * in + i);
                for (int c = 0; c < C; c++) acc[c][k] = vfma(xv, w[c], acc[c][k]);
            }
        }
    }
    for (int c = 0; c < C; c++)
        for (int k = 0; k < R; k++) total[c][k] = vsum(acc[c][k]);
#else
    for (int c = 0; c < C; c++)
        for (int k = 0; k < R; k++) {
            float sum = 0.0f;
            for (int64_t g = 0; g < groups; g++) {
                const float s = sc[c * groups + g], m = mn[c * groups + g];
                for (int64_t i = g * group; i < (g + 1) * group; i++)
                    sum += x[(r + k) * in + i] * ((float)codes[(o + c) * in + i] * s + m);
            }
            total[c][k] = sum;
        }
#endif
    STORE_TILE(total[c][k]);
}

DEFINE_GROUPED_CHANNELS(int8_group_channels, float, int8_t, int8_group_tile)

/* Returns 0, or -1 (nothing computed) when a group is not a whole number of vector loads or does
 * not divide the inputs. */
int mmkv_int8_group_linear(const float *x, int64_t rows, int64_t in, const int8_t *codes,
                           const group_values *scale, const group_values *offset, int64_t group,
                           const float *bias, float *y, int64_t out) {
#if defined(LANES)
    if (group % LANES) return -1;
#endif
    if (group < 1 || in % group) return -1;
    OVER_CHANNEL_BLOCKS(out, int8_group_channels(x, rows, in, codes, scale, offset, group, bias, y, out, o, C));
    return 0;
}

/* ---- bfloat16 rows (AVX512-BF16) ---------------------------------------------------------------
 * A bfloat16 model's rows are multiplied by bfloat16 weights with the dot-product instruction
 * (two products a lane, summed in float32), as the bfloat16 GEMM does: int8 codes are exact in
 * bfloat16 (the scale multiplies the finished sum); an int4 group's sixteen weights are rounded
 * to bfloat16 once, the weight the model's dtype holds. Inputs must come in whole runs of 32
 * (int4: of 64, and groups a multiple of 32); otherwise, or without AVX512-BF16, these return -1
 * and the caller runs the float32 kernels. */

#if defined(__AVX512BF16__)
/* The decoded bfloat16 weights both ways of running bfloat16 rows (dot products, AMX tiles) use. */

/* 32 int8 codes at p, exact in bfloat16. */
static inline __attribute__((always_inline)) __m512bh int8_bf16(const int8_t *p) {
    return _mm512_cvtne2ps_pbh(vint8(p + 16), vint8(p));
}

/* 32 int8 codes at p in groups: q * s[g] + m[g] in float32, g = first for the first 16 codes and
 * second for the rest, rounded to bfloat16. */
static inline __attribute__((always_inline)) __m512bh int8_group_bf16(
    const int8_t *p, const float *s, const float *m, int64_t first, int64_t second) {
    return _mm512_cvtne2ps_pbh(_mm512_fmadd_ps(vint8(p + 16), _mm512_set1_ps(s[second]), _mm512_set1_ps(m[second])),
                               _mm512_fmadd_ps(vint8(p), _mm512_set1_ps(s[first]), _mm512_set1_ps(m[first])));
}

/* An int4 64-input step's table: words 0-15 the sixteen weights q * s[first] + m[first]
 * (q = 0..15) of its first 32 inputs' group, words 16-31 those of its second 32's (group second),
 * rounded to bfloat16; an index's bit 4 picks the half (vpermw reads five bits). */
static inline __attribute__((always_inline)) __m512i int4_step_table(
    const float *s, const float *m, int64_t first, int64_t second) {
    const __m512 codes16 = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return (__m512i)_mm512_cvtne2ps_pbh(_mm512_fmadd_ps(codes16, _mm512_set1_ps(s[second]), _mm512_set1_ps(m[second])),
                                        _mm512_fmadd_ps(codes16, _mm512_set1_ps(s[first]), _mm512_set1_ps(m[first])));
}

static inline __attribute__((always_inline)) void int8_tile_bf16(
    const uint16_t *restrict x, int64_t in, const int8_t *restrict codes, const float *restrict scale,
    const float *restrict bias, float *restrict y, int64_t out, int64_t o, int64_t r, const int C,
    const int R) {
    __m512 acc[CHANNEL_BLOCK][ROW_TILE];
    for (int c = 0; c < C; c++)
        for (int k = 0; k < R; k++) acc[c][k] = _mm512_setzero_ps();
    for (int64_t i = 0; i < in; i += 32) {
        __m512bh w[CHANNEL_BLOCK];
        for (int c = 0; c < C; c++) {
            const int8_t *p = codes + (o + c) * in + i;
            PREFETCH_NEXT_BLOCK(p, C * in);
            w[c] = int8_bf16(p);
        }
        for (int k = 0; k < R; k++) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + (r + k) * in + i);
            for (int c = 0; c < C; c++) acc[c][k] = _mm512_dpbf16_ps(acc[c][k], xv, w[c]);
        }
    }
    for (int c = 0; c < C; c++)
        for (int k = 0; k < R; k++)
            y[(r + k) * out + o + c] = _mm512_reduce_add_ps(acc[c][k]) * scale[o + c] + (bias ? bias[o + c] : 0.0f);
}

/* int4 on bfloat16 rows, 64 inputs (32 bytes of codes, two 32-input halves) a step. The codes'
 * bytes widen to words; the low nibbles are the step's even inputs and the high nibbles its odd
 * ones, so x comes split the same way (xs: each row's even inputs, then its odd ones). The
 * table holds both halves' sixteen weights, rounded to bfloat16: words 0-15 the first half's
 * group, words 16-31 the second's, and bit 4 of each index picks the half (vpermw reads five
 * bits). sc and mn are the block's scales and offsets as float32, [C][groups]. */
static inline __attribute__((always_inline)) void int4_tile_bf16(
    const uint16_t *restrict xs, int64_t in, const uint8_t *restrict codes, const float *restrict sc,
    const float *restrict mn, int64_t group, const float *restrict bias, float *restrict y,
    int64_t out, int64_t o, int64_t r, const int C, const int R) {
    const int64_t half = in / 2, groups = in / group;
    const __m512i nibble = _mm512_set1_epi16(15);
    const __m512i upper = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(16), 1);
    __m512 acc[CHANNEL_BLOCK][ROW_TILE];
    for (int c = 0; c < C; c++)
        for (int k = 0; k < R; k++) acc[c][k] = _mm512_setzero_ps();
    for (int64_t j = 0; j < half; j += 32) {  /* inputs [2j, 2j + 64) */
        const int64_t first = 2 * j / group, second = (2 * j + 32) / group;
        __m512bh lo[CHANNEL_BLOCK], hi[CHANNEL_BLOCK];
        for (int c = 0; c < C; c++) {
            const uint8_t *p = codes + (o + c) * half + j;
            PREFETCH_NEXT_BLOCK(p, C * half);
            const __m512i table = int4_step_table(sc + c * groups, mn + c * groups, first, second);
            const __m512i words = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)p));
            lo[c] = (__m512bh)_mm512_permutexvar_epi16(
                _mm512_or_si512(_mm512_and_si512(words, nibble), upper), table);
            hi[c] = (__m512bh)_mm512_permutexvar_epi16(
                _mm512_or_si512(_mm512_srli_epi16(words, 4), upper), table);
        }
        for (int k = 0; k < R; k++) {
            const __m512bh even = (__m512bh)_mm512_loadu_si512(xs + (r + k) * in + j);
            const __m512bh odd = (__m512bh)_mm512_loadu_si512(xs + (r + k) * in + half + j);
            for (int c = 0; c < C; c++)
                acc[c][k] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(acc[c][k], even, lo[c]), odd, hi[c]);
        }
    }
    STORE_TILE(_mm512_reduce_add_ps(acc[c][k]));
}

/* int8 in groups on bfloat16 rows, 32 inputs a step: each half of 16 codes decoded with its
 * group's scale and offset (q * scale + offset, in float32), the 32 weights rounded to bfloat16 (the
 * weight the model's dtype holds) and multiplied by the rows' bfloat16 inputs. sc and mn are the
 * block's scales and offsets as float32, [C][groups]; groups are a multiple of 16 inputs. */
static inline __attribute__((always_inline)) void int8_group_tile_bf16(
    const uint16_t *restrict x, int64_t in, const int8_t *restrict codes, const float *restrict sc,
    const float *restrict mn, int64_t group, const float *restrict bias, float *restrict y,
    int64_t out, int64_t o, int64_t r, const int C, const int R) {
    const int64_t groups = in / group;
    __m512 acc[CHANNEL_BLOCK][ROW_TILE];
    for (int c = 0; c < C; c++)
        for (int k = 0; k < R; k++) acc[c][k] = _mm512_setzero_ps();
    for (int64_t i = 0; i < in; i += 32) {
        const int64_t first = i / group, second = (i + 16) / group;
        __m512bh w[CHANNEL_BLOCK];
        for (int c = 0; c < C; c++) {
            const int8_t *p = codes + (o + c) * in + i;
            PREFETCH_NEXT_BLOCK(p, C * in);
            w[c] = int8_group_bf16(p, sc + c * groups, mn + c * groups, first, second);
        }
        for (int k = 0; k < R; k++) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + (r + k) * in + i);
            for (int c = 0; c < C; c++) acc[c][k] = _mm512_dpbf16_ps(acc[c][k], xv, w[c]);
        }
    }
    STORE_TILE(_mm512_reduce_add_ps(acc[c][k]));
}

DEFINE_GROUPED_CHANNELS(int8_group_channels_bf16, uint16_t, int8_t, int8_group_tile_bf16)

static void int8_channels_bf16(const uint16_t *x, int64_t rows, int64_t in, const int8_t *codes,
                               const float *scale, const float *bias, float *y, int64_t out,
                               int64_t o, const int C) {
    OVER_ROW_TILES(rows, int8_tile_bf16(x, in, codes, scale, bias, y, out, o, r, C, R));
}

DEFINE_GROUPED_CHANNELS(int4_channels_bf16, uint16_t, uint8_t, int4_tile_bf16)
#endif

/* ---- bfloat16 rows on AMX tiles ---------------------------------------------------------------
 *
 * Where the CPU has AMX and the kernel grants this process the tile state, the bfloat16 kernels
 * run calls of AMX_MIN_ROWS rows or more as tile products, in blocks of AMX_CHANNELS channels. A
 * block's weights are decoded, 32 inputs of each channel at a time, into a 16 x 32 bfloat16
 * tile, row n channel n: the weights the dot-product kernels use (int8 codes exact, the channel's
 * scale multiplying the sum; grouped weights q * scale + offset rounded to bfloat16). The rows'
 * inputs are laid out once per call as tiles of 16 input pairs x AMX_ROWS rows (amx_row_tiles),
 * and TDPBF16PS adds each tile's products, summed in float32, into a 16 channels x 16 rows
 * accumulator. The dot-product kernels spend one instruction per row on each decoded weight; a
 * tile product takes 16 rows at once, so a call costs about the weights' decoding whether it has
 * 8 rows or 32. Two accumulators a row tile take the even and odd 32-input steps, so consecutive
 * tile products do not wait on each other; a block passes over up to two row tiles (32 rows) per
 * decoding of its weights. */
#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#define MMKV_AMX 1
#define AMX_CHANNELS 16
#define AMX_ROWS 16
/* Fewer rows run the dot-product kernels: at 4 rows the tiles ran a model's decoding no faster
 * than the float32 kernels on a 2-core Xeon (Q8_0 slower), at 8 and more far faster. */
#define AMX_MIN_ROWS 8

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Whether this process may use the tile registers: the kernel grants them on request
 * (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA), once per process. */
static int amx_usable(void) {
    static int state;  /* 0 not asked yet, 1 granted, -1 refused */
    int s = __atomic_load_n(&state, __ATOMIC_ACQUIRE);
    if (!s) {
        s = syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 1 : -1;
        __atomic_store_n(&state, s, __ATOMIC_RELEASE);
    }
    return s > 0;
}

/* Whether a call of rows rows (and in inputs: the tiles take 64 a step) runs as tiles. */
static int runs_as_tiles(int64_t rows, int64_t in) {
    return rows >= AMX_MIN_ROWS && in % 64 == 0 && amx_usable();
}

/* The rows' inputs as B tiles: tile (k, c) holds rows [16k, 16k + 16) and inputs
 * [32c, 32c + 32), its line t the input pair (32c + 2t, 32c + 2t + 1) of each row (zero past the
 * last row); a tile is 16 lines of 64 bytes. NULL when out of memory. */
static uint32_t *amx_row_tiles(const uint16_t *x, int64_t rows, int64_t in) {
    const int64_t tiles = (rows + AMX_ROWS - 1) / AMX_ROWS, steps = in / 32;
    uint32_t *xb = aligned_alloc(64, tiles * steps * 1024);
    if (!xb) return NULL;
    memset(xb, 0, tiles * steps * 1024);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < steps; c++)
            for (int t = 0; t < 16; t++)
                memcpy(xb + ((r / AMX_ROWS) * steps + c) * 256 + t * 16 + r % AMX_ROWS,
                       x + r * in + c * 32 + 2 * t, 4);
    return xb;
}

/* The tile products of a step pair for one row tile: accumulators EVEN and ODD (tile numbers,
 * literal: they name registers) take the even and odd steps' products of A tiles 4 and 5 with
 * the row tile's B tiles at xb (6 and 7). */
#define AMX_ROW_TILE(EVEN, ODD, xb)                                                              \
    do {                                                                                         \
        _tile_loadd(6, (xb), 64);                                                                \
        _tile_loadd(7, (xb) + 256, 64);                                                          \
        _tile_dpbf16ps(EVEN, 4, 6);                                                              \
        _tile_dpbf16ps(ODD, 5, 7);                                                               \
    } while (0)

/* Channels [0, out) of y = x @ w.T (+ bias) in blocks of AMX_CHANNELS, in parallel, for rows
 * whose B tiles are xb. SCALE (naming n) multiplies channel o + n's sums; SETUP (naming o, C:
 * the block's first channel and its channel count) runs once a block; the rest, BUILD (naming
 * n, o, step and a), decodes channel o + n's weights for inputs [32 step, 32 step + 64) into
 * a[0] + 32 n and a[1] + 32 n. */
#define AMX_BLOCKS(xb, rows, in, out, bias, y, SCALE, SETUP, ...)                               \
    do {                                                                                         \
        const int64_t blocks = ((out) + AMX_CHANNELS - 1) / AMX_CHANNELS, steps = (in) / 32;    \
        const int64_t row_tiles = ((rows) + AMX_ROWS - 1) / AMX_ROWS;                            \
        _Pragma("omp parallel")                                                                  \
        {                                                                                        \
            tile_config config = {.palette = 1};                                                 \
            for (int t = 0; t < 8; t++) config.rows[t] = 16, config.colsb[t] = 64;               \
            _tile_loadconfig(&config);                                                           \
            uint16_t a[2][AMX_CHANNELS * 32] __attribute__((aligned(64)));                       \
            float sums[4][AMX_CHANNELS * AMX_ROWS] __attribute__((aligned(64)));                 \
            _Pragma("omp for schedule(static)")                                                  \
            for (int64_t b = 0; b < blocks; b++) {                                               \
                const int64_t o = b * AMX_CHANNELS;                                              \
                const int C = (out) - o < AMX_CHANNELS ? (int)((out) - o) : AMX_CHANNELS;        \
                if (C < AMX_CHANNELS) memset(a, 0, sizeof(a));                                   \
                SETUP;                                                                           \
                for (int64_t k = 0; k < row_tiles; k += 2) {                                     \
                    const int pair = row_tiles - k >= 2;                                         \
                    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);                  \
                    for (int64_t step = 0; step < steps; step += 2) {                            \
                        for (int n = 0; n < C; n++) { __VA_ARGS__; }                             \
                        _tile_loadd(4, a[0], 64);                                                \
                        _tile_loadd(5, a[1], 64);                                                \
                        AMX_ROW_TILE(0, 1, (xb) + (k * steps + step) * 256);                     \
                        if (pair) AMX_ROW_TILE(2, 3, (xb) + ((k + 1) * steps + step) * 256);     \
                    }                                                                            \
                    _tile_stored(0, sums[0], 64); _tile_stored(1, sums[1], 64);                  \
                    _tile_stored(2, sums[2], 64); _tile_stored(3, sums[3], 64);                  \
                    for (int p = 0; p <= pair; p++)                                              \
                        for (int64_t m = 0; m < AMX_ROWS && (k + p) * AMX_ROWS + m < (rows); m++) \
                            for (int n = 0; n < C; n++)                                          \
                                (y)[((k + p) * AMX_ROWS + m) * (out) + o + n] =                  \
                                    (sums[2 * p][n * AMX_ROWS + m] + sums[2 * p + 1][n * AMX_ROWS + m]) \
                                        * (SCALE) + ((bias) ? (bias)[o + n] : 0.0f);            \
                }                                                                                \
            }                                                                                    \
            _tile_release();                                                                     \
        }                                                                                        \
    } while (0)

static int int8_linear_amx(const uint16_t *x, int64_t rows, int64_t in, const int8_t *codes,
                           const float *scale, const float *bias, float *y, int64_t out) {
    uint32_t *xb = amx_row_tiles(x, rows, in);
    if (!xb) return -1;
    AMX_BLOCKS(xb, rows, in, out, bias, y, scale[o + n], (void)0,
        const int8_t *p = codes + (o + n) * in + step * 32;
        PREFETCH_NEXT_BLOCK(p, AMX_CHANNELS * in);
        PREFETCH_NEXT_BLOCK(p + 63, AMX_CHANNELS * in);
        _mm512_store_si512(a[0] + 32 * n, (__m512i)int8_bf16(p));
        _mm512_store_si512(a[1] + 32 * n, (__m512i)int8_bf16(p + 32)));
    free(xb);
    return 0;
}

/* int8 in groups: each 16 codes decoded with their group's scale and offset in float32. */
static int int8_group_linear_amx(const uint16_t *x, int64_t rows, int64_t in, const int8_t *codes,
                                 const group_values *scale, const group_values *offset,
                                 int64_t group, const float *bias, float *y, int64_t out) {
    uint32_t *xb = amx_row_tiles(x, rows, in);
    if (!xb) return -1;
    const int64_t groups = in / group;
    AMX_BLOCKS(xb, rows, in, out, bias, y, 1.0f,
               float sc[AMX_CHANNELS * groups]; float mn[AMX_CHANNELS * groups];
               expand_groups(scale, o, C, groups, sc); expand_groups(offset, o, C, groups, mn),
        const int8_t *p = codes + (o + n) * in + step * 32;
        PREFETCH_NEXT_BLOCK(p, AMX_CHANNELS * in);
        PREFETCH_NEXT_BLOCK(p + 63, AMX_CHANNELS * in);
        const float *s = sc + n * groups, *m = mn + n * groups;
        const int64_t i = step * 32;
        _mm512_store_si512(a[0] + 32 * n, (__m512i)int8_group_bf16(p, s, m, i / group, (i + 16) / group));
        _mm512_store_si512(a[1] + 32 * n, (__m512i)int8_group_bf16(p + 32, s, m, (i + 32) / group, (i + 48) / group)));
    free(xb);
    return 0;
}

/* int4: a channel's 64 inputs share one table of both 32-input halves' sixteen weights (as the
 * dot-product kernel's); each byte's two nibbles become the indices of its two inputs, in input
 * order ((b | b << 12) per 32-bit lane puts the high nibble in the odd word), bit 4 picking the
 * half. */
static int int4_linear_amx(const uint16_t *x, int64_t rows, int64_t in, const uint8_t *codes,
                           const group_values *scale, const group_values *offset, int64_t group,
                           const float *bias, float *y, int64_t out) {
    uint32_t *xb = amx_row_tiles(x, rows, in);
    if (!xb) return -1;
    const int64_t groups = in / group, half = in / 2;
    const __m512i nibbles = _mm512_set1_epi32(0x000F000F), second = _mm512_set1_epi32(0x00100010);
    AMX_BLOCKS(xb, rows, in, out, bias, y, 1.0f,
               float sc[AMX_CHANNELS * groups]; float mn[AMX_CHANNELS * groups];
               expand_groups(scale, o, C, groups, sc); expand_groups(offset, o, C, groups, mn),
        const uint8_t *p = codes + (o + n) * half + step * 16;
        PREFETCH_NEXT_BLOCK(p, AMX_CHANNELS * half);
        const __m512i table = int4_step_table(sc + n * groups, mn + n * groups, step * 32 / group,
                                              (step * 32 + 32) / group);
        const __m512i b0 = vbytes(p), b1 = vbytes(p + 16);
        const __m512i i0 = _mm512_ternarylogic_epi32(b0, _mm512_slli_epi32(b0, 12), nibbles, 0xA8);
        const __m512i i1 = _mm512_ternarylogic_epi32(b1, _mm512_slli_epi32(b1, 12), second, 0xFE);
        _mm512_store_si512(a[0] + 32 * n, _mm512_permutexvar_epi16(i0, table));
        _mm512_store_si512(a[1] + 32 * n, _mm512_permutexvar_epi16(i1, table)));
    free(xb);
    return 0;
}
#endif

/* The fewest rows the bfloat16 kernels run as tiles here, or 0 where they never do. */
int mmkv_amx_rows(void) {
#if defined(MMKV_AMX)
    return amx_usable() ? AMX_MIN_ROWS : 0;
#else
    return 0;
#endif
}

int mmkv_int8_linear_bf16(const uint16_t *x, int64_t rows, int64_t in, const int8_t *codes,
                          const float *scale, const float *bias, float *y, int64_t out) {
#if defined(__AVX512BF16__)
    if (in % 32) return -1;
#if defined(MMKV_AMX)
    if (runs_as_tiles(rows, in)) return int8_linear_amx(x, rows, in, codes, scale, bias, y, out);
#endif
    OVER_CHANNEL_BLOCKS(out, int8_channels_bf16(x, rows, in, codes, scale, bias, y, out, o, C));
    return 0;
#else
    (void)x, (void)rows, (void)in, (void)codes, (void)scale, (void)bias, (void)y, (void)out;
    return -1;
#endif
}

int mmkv_int8_group_linear_bf16(const uint16_t *x, int64_t rows, int64_t in, const int8_t *codes,
                                const group_values *scale, const group_values *offset, int64_t group,
                                const float *bias, float *y, int64_t out) {
#if defined(__AVX512BF16__)
    if (group % 16 || in % group || in % 32) return -1;
#if defined(MMKV_AMX)
    if (runs_as_tiles(rows, in))
        return int8_group_linear_amx(x, rows, in, codes, scale, offset, group, bias, y, out);
#endif
    OVER_CHANNEL_BLOCKS(out, int8_group_channels_bf16(x, rows, in, codes, scale, offset, group, bias, y, out, o, C));
    return 0;
#else
    (void)x, (void)rows, (void)in, (void)codes, (void)scale, (void)offset, (void)group, (void)bias;
    (void)y, (void)out;
    return -1;
#endif
}

int mmkv_int4_linear_bf16(const uint16_t *x, int64_t rows, int64_t in, const uint8_t *codes,
                          const group_values *scale, const group_values *offset, int64_t group,
                          const float *bias, float *y, int64_t out) {
#if defined(__AVX512BF16__)
    if (group % 32 || in % group || in % 64) return -1;
#if defined(MMKV_AMX)
    if (runs_as_tiles(rows, in)) return int4_linear_amx(x, rows, in, codes, scale, offset, group, bias, y, out);
#endif
    uint16_t *xs = split_bfloat16(x, rows, in);
    if (!xs) return -1;
    OVER_CHANNEL_BLOCKS(out, int4_channels_bf16(xs, rows, in, codes, scale, offset, group, bias, y, out, o, C));
    free(xs);
    return 0;
#else
    (void)x, (void)rows, (void)in, (void)codes, (void)scale, (void)offset, (void)group, (void)bias;
    (void)y, (void)out;
    return -1;
#endif
}

/* ---- dequantizing a whole weight (for many rows, multiplied by the float GEMM) ---------------- */

/* w[o][i] = codes[o][i] * scale[o], float32 [out][in]. */
int mmkv_int8_dequantize(const int8_t *codes, const float *scale, int64_t out, int64_t in, float *w) {
#pragma omp parallel for schedule(static)
    for (int64_t o = 0; o < out; o++) {
        const float s = scale[o];
#pragma omp simd
        for (int64_t i = 0; i < in; i++) w[o * in + i] = (float)codes[o * in + i] * s;
    }
    return 0;
}

/* Runs GROUP (a call naming o, g, s, m and row) over every group of a grouped weight, channels
 * in parallel: s and m the group's scale and offset as float32, row where its weights go in w.
 * Returns -1 from the caller when group does not divide in. */
#define OVER_GROUPS(scale, offset, group, out, in, w, GROUP)                                     \
    do {                                                                                         \
        if ((group) < 2 || (group) % 2 || (in) % (group)) return -1;                             \
        const int64_t groups = (in) / (group);                                                   \
        _Pragma("omp parallel for schedule(static)")                                             \
        for (int64_t o = 0; o < (out); o++) {                                                    \
            float sv[groups], mv[groups];                                                        \
            expand_groups(scale, o, 1, groups, sv);                                              \
            expand_groups(offset, o, 1, groups, mv);                                             \
            for (int64_t g = 0; g < groups; g++) {                                               \
                const float s = sv[g], m = mv[g];                                                \
                __typeof__(w) row = (w) + o * (in) + g * (group);                                \
                GROUP;                                                                           \
            }                                                                                    \
        }                                                                                        \
    } while (0)

/* An int4 group's codes: bytes of them, from channel o's group g. */
#define INT4_GROUP_CODES (codes + o * (in / 2) + g * (group / 2)), (group / 2)

static inline void int4_group(const uint8_t *restrict q, int64_t bytes, float s, float m,
                              float *restrict row) {
#pragma omp simd
    for (int64_t j = 0; j < bytes; j++) {
        row[2 * j] = (float)(q[j] & 15) * s + m;
        row[2 * j + 1] = (float)(q[j] >> 4) * s + m;
    }
}

/* w[o][i] = q * scale[o][g] + offset[o][g], float32 [out][in]; -1 when group does not divide in. */
int mmkv_int4_dequantize(const uint8_t *codes, const group_values *scale, const group_values *offset,
                         int64_t group, int64_t out, int64_t in, float *w) {
    OVER_GROUPS(scale, offset, group, out, in, w, int4_group(INT4_GROUP_CODES, s, m, row));
    return 0;
}

/* The same weights rounded to bfloat16, [out][in] (what a bfloat16 model multiplies by): with
 * AVX512-BF16, an int4 group's sixteen weights are rounded once and each byte of codes picks its
 * two (as the bfloat16 kernel above does); else each weight is computed in float32 and rounded
 * to nearest even. */
static inline uint16_t float_to_bfloat16(float f) {
    union { float f; uint32_t u; } v = {.f = f};
    return (uint16_t)((v.u + 0x7FFF + ((v.u >> 16) & 1)) >> 16);
}

int mmkv_int8_dequantize_bf16(const int8_t *codes, const float *scale, int64_t out, int64_t in,
                              uint16_t *w) {
#pragma omp parallel for schedule(static)
    for (int64_t o = 0; o < out; o++) {
        const float s = scale[o];
        int64_t i = 0;
#if defined(__AVX512BF16__)
        for (; i + 32 <= in; i += 32) {
            const int8_t *p = codes + o * in + i;
            const __m512 sv = _mm512_set1_ps(s);
            const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_mul_ps(vint8(p + 16), sv), _mm512_mul_ps(vint8(p), sv));
            _mm512_storeu_si512(w + o * in + i, (__m512i)v);
        }
#endif
        for (; i < in; i++) w[o * in + i] = float_to_bfloat16((float)codes[o * in + i] * s);
    }
    return 0;
}

static inline void int4_group_bf16(const uint8_t *restrict q, int64_t bytes, float s, float m,
                                   uint16_t *restrict row) {
    int64_t j = 0;
#if defined(__AVX512BF16__)
    const __m512 t = _mm512_fmadd_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                     _mm512_set1_ps(s), _mm512_set1_ps(m));
    const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(t, t);
    for (; j + 16 <= bytes; j += 16) {
        const __m512i b = vbytes(q + j);
        _mm512_storeu_si512(row + 2 * j, _mm512_permutexvar_epi16(_mm512_or_si512(b, _mm512_slli_epi32(b, 12)), table));
    }
#endif
    for (; j < bytes; j++) {
        row[2 * j] = float_to_bfloat16((float)(q[j] & 15) * s + m);
        row[2 * j + 1] = float_to_bfloat16((float)(q[j] >> 4) * s + m);
    }
}

int mmkv_int4_dequantize_bf16(const uint8_t *codes, const group_values *scale,
                              const group_values *offset, int64_t group, int64_t out, int64_t in,
                              uint16_t *w) {
    OVER_GROUPS(scale, offset, group, out, in, w, int4_group_bf16(INT4_GROUP_CODES, s, m, row));
    return 0;
}

/* w[o][i] = codes[o][i] * scale[o][g] + offset[o][g], float32 or bfloat16 [out][in]; -1 when
 * group does not divide in. */
int mmkv_int8_group_dequantize(const int8_t *codes, const group_values *scale,
                               const group_values *offset, int64_t group, int64_t out, int64_t in,
                               float *w) {
    OVER_GROUPS(scale, offset, group, out, in, w, {
        const int8_t *q = codes + o * in + g * group;
        _Pragma("omp simd") for (int64_t j = 0; j < group; j++) row[j] = (float)q[j] * s + m;
    });
    return 0;
}

int mmkv_int8_group_dequantize_bf16(const int8_t *codes, const group_values *scale,
                                    const group_values *offset, int64_t group, int64_t out,
                                    int64_t in, uint16_t *w) {
    OVER_GROUPS(scale, offset, group, out, in, w, {
        const int8_t *q = codes + o * in + g * group;
        for (int64_t j = 0; j < group; j++) row[j] = float_to_bfloat16((float)q[j] * s + m);
    });
    return 0;
}
