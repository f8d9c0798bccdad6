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
 * Four output rows share each load of x, and the weight is prefetched 512 bytes ahead (measured:
 * the 211 products of a decode step of the default model at one row, 16.8 -> 13.8 ms). The
 * output rows are split between OpenMP threads (PyTorch's own libgomp, already loaded: the same
 * threads, the same count) for every layer of 50,000 weights or more.
 *
 * Built by cpu_int8.py with `cc -O3 -mavx2 -mfma -fopenmp`, called through ctypes.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#define CHUNK 2048

static inline int32_t hsum(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
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
            /* ask for each row's bytes 512 ahead: at one row of x the loop waits on memory */
            _mm_prefetch((const char *)(q + i + 512), _MM_HINT_T0);
            _mm_prefetch((const char *)(q + n + i + 512), _MM_HINT_T0);
            _mm_prefetch((const char *)(q + 2 * n + i + 512), _MM_HINT_T0);
            _mm_prefetch((const char *)(q + 3 * n + i + 512), _MM_HINT_T0);
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
        float top = 0.f;
        for (int64_t i = 0; i < I; i++) top = fmaxf(top, fabsf(xm[i]));
        float s = top > 0.f ? top / 32767.f : 1.f, inv = 1.f / s;
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
 * q in [0, 15], column 2j in the low nibble of byte j and 2j+1 in the high one. Per group,
 *     sum_i x_i w_i = scale * sum_i x_i q_i + zero * sum_i x_i
 * so the inner loop is again integer (xq . q in int32), and the group's sum of x, the same for
 * every output row, is computed once per row of x. x is stored split in its even and odd columns,
 * so the low nibbles of 16 bytes meet xe[j..j+16] and the high nibbles xo[j..j+16] as they are. */
static inline float hsum_ps(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* xq (M, I) int16, xsum (M, I / g) int32 and xs (M,) are scratch space the caller provides */
void int4_matmul(const float *x, const uint8_t *q, const float *scale, const float *zero, float *y,
                 int16_t *xq, int32_t *xsum, float *xs, int64_t M, int64_t O, int64_t I, int64_t g) {
    int64_t G = I / g, half = I / 2;
    for (int64_t m = 0; m < M; m++) {  /* x in int16, even columns then odd ones; sums per group */
        const float *xm = x + m * I;
        int16_t *xe = xq + m * I, *xo = xe + half;
        float top = 0.f;
        for (int64_t i = 0; i < I; i++) top = fmaxf(top, fabsf(xm[i]));
        float s = top > 0.f ? top / 32767.f : 1.f, inv = 1.f / s;
        xs[m] = s;
        for (int64_t j = 0; j < half; j++) {
            xe[j] = (int16_t)lrintf(xm[2 * j] * inv);
            xo[j] = (int16_t)lrintf(xm[2 * j + 1] * inv);
        }
        for (int64_t gi = 0; gi < G; gi++) {
            int32_t t = 0;
            for (int64_t j = gi * g / 2; j < (gi + 1) * g / 2; j++) t += xe[j] + xo[j];
            xsum[m * G + gi] = t;
        }
    }
    const __m128i low4 = _mm_set1_epi8(0x0F);
    #pragma omp parallel for schedule(static) if (O * I >= 50000)
    for (int64_t o = 0; o < O; o++) {
        const uint8_t *qr = q + o * half;
        const float *sr = scale + o * G, *zr = zero + o * G;
        for (int64_t m = 0; m < M; m++) {
            const int16_t *xe = xq + m * I, *xo = xe + half;
            __m256 facc = _mm256_setzero_ps();
            float zacc = 0.f;
            for (int64_t gi = 0; gi < G; gi++) {
                __m256i acc = _mm256_setzero_si256();
                for (int64_t b = gi * g / 2; b < (gi + 1) * g / 2; b += 16) {
                    _mm_prefetch((const char *)(qr + b + 256), _MM_HINT_T0);
                    __m128i v = _mm_loadu_si128((const __m128i *)(qr + b));
                    __m256i lo = _mm256_cvtepu8_epi16(_mm_and_si128(v, low4));
                    __m256i hi = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(v, 4), low4));
                    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i *)(xe + b))));
                    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i *)(xo + b))));
                }
                facc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), _mm256_set1_ps(sr[gi]), facc);
                zacc += zr[gi] * (float)xsum[m * G + gi];
            }
            y[m * O + o] = (hsum_ps(facc) + zacc) * xs[m];
        }
    }
}
