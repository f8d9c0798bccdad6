/* tinyvllm phase 5: int8 and int4 matrix products for AVX2 CPUs (int4_matmul: at the end).
 *
 *     y (M, O) = (x (M, I) @ q (O, I)^T) * scale (O,)        q int8, one scale per output row
 *
 * The idea of the Triton kernel (triton_quant.py), on a CPU: the weight stays int8 in memory and
 * is widened inside the loop, so a step reads 1 byte per weight instead of float32's 4. Each row
 * of x is first rounded to int16 with its own scale (x ~ xq * xs, 15 bits for the row's largest
 * value), so the inner loop is integer: _mm256_madd_epi16 multiplies 16 int16 pairs and adds them
 * in pairs into 8 int32 lanes, one instruction for 16 multiply-adds. Every 2048 columns the int32
 * sums go to a float sum, which keeps them far from overflowing (2048 / 8 * 32767 * 127 < 2^31).
 * Four output rows share each load of x, and the weight is prefetched 2 KB ahead (measured: the
 * 211 products of a decode step of the default model at one row, 16.8 -> 13.8 ms with 512 bytes
 * ahead; the 121 of phase 7's fused step 17.5-19.0 -> 14.8-15.3 ms with 2 KB, on AMD's first
 * EPYC). The output rows are split between OpenMP threads (PyTorch's own libgomp, already
 * loaded: the same threads, the same count) for every layer of 50,000 weights or more.
 *
 * Built by cpu_int8.py with `cc -O3 -mavx2 -mfma -mf16c -fopenmp`, called through ctypes.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define CHUNK 2048

static inline int32_t hsum(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

/* max_i |x_i| over n floats, 8 lanes at a time (a call of libm's fmaxf per value costs more
 * than the rounding it serves); NaNs skipped, as fmaxf skips them */
static inline float absmax(const float *x, int64_t n) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 m = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= n; k += 8) m = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + k)), m);
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    float top = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
    for (; k < n; k++) top = fabsf(x[k]) > top ? fabsf(x[k]) : top;
    return top;
}

/* sum_i xq[i] * q[i] over [begin, end): 16 at a time, then the tail one by one */
static inline __m256i madd16(__m256i acc, const int16_t *x, const int8_t *q) {
    __m256i xv = _mm256_loadu_si256((const __m256i *)x);
    __m256i qv = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)q));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(xv, qv));
}

static float dot(const int16_t *x, const int8_t *q, int64_t n) {
    float total = 0.f;
    for (int64_t c = 0; c < n; c += CHUNK) {
        int64_t end = c + CHUNK < n ? c + CHUNK : n, i = c;
        __m256i acc = _mm256_setzero_si256();
        for (; i + 16 <= end; i += 16) acc = madd16(acc, x + i, q + i);
        int32_t s = hsum(acc);
        for (; i < end; i++) s += (int32_t)x[i] * q[i];
        total += (float)s;
    }
    return total;
}

/* four output rows at once: each 16 values of x loaded once for the four */
static void dot4(const int16_t *x, const int8_t *q, int64_t n, float out[4]) {
    out[0] = out[1] = out[2] = out[3] = 0.f;
    for (int64_t c = 0; c < n; c += CHUNK) {
        int64_t end = c + CHUNK < n ? c + CHUNK : n, i = c;
        __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
        for (; i + 16 <= end; i += 16) {
            __m256i xv = _mm256_loadu_si256((const __m256i *)(x + i));
            /* ask for each row's bytes 2 KB ahead: at one row of x the loop waits on memory */
            _mm_prefetch((const char *)(q + i + 2048), _MM_HINT_T0);
            _mm_prefetch((const char *)(q + n + i + 2048), _MM_HINT_T0);
            _mm_prefetch((const char *)(q + 2 * n + i + 2048), _MM_HINT_T0);
            _mm_prefetch((const char *)(q + 3 * n + i + 2048), _MM_HINT_T0);
            a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(xv, _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(q + i)))));
            a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(xv, _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(q + n + i)))));
            a2 = _mm256_add_epi32(a2, _mm256_madd_epi16(xv, _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(q + 2 * n + i)))));
            a3 = _mm256_add_epi32(a3, _mm256_madd_epi16(xv, _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(q + 3 * n + i)))));
        }
        int32_t s[4] = {hsum(a0), hsum(a1), hsum(a2), hsum(a3)};
        for (; i < end; i++)
            for (int r = 0; r < 4; r++) s[r] += (int32_t)x[i] * q[r * n + i];
        for (int r = 0; r < 4; r++) out[r] += (float)s[r];
    }
}

/* xq (M, I) int16 and xs (M,) are scratch space the caller provides */
void int8_matmul(const float *x, const int8_t *q, const float *scale, float *y,
                 int16_t *xq, float *xs, int64_t M, int64_t O, int64_t I) {
    for (int64_t m = 0; m < M; m++) {  /* each row of x in int16, with its own scale */
        const float *xm = x + m * I;
        float top = absmax(xm, I), s = top > 0.f ? top / 32767.f : 1.f, inv = 1.f / s;
        xs[m] = s;
        for (int64_t i = 0; i < I; i++) xq[m * I + i] = (int16_t)lrintf(xm[i] * inv);
    }
    int64_t blocks = (O + 3) / 4;
    #pragma omp parallel for schedule(static) if (O * I >= 50000)
    for (int64_t b = 0; b < blocks; b++) {
        int64_t o = 4 * b;
        for (int64_t m = 0; m < M; m++) {
            float *ym = y + m * O;
            if (o + 4 <= O) {
                float d[4];
                dot4(xq + m * I, q + o * I, I, d);
                for (int r = 0; r < 4; r++) ym[o + r] = d[r] * xs[m] * scale[o + r];
            } else {
                for (int64_t r = o; r < O; r++) ym[r] = dot(xq + m * I, q + r * I, I) * xs[m] * scale[r];
            }
        }
    }
}

/* int4, groups of g input columns (g = 32, 64 or 128), asymmetric: w = q * scale + zero, with
 * q in [0, 15], column 2j in the low nibble of byte j and 2j+1 in the high one. x is rounded to
 * int8 per block of 32 columns, each block with its own scale (x ~ xq * xs, as llama.cpp's Q8_1
 * blocks), so per block of 32 (inside a group)
 *     sum_i x_i w_i ~ xs * scale * sum_i xq_i q_i + zero * sum_i x_i
 * the inner loop is integer (xq . q in int32), and the group's sum of x, the same for every
 * output row, is computed once per row of x (from xq, so the result is the rounded x times the
 * rounded weight, exactly up to float sums). Rounding x to 8 bits per 32 values costs far less
 * accuracy than the 4-bit weights already do (the lesson), and halves the multiply-adds of
 * keeping x's 16 bits. x is stored split in its even and odd columns, so the low nibbles of 32
 * bytes meet x's even columns and the high nibbles its odd ones as they are.
 *
 * A group's scale and zero are float32 (int4_matmul) or 16-bit floats, as llama.cpp's Q4_1 keeps
 * them (int4_matmul_f16, F16C converting them): 4 bytes a group of 32 instead of 8, a sixth of
 * what a step reads, for a conversion per chunk. Which pays depends on the CPU (lab note 5). */
static inline __attribute__((always_inline)) float scalar_at(const void *p, int64_t i, const int half) {
    return half ? _cvtsh_ss(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}
static inline float hsum_ps(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* R output rows (R = 4, or 1 for the last rows) of int4 against one row of x, 64 columns (32
 * bytes of weights, two blocks of x) a chunk. The nibbles stay bytes: _mm256_maddubs_epi16
 * multiplies 32 unsigned nibbles by 32 signed bytes of x and adds them in pairs (at most
 * 2 * 15 * 127 a pair, and two such sums added: far from int16's limit). Each chunk's int32 sums
 * go to float with their block's scale times their group's (lanes 0-3 are columns 0-31, lanes
 * 4-7 columns 32-63: two groups of 32, or one of 64 or 128); the zero points' term,
 * sum_g zero_g * xsum_g, goes 8 groups at a time after. */
static inline __attribute__((always_inline)) void int4_rows(
        const uint8_t *q, const void *scale, const void *zero, const int8_t *xc, const float *xsc,
        const float *xsumf, int64_t G, int64_t g, int64_t I, int64_t half, const int R, const int f16, float *out) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256 f[4], zf[4];
    const int gshift = __builtin_ctzll((unsigned long long)g);
    for (int r = 0; r < R; r++) f[r] = zf[r] = _mm256_setzero_ps();
    for (int64_t c = 0; c * 64 < I; c++) {
        const int8_t *xp = xc + c * 64;
        __m256i xe = _mm256_loadu_si256((const __m256i *)xp), xo = _mm256_loadu_si256((const __m256i *)(xp + 32));
        __m256 xs = _mm256_set_m128(_mm_set1_ps(xsc[2 * c + 1]), _mm_set1_ps(xsc[2 * c]));
        int64_t g0 = (c * 64) >> gshift, g1 = (c * 64 + 32) >> gshift;  /* g a power of two: no division */
        int full = c * 64 + 64 <= I;
        for (int r = 0; r < R; r++) {
            const uint8_t *qr = q + r * half + c * 32;
            /* 2 KB ahead: the next rows' bytes for a short row (measured: a step's products
             * 13% faster than 512 bytes ahead, on AMD's first EPYC) */
            _mm_prefetch((const char *)(qr + 2048), _MM_HINT_T0);
            __m256i v = full ? _mm256_loadu_si256((const __m256i *)qr)
                             : _mm256_set_m128i(_mm_setzero_si128(), _mm_loadu_si128((const __m128i *)qr));
            __m256i qe = _mm256_and_si256(v, low4), qo = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
            __m256i s16 = _mm256_add_epi16(_mm256_maddubs_epi16(qe, xe), _mm256_maddubs_epi16(qo, xo));
            __m256i s32 = _mm256_madd_epi16(s16, ones);
            __m256 sv = _mm256_set_m128(_mm_set1_ps(scalar_at(scale, r * G + (full ? g1 : g0), f16)),
                                        _mm_set1_ps(scalar_at(scale, r * G + g0, f16)));
            f[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32), _mm256_mul_ps(sv, xs), f[r]);
        }
    }
    int64_t gi = 0;
    for (; gi + 8 <= G; gi += 8) {
        __m256 xv = _mm256_loadu_ps(xsumf + gi);
        for (int r = 0; r < R; r++) {
            __m256 z8 = f16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)zero + r * G + gi)))
                            : _mm256_loadu_ps((const float *)zero + r * G + gi);
            zf[r] = _mm256_fmadd_ps(z8, xv, zf[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        float z = hsum_ps(zf[r]);
        for (int64_t t = gi; t < G; t++) z += scalar_at(zero, r * G + t, f16) * xsumf[t];
        out[r] = hsum_ps(f[r]) + z;
    }
}

/* 32 floats times inv, rounded to the nearest integer (ties to even, as lrintf) and stored as
 * int8 split by parity: even columns at xp[0..16), odd ones at xp[32..48); returns their sum.
 * Floats are split into even and odd lanes first, then each half narrowed 32 -> 16 -> 8 bits
 * (the packs interleave 128-bit lanes, which a permute of 64-bit quarters puts back in order). */
static inline int32_t round32(const float *x, float inv, int8_t *xp) {
    const __m256 iv = _mm256_set1_ps(inv);
    __m256i e[2], o[2];
    for (int h = 0; h < 2; h++) {
        __m256 a = _mm256_loadu_ps(x + 16 * h), b = _mm256_loadu_ps(x + 16 * h + 8);
        __m256 ev = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0x88)), 0xD8));
        __m256 od = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0xDD)), 0xD8));
        e[h] = _mm256_cvtps_epi32(_mm256_mul_ps(ev, iv)), o[h] = _mm256_cvtps_epi32(_mm256_mul_ps(od, iv));
    }
    __m256i e16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(e[0], e[1]), 0xD8);
    __m256i o16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(o[0], o[1]), 0xD8);
    __m256i b8 = _mm256_permute4x64_epi64(_mm256_packs_epi16(e16, o16), 0xD8);   /* evens, odds */
    _mm_storeu_si128((__m128i *)xp, _mm256_castsi256_si128(b8));
    _mm_storeu_si128((__m128i *)(xp + 32), _mm256_extracti128_si256(b8, 1));
    return hsum(_mm256_add_epi32(_mm256_add_epi32(e[0], e[1]), _mm256_add_epi32(o[0], o[1])));
}

/* x (M, I) float32 -> xc (M, C, 64) int8 (C = ceil(I / 64) chunks: even columns, then odd ones;
 * the last chunk's missing half zeros), xsc (M, 2C) the blocks' scales, xsum (M, I / g) float:
 * scratch space the caller provides. I is a multiple of g, so of 32. */
static inline __attribute__((always_inline)) void int4_matmul_any(
        const float *x, const uint8_t *q, const void *scale, const void *zero, float *y, int8_t *xc, float *xsc,
        float *xsum, int64_t M, int64_t O, int64_t I, int64_t g, const int f16) {
    const int64_t size = f16 ? 2 : 4;   /* bytes of a scale */
    int64_t G = I / g, half = I / 2, C = (I + 63) / 64;
    for (int64_t m = 0; m < M; m++) {  /* each block of 32 of each row of x in int8, sums per group */
        const float *xm = x + m * I;
        for (int64_t b = 0; b < 2 * C; b++) {
            int8_t *xp = xc + m * C * 64 + (b / 2) * 64 + (b % 2) * 16;
            float *s = xsc + m * 2 * C + b, top = b * 32 < I ? absmax(xm + b * 32, 32) : 0.f;
            float inv = top > 0.f ? 127.f / top : 0.f;
            *s = top / 127.f;
            if (b * 32 >= I) {   /* the last chunk's missing half: zeros */
                memset(xp, 0, 16), memset(xp + 32, 0, 16);
                continue;
            }
            int32_t sum = round32(xm + b * 32, inv, xp);
            float *gs = xsum + m * G + (b * 32) / g;
            *gs = ((b * 32) % g ? *gs : 0.f) + *s * (float)sum;
        }
    }
    int64_t blocks = (O + 3) / 4;
    #pragma omp parallel for schedule(static) if (O * I >= 50000)
    for (int64_t bk = 0; bk < blocks; bk++) {
        int64_t o = 4 * bk;
        for (int64_t m = 0; m < M; m++) {
            const int8_t *xr = xc + m * C * 64;
            const float *sc = xsc + m * 2 * C;
            if (o + 4 <= O) {
                int4_rows(q + o * half, (const char *)scale + o * G * size, (const char *)zero + o * G * size, xr, sc,
                          xsum + m * G, G, g, I, half, 4, f16, y + m * O + o);
            } else {
                for (int64_t r = o; r < O; r++)
                    int4_rows(q + r * half, (const char *)scale + r * G * size, (const char *)zero + r * G * size, xr,
                              sc, xsum + m * G, G, g, I, half, 1, f16, y + m * O + r);
            }
        }
    }
}

void int4_matmul(const float *x, const uint8_t *q, const float *scale, const float *zero, float *y,
                 int8_t *xc, float *xsc, float *xsum, int64_t M, int64_t O, int64_t I, int64_t g) {
    int4_matmul_any(x, q, scale, zero, y, xc, xsc, xsum, M, O, I, g, 0);
}

void int4_matmul_f16(const float *x, const uint8_t *q, const uint16_t *scale, const uint16_t *zero, float *y,
                     int8_t *xc, float *xsc, float *xsum, int64_t M, int64_t O, int64_t I, int64_t g) {
    int4_matmul_any(x, q, scale, zero, y, xc, xsc, xsum, M, O, I, g, 1);
}

/* int4 back to float32, w (O, I) = q * scale + zero group by group: for many rows of x the
 * product is bound by multiply-adds, not by memory, and a BLAS's float32 product does more of them
 * per cycle than the integer loop above, so the caller unpacks the weight and hands it to one.
 * int4_dequant_bf16 writes each value rounded to bfloat16 (to nearest, ties to even, as
 * PyTorch's .bfloat16() rounds it) for a bfloat16 product: half the bytes, in one pass. */

/* the 16 values of 8 bytes (low nibble first) into w[at..at+16): lanes of 8 floats, the low and
 * high nibbles' values interleaved back into column order, stored as float32 or bfloat16 */
static inline __attribute__((always_inline)) void dequant16(const uint8_t *q, float s, float z, void *w, int64_t at,
                                                            const int bf16) {
    __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)q));
    __m256 sv = _mm256_set1_ps(s), zv = _mm256_set1_ps(z);
    __m256 lo = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15))), sv, zv);
    __m256 hi = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4)), sv, zv);
    __m256 a = _mm256_unpacklo_ps(lo, hi), c = _mm256_unpackhi_ps(lo, hi);     /* columns 0-3 8-11 | 4-7 12-15 */
    __m256 v0 = _mm256_permute2f128_ps(a, c, 0x20), v1 = _mm256_permute2f128_ps(a, c, 0x31);
    if (!bf16) {
        _mm256_storeu_ps((float *)w + at, v0), _mm256_storeu_ps((float *)w + at + 8, v1);
        return;
    }
    __m256i r[2], one = _mm256_set1_epi32(1), bias = _mm256_set1_epi32(0x7FFF);
    for (int k = 0; k < 2; k++) {   /* ties to even on the bits (finite values: q, scale, zero are) */
        __m256i u = _mm256_castps_si256(k ? v1 : v0);
        u = _mm256_add_epi32(u, _mm256_add_epi32(bias, _mm256_and_si256(_mm256_srli_epi32(u, 16), one)));
        r[k] = _mm256_srli_epi32(u, 16);
    }
    _mm256_storeu_si256((__m256i *)((uint16_t *)w + at), _mm256_permute4x64_epi64(_mm256_packus_epi32(r[0], r[1]), 0xD8));
}

static inline __attribute__((always_inline)) void int4_dequant_any(
        const uint8_t *q, const float *scale, const float *zero, void *w, int64_t O, int64_t I, int64_t g,
        const int bf16) {
    int64_t G = I / g, half = I / 2;
    #pragma omp parallel for schedule(static) if (O * I >= 50000)
    for (int64_t o = 0; o < O; o++) {
        const uint8_t *qr = q + o * half;
        for (int64_t gi = 0; gi < G; gi++) {
            const float s = scale[o * G + gi], z = zero[o * G + gi];
            for (int64_t j = gi * g / 2; j < (gi + 1) * g / 2; j += 8)   /* g a multiple of 16 (32, 64, 128) */
                dequant16(qr + j, s, z, w, o * I + 2 * j, bf16);
        }
    }
}

void int4_dequant(const uint8_t *q, const float *scale, const float *zero, float *w, int64_t O, int64_t I,
                  int64_t g) {
    int4_dequant_any(q, scale, zero, w, O, I, g, 0);
}

void int4_dequant_bf16(const uint8_t *q, const float *scale, const float *zero, uint16_t *w, int64_t O,
                       int64_t I, int64_t g) {
    int4_dequant_any(q, scale, zero, w, O, I, g, 1);
}
