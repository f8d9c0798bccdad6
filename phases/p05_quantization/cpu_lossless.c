/* tinyvllm phase 5: a float32 layer read from the exact codes of its weight, for AVX2 CPUs.
 *
 * A checkpoint stored quantized (a GGUF file in Q4_1 or Q8_0, as the default model ships) and
 * converted to float32 has weights that lie exactly on a grid: in each block of 32 columns of a
 * row, w = q * scale + zero with q in 0..15 (Q4_1), or w = q * scale with q in -127..127 (Q8_0).
 * `lossless_find` looks for those codes (each block's scale and zero as `quantize_int4` and
 * `quantize_int8` would choose them, but per block of 32; where the block's codes do not reach
 * 15 (4 bits) or are 5- or 6-bit ones (8 bits, Q5_0's), the span over a smaller top code) and
 * says whether they give back every weight bit for bit: q * scale + zero in float32 rounded once
 * (a fused multiply-add), q * scale for 8 bits. 6 bits are 8-bit codes with a scale per 16
 * columns (Q6_K's groups: a float16 d, a signed byte sc_j and a 6-bit code multiply to at most 23
 * significant bits, so its reader's weights are exact products). A GGUF file's scales and
 * minimums are 16-bit floats, so q * scale is exact in float32 and its reader's float32 weights
 * are rounded once, at the add, whatever it computes them with. (This file is compiled with
 * -ffp-contract=off: no multiply-add is fused but those written so.)
 *
 * `lossless_matmul` is then the float32 product y (M, O) = x (M, I) @ w (O, I)^T with the weight
 * read from its codes: 6, 9 or 10 bits a weight from memory instead of 32 (scales included). Each
 * weight is rebuilt in registers, exactly (the same multiply-add, one instruction for 8
 * weights), and multiplied by x in float32: the arithmetic of the float32 product, summed in
 * another order. A batch-1 decode step reads every weight once,
 * so it is bound by the bytes it reads, and this is the cheapest way to read fewer of them
 * without changing a single weight. From a few rows of x on, the products of rebuilt weights cost
 * more than the bytes they save, and the caller takes the float32 weight instead (lossless.py).
 *
 * int4 codes are stored in this kernel's own layout: for each 16 columns, 8 bytes, byte j holding
 * column j in its low nibble and column j + 8 in its high one, so that one _mm256_cvtepu8_epi32 of
 * 8 bytes gives columns 0-7 (& 15) and 8-15 (>> 4) in order, each next to x's. One output row at
 * a time against up to 4 rows of x, four sums a row of x (two from the 3rd row of x on) so that
 * several chains of multiply-adds are in flight; output rows split between OpenMP threads.
 *
 * Built by lossless.py with `cc -O3 -mavx2 -mfma -ffp-contract=off -fopenmp -DCODES_AHEAD=n`, called through
 * ctypes (and from phase 7's compiled step, cpu_ops.cpp). */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#define BLOCK 32

/* CODES_AHEAD (-DCODES_AHEAD=bytes, the platform's `codes_fetch_ahead` rule; 0: 1024): how far
 * ahead of the codes it reads a product asks memory for the next ones. The farther, the more lines
 * are on their way at once; the best distance is the machine's (codes-fetch-ahead-*.txt). */
#ifndef CODES_AHEAD
#define CODES_AHEAD 0
#endif
#define AHEAD (CODES_AHEAD ? CODES_AHEAD : 1024)

/* 8 int32 lanes -> 8 bytes at dst (unsigned, or signed: each lane fits) */
static inline void store8(void *dst, __m256i v, const int is_signed) {
    __m128i a = _mm256_castsi256_si128(v), b = _mm256_extracti128_si256(v, 1);
    __m128i p = is_signed ? _mm_packs_epi16(_mm_packs_epi32(a, b), a) : _mm_packus_epi16(_mm_packus_epi32(a, b), a);
    _mm_storel_epi64((__m128i *)dst, p);
}

static inline float hmax(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

#define ROUND(v) _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)  /* ties to even, as torch.round */

/* the codes k (as floats) of n vectors of 8 weights (a block: 4; 6 bits' group: 2) for scale s
 * and zero l (0 for 8 and 6 bits): round((w - l) / s) in 0..15 or -127..127; whether k * s + l
 * (4 bits: one rounding, a fused multiply-add; else the product's) gives back every weight */
static inline int block_codes(const __m256 *v, const int n, float s, float l, const int bits, __m256 *k) {
    const __m256 sv = _mm256_set1_ps(s), lv = _mm256_set1_ps(l);
    const __m256 low = _mm256_set1_ps(bits == 4 ? 0.f : -127.f), high = _mm256_set1_ps(bits == 4 ? 15.f : 127.f);
    int same = 1;
    for (int c = 0; c < n; c++) {
        k[c] = _mm256_min_ps(_mm256_max_ps(ROUND(_mm256_div_ps(_mm256_sub_ps(v[c], lv), sv)), low), high);
        const __m256 back = bits == 4 ? _mm256_fmadd_ps(k[c], sv, lv) : _mm256_mul_ps(k[c], sv);
        same &= _mm256_movemask_ps(_mm256_cmp_ps(back, v[c], _CMP_EQ_OQ)) == 0xFF;
    }
    return same;
}

/* the codes of w (O, I), I a multiple of 32, block by block as quantize_int4 and quantize_int8
 * choose them: 4 bits, zero = the block's minimum, scale = (its maximum - zero) / 15 (at least
 * 1e-8), q (O, I/2) in the layout above; 8 bits, zero 0 (not stored), scale = its largest
 * magnitude / 127, q (O, I) int8. Those are computed in float32 from weights that were rounded
 * from the stored scale, so they can miss it by a float step or two: where a block's codes do not
 * give it back, the scales one and two steps either side are tried. 6 bits (GGUF Q6_K's
 * d*sc_j * (q - 32): a scale per 16 columns): q (O, I) int8 as for 8 bits, scale (O, I/16), each
 * group's the smallest top code that gives it back (1 to 63, then 127). *exact = 1 if every
 * block's codes give back every weight bit for bit (it stops early once one does not). */
void lossless_find(const float *w, uint8_t *q, float *scale, float *zero, int32_t *exact, int64_t O, int64_t I,
                   int64_t bits) {
    volatile int32_t ok = 1;
    const __m256 sign = _mm256_set1_ps(-0.f);
    if (bits == 6) {
        #pragma omp parallel for schedule(static)
        for (int64_t o = 0; o < O; o++) {
            for (int64_t g = 0; ok && g < I / 16; g++) {
                const float *wg = w + o * I + g * 16;
                __m256 v[2] = {_mm256_loadu_ps(wg), _mm256_loadu_ps(wg + 8)}, k[2];
                const float top = hmax(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])));
                float s = 0.f;
                int same = top == 0.f;   /* a group of zeros: codes 0, scale 0 */
                for (int t = 1; !same && t <= 64; t++)
                    same = block_codes(v, 2, s = top / (float)(t == 64 ? 127 : t), 0.f, 8, k);
                if (!same) ok = 0;
                scale[o * (I / 16) + g] = s;
                for (int c = 0; c < 2; c++)
                    store8(q + o * I + g * 16 + 8 * c, top == 0.f ? _mm256_setzero_si256() : _mm256_cvtps_epi32(k[c]), 1);
            }
        }
        *exact = ok;
        return;
    }
    #pragma omp parallel for schedule(static)
    for (int64_t o = 0; o < O; o++) {
        for (int64_t b = 0; ok && b < I / BLOCK; b++) {
            const float *wb = w + o * I + b * BLOCK;
            __m256 v[4], k[4], lo = _mm256_loadu_ps(wb), hi = lo, top = _mm256_setzero_ps();
            for (int c = 0; c < 4; c++) {
                v[c] = _mm256_loadu_ps(wb + 8 * c);
                lo = _mm256_min_ps(lo, v[c]), hi = _mm256_max_ps(hi, v[c]);
                top = _mm256_max_ps(top, _mm256_andnot_ps(sign, v[c]));
            }
            const float l = bits == 4 ? -hmax(_mm256_sub_ps(_mm256_setzero_ps(), lo)) : 0.f;
            float s = bits == 4 ? (hmax(hi) - l) / 15.f : hmax(top) / 127.f;
            s = bits == 4 && s < 1e-8f ? 1e-8f : s;
            int same = s == 0.f || block_codes(v, 4, s, l, bits, k);   /* s == 0: an 8-bit block of zeros */
            if (!same) {
                const float up = nextafterf(s, INFINITY), down = nextafterf(s, 0.f);
                const float tries[4] = {up, down, nextafterf(up, INFINITY), nextafterf(down, 0.f)};
                for (int t = 0; t < 4 && !same; t++) same = block_codes(v, 4, s = tries[t], l, bits, k);
            }
            /* a block whose largest code is under 15 (Q4_0's, whose codes d * (q - 8) rarely reach
             * both ends; a Q4_K group's): its step is the span over that code; for 8 bits, a block
             * of narrower signed codes (Q5_0's d * (q - 16): its largest magnitude is 16 d or less),
             * the smallest top code first, so that the step found is d, not d / 2 */
            for (int t = 1; !same && t <= (bits == 4 ? 14 : 31); t++) {
                const int top_code = bits == 4 ? 15 - t : t;
                const float st = (bits == 4 ? hmax(hi) - l : hmax(top)) / (float)top_code;
                const float tries[3] = {st, nextafterf(st, INFINITY), nextafterf(st, 0.f)};
                for (int t = 0; t < 3 && !same; t++) same = block_codes(v, 4, s = tries[t], l, bits, k);
            }
            if (!same) ok = 0;
            scale[o * (I / BLOCK) + b] = s;
            if (bits == 4) {
                zero[o * (I / BLOCK) + b] = l;
                for (int h = 0; h < 2; h++)   /* byte j of each 16 columns: column j | column j + 8 << 4 */
                    store8(q + o * I / 2 + b * 16 + 8 * h, _mm256_or_si256(_mm256_cvtps_epi32(k[2 * h]),
                           _mm256_slli_epi32(_mm256_cvtps_epi32(k[2 * h + 1]), 4)), 0);
            } else {
                for (int c = 0; c < 4; c++)
                    store8(q + o * I + b * BLOCK + 8 * c, s == 0.f ? _mm256_setzero_si256() : _mm256_cvtps_epi32(k[c]), 1);
            }
        }
    }
    *exact = ok;
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 32 weights of one row back in float32, exactly: w[0..3] hold columns 0-7, 8-15, 16-23, 24-31
 * (6 bits: columns 0-15 on scale s, 16-31 on s2) */
static inline __attribute__((always_inline)) void rebuild(const uint8_t *q, const int bits, __m256 s, __m256 s2,
                                                          __m256 z, __m256 *w) {
    if (bits == 4) {
        const __m256i low4 = _mm256_set1_epi32(15);
        for (int h = 0; h < 2; h++) {
            __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8 * h)));
            w[2 * h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v, low4)), s, z);
            w[2 * h + 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)), s, z);
        }
    } else {
        for (int c = 0; c < 4; c++)
            w[c] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8 * c)))),
                                 c < 2 ? s : s2);
    }
}

/* one output row against M (1 to 4) rows of x */
static inline __attribute__((always_inline)) void row(const uint8_t *q, const float *scale, const float *zero,
        const float *x, float *y, int64_t O, int64_t I, const int bits, const int M) {
    __m256 a[4][4], w[4];
    for (int m = 0; m < M; m++)
        for (int c = 0; c < 4; c++) a[m][c] = _mm256_setzero_ps();
    const int64_t bytes = bits == 4 ? BLOCK / 2 : BLOCK;
    for (int64_t b = 0; b < I / BLOCK; b++) {
        const uint8_t *qb = q + b * bytes;
        if (bits != 4 || (b & 1) == 0) _mm_prefetch((const char *)(qb + AHEAD), _MM_HINT_T0);
        const __m256 s = _mm256_broadcast_ss(scale + (bits == 6 ? 2 * b : b));
        rebuild(qb, bits, s, bits == 6 ? _mm256_broadcast_ss(scale + 2 * b + 1) : s,
                bits == 4 ? _mm256_broadcast_ss(zero + b) : _mm256_setzero_ps(), w);
        for (int m = 0; m < M; m++)
            for (int c = 0; c < 4; c++) {
                const int chain = M <= 2 ? c : c & 1;
                a[m][chain] = _mm256_fmadd_ps(w[c], _mm256_loadu_ps(x + m * I + b * BLOCK + 8 * c), a[m][chain]);
            }
    }
    for (int m = 0; m < M; m++) {
        __m256 t = _mm256_add_ps(a[m][0], a[m][1]);
        y[m * O] = hsum(M <= 2 ? _mm256_add_ps(t, _mm256_add_ps(a[m][2], a[m][3])) : t);
    }
}

#define ROWS(bits, m) row(qo, scale + o * (bits == 6 ? I / 16 : I / BLOCK), zero ? zero + o * (I / BLOCK) : 0, \
                          x + (m0) * I, y + (m0) * O + o, O, I, bits, m)

/* x (M, I) float32, q the codes (bits 4, 8 or 6), scale and zero (O, I/32; 6 bits: scale (O, I/16);
 * zero NULL but for 4 bits) -> y (M, O) float32 */
void lossless_matmul(const float *x, const uint8_t *q, const float *scale, const float *zero, float *y,
                     int64_t M, int64_t O, int64_t I, int64_t bits) {
    #pragma omp parallel for schedule(static) if (O * I >= 50000)
    for (int64_t o = 0; o < O; o++) {
        const uint8_t *qo = q + (bits == 4 ? o * I / 2 : o * I);
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
            const int64_t n = M - m0 < 4 ? M - m0 : 4;
            if (bits == 4) {
                if (n == 1) ROWS(4, 1); else if (n == 2) ROWS(4, 2); else if (n == 3) ROWS(4, 3); else ROWS(4, 4);
            } else if (bits == 8) {
                if (n == 1) ROWS(8, 1); else if (n == 2) ROWS(8, 2); else if (n == 3) ROWS(8, 3); else ROWS(8, 4);
            } else {
                if (n == 1) ROWS(6, 1); else if (n == 2) ROWS(6, 2); else if (n == 3) ROWS(6, 3); else ROWS(6, 4);
            }
        }
    }
}
