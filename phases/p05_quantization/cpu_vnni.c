/* tinyvllm phase 5: an int8 matrix product for CPUs with AVX512-VNNI (vpdpbusd).
 *
 *     y (M, O) = (x (M, K) @ q (O, K)^T) * scale (O,)        q int8, one scale per output row
 *
 * One instruction, vpdpbusd, multiplies 64 unsigned bytes by 64 signed bytes and adds each four
 * neighbouring products into one of 16 int32 lanes: 64 multiply-adds, against 16 for a float32
 * FMA of the same width. To use it, both sides must be bytes:
 *
 * - Each row of x (a token) is rounded to int8 with its own scale, xs = max|x_row| / 127, in two
 *   parts (`quantize_row`): a coarse one, c = round(x / xs), and a fine one, what that rounding
 *   lost times 254. Eight bits alone lose 3.1% of the default model's perplexity (the lesson),
 *   the two parts 0.26%: about 15 bits, as cpu_int8.c's int16, for twice the multiply-adds.
 * - The weight is the unsigned side: stored as q + 128 (0..254). The shift is undone exactly:
 *       sum_k (q + 128) x = sum_k q x + 128 * sum_k x
 *   so each part of each row keeps its sum, xsum, and subtracts 128 * xsum at the end.
 *
 * The weight is packed once into panels of 64 output rows, so that one 64-byte load holds four
 * consecutive k of 16 outputs, the order vpdpbusd wants; four loads cover 64 outputs:
 *
 *     wp[panel][k / 4][64 outputs][4 k]          (K padded to a multiple of 4, O to one of 64)
 *
 * Each step of the inner loop broadcasts four bytes of one row of x (k .. k + 3) to all lanes and
 * multiply-adds them against the four loads: a tile of MR rows x 64 outputs keeps its sums in
 * registers for the whole of K and reads each weight byte once per tile. The sums stay exact in
 * int32 up to K = 65,536 (at most 4 * 255 * 127 per step and lane, K / 4 steps), so a row's
 * result does not depend on the other rows, nor on how the work is split.
 *
 * The tiles are split between OpenMP threads (PyTorch's own libgomp, already loaded) by panel
 * and by chunks of rows, for every product of 50,000 weights or more.
 *
 * Built by cpu_int8.py with `cc -O3 -mavx512f -mavx512bw -mavx512vl -mavx512vnni -fopenmp`,
 * called through ctypes.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define NP 64        /* outputs per panel */
#define MR 3         /* rows of x per tile: 2 * 3 rows of bytes x 4 zmm = 24 sums in registers */
#define RC 24        /* rows of x per thread's chunk: a panel stays in cache across them */
#define FINE 254.f   /* the fine part's levels per coarse level */

/* q (O, K) int8 -> wp (ceil(O / 64), K4, 64, 4) uint8 = q + 128; padding holds 128 (q = 0) */
void vnni_pack(const int8_t *q, uint8_t *wp, int64_t O, int64_t K) {
    int64_t K4 = (K + 3) / 4, panels = (O + NP - 1) / NP;
    memset(wp, 128, (size_t)(panels * K4 * NP * 4));
    for (int64_t o = 0; o < O; o++) {
        int64_t p = o / NP, j = o % NP;
        for (int64_t k = 0; k < K; k++)
            wp[((p * K4 + k / 4) * NP + j) * 4 + k % 4] = (uint8_t)(q[o * K + k] + 128);
    }
}

static inline __mmask16 tail_mask(int64_t n) {
    return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1);
}

/* One row of x -> two int8 rows, the coarse part c = round(x / xs) and the fine part
 * f = round((x / xs - c) * FINE) (|x / xs - c| <= 1/2, so |f| <= 127), x ~ xs * (c + f / FINE);
 * and each part's sum. Rounded to nearest, ties to even (the CPU's default, as lrintf). */
static void quantize_row(const float *x, int8_t *q, int32_t *xsum, float *xs, int64_t K, int64_t ldx) {
    __m512 top = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16)
        top = _mm512_max_ps(top, _mm512_abs_ps(_mm512_maskz_loadu_ps(tail_mask(K - k), x + k)));
    float t = _mm512_reduce_max_ps(top), s = t > 0.f ? t / 127.f : 1.f;
    __m512 inv = _mm512_set1_ps(1.f / s), fine = _mm512_set1_ps(FINE);
    __m512i sum_c = _mm512_setzero_si512(), sum_f = _mm512_setzero_si512();
    int8_t *qc = q, *qf = q + ldx;
    for (int64_t k = 0; k < K; k += 16) {
        __mmask16 m = tail_mask(K - k);
        __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + k), inv);
        __m512i c = _mm512_cvtps_epi32(v);
        __m512i f = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(v, _mm512_cvtepi32_ps(c)), fine));
        sum_c = _mm512_add_epi32(sum_c, c);
        sum_f = _mm512_add_epi32(sum_f, f);
        _mm_mask_storeu_epi8(qc + k, m, _mm512_cvtsepi32_epi8(c));
        _mm_mask_storeu_epi8(qf + k, m, _mm512_cvtsepi32_epi8(f));
    }
    for (int64_t k = K; k < ldx; k++) qc[k] = qf[k] = 0;
    *xs = s;
    xsum[0] = _mm512_reduce_add_epi32(sum_c);
    xsum[1] = _mm512_reduce_add_epi32(sum_f);
}

/* The end of a tile, for one row of x: its coarse sums c and fine sums f (4 x 16 outputs each)
 * -> y[o0 .. o0 + 64) = (c - 128 xsum_c + (f - 128 xsum_f) / FINE) * xs * scale (masked past O). */
static inline void store_row(__m512i c0, __m512i c1, __m512i c2, __m512i c3, __m512i f0, __m512i f1,
                             __m512i f2, __m512i f3, const int32_t *xsum, float xs, const float *scale,
                             float *y, int64_t O, int64_t o0) {
    __m512i c[4] = {c0, c1, c2, c3}, f[4] = {f0, f1, f2, f3};
    __m512i shift_c = _mm512_set1_epi32(128 * xsum[0]), shift_f = _mm512_set1_epi32(128 * xsum[1]);
    __m512 sx = _mm512_set1_ps(xs), inv_fine = _mm512_set1_ps(1.f / FINE);
    for (int j = 0; j < 4 && o0 + 16 * j < O; j++) {
        int64_t o = o0 + 16 * j;
        __mmask16 m = tail_mask(O - o);
        __m512 coarse = _mm512_cvtepi32_ps(_mm512_sub_epi32(c[j], shift_c));
        __m512 fine = _mm512_cvtepi32_ps(_mm512_sub_epi32(f[j], shift_f));
        __m512 v = _mm512_fmadd_ps(fine, inv_fine, coarse);
        _mm512_mask_storeu_ps(y + o, m, _mm512_mul_ps(_mm512_mul_ps(v, sx), _mm512_maskz_loadu_ps(m, scale + o)));
    }
}

/* A tile: up to MR rows of x (each two rows of bytes, coarse then fine) against one panel. The
 * sums are named variables, not an array, so that the compiler keeps all of them in registers. */
#define ZERO4(a) __m512i a##0 = _mm512_setzero_si512(), a##1 = a##0, a##2 = a##0, a##3 = a##0
#define MADD4(a, row) do {                                                   \
        int32_t four_;                                                       \
        memcpy(&four_, xq + (row) * ldx + kq * 4, 4);                        \
        __m512i b_ = _mm512_set1_epi32(four_);  /* x[k .. k + 3], every lane */ \
        a##0 = _mm512_dpbusd_epi32(a##0, w0, b_);                            \
        a##1 = _mm512_dpbusd_epi32(a##1, w1, b_);                            \
        a##2 = _mm512_dpbusd_epi32(a##2, w2, b_);                            \
        a##3 = _mm512_dpbusd_epi32(a##3, w3, b_);                            \
    } while (0)
#define STORE(c, f, r) store_row(c##0, c##1, c##2, c##3, f##0, f##1, f##2, f##3, xsum + 2 * (r), \
                                 xs[r], scale, y + (r) * O, O, o0)
#define TILE(name, ROWS_ZERO, ROWS_MADD, ROWS_STORE)                                              \
    static void name(const uint8_t *wp, const int8_t *xq, const int32_t *xsum, const float *xs, \
                     const float *scale, float *y, int64_t O, int64_t o0, int64_t K4) {       \
        const int64_t ldx = K4 * 4;                                                           \
        ROWS_ZERO                                                                             \
        for (int64_t kq = 0; kq < K4; kq++) {                                                 \
            const uint8_t *w = wp + kq * NP * 4;  /* 16 outputs x 4 k in each load */         \
            __m512i w0 = _mm512_loadu_si512(w), w1 = _mm512_loadu_si512(w + 64);              \
            __m512i w2 = _mm512_loadu_si512(w + 128), w3 = _mm512_loadu_si512(w + 192);       \
            ROWS_MADD                                                                         \
        }                                                                                     \
        ROWS_STORE                                                                            \
    }
TILE(tile3, ZERO4(c0); ZERO4(f0); ZERO4(c1); ZERO4(f1); ZERO4(c2); ZERO4(f2);,
     MADD4(c0, 0); MADD4(f0, 1); MADD4(c1, 2); MADD4(f1, 3); MADD4(c2, 4); MADD4(f2, 5);,
     STORE(c0, f0, 0); STORE(c1, f1, 1); STORE(c2, f2, 2);)
TILE(tile2, ZERO4(c0); ZERO4(f0); ZERO4(c1); ZERO4(f1);,
     MADD4(c0, 0); MADD4(f0, 1); MADD4(c1, 2); MADD4(f1, 3);,
     STORE(c0, f0, 0); STORE(c1, f1, 1);)
TILE(tile1, ZERO4(c0); ZERO4(f0);, MADD4(c0, 0); MADD4(f0, 1);, STORE(c0, f0, 0);)

/* xq (2M, K4 * 4) int8, xsum (2M,) int32 and xs (M,) float are scratch space the caller provides */
void vnni_int8_matmul(const float *x, const uint8_t *wp, const float *scale, float *y,
                      int8_t *xq, int32_t *xsum, float *xs, int64_t M, int64_t O, int64_t K) {
    int64_t K4 = (K + 3) / 4, ldx = K4 * 4;
    #pragma omp parallel for schedule(static) if (M * K >= 16384)
    for (int64_t m = 0; m < M; m++)
        quantize_row(x + m * K, xq + 2 * m * ldx, xsum + 2 * m, xs + m, K, ldx);
    int64_t panels = (O + NP - 1) / NP, chunks = (M + RC - 1) / RC;
    #pragma omp parallel for collapse(2) schedule(static) if (O * K >= 50000)
    for (int64_t p = 0; p < panels; p++) {
        for (int64_t c = 0; c < chunks; c++) {
            const uint8_t *w = wp + p * K4 * NP * 4;
            int64_t m = c * RC, end = m + RC < M ? m + RC : M;
            for (; m + MR <= end; m += MR)
                tile3(w, xq + 2 * m * ldx, xsum + 2 * m, xs + m, scale, y + m * O, O, p * NP, K4);
            if (end - m == 2)
                tile2(w, xq + 2 * m * ldx, xsum + 2 * m, xs + m, scale, y + m * O, O, p * NP, K4);
            else if (end - m == 1)
                tile1(w, xq + 2 * m * ldx, xsum + 2 * m, xs + m, scale, y + m * O, O, p * NP, K4);
        }
    }
}
