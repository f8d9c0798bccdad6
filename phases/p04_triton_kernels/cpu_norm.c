/* tinyvllm: the residual add and the RMSNorm after it in one pass, float32, on an AVX2 CPU
 * (vLLM's fused_add_rms_norm, for the decode step of phase 7's `decode_forward`).
 *
 *     residual += x;   x = residual / sqrt(mean(residual^2) + eps) * weight      (each row)
 *
 * Without a residual (the first layer's), out = x / sqrt(mean(x^2) + eps) * weight. At a decode
 * step's few rows PyTorch's RMSNorm is six operator calls on 576 numbers (about 20 us on a Zen 4
 * EPYC), nearly all of it dispatch; this is one ctypes call of about 5, most of it the call. The
 * sum of squares runs in its own order, so the results differ from PyTorch's by float rounding
 * (tested). */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

/* From this many rows (a prompt's) a call splits its rows among OpenMP's threads; a decode step's
 * few rows stay on the calling thread, where starting the threads would cost more than the rows. */
#define PARALLEL_ROWS 64

/* x, out (N, D); residual (N, D) or NULL; weight (D,). out may be x. */
void add_rms_norm(float *x, float *residual, const float *weight, float *out, int64_t N, int64_t D, float eps) {
    #pragma omp parallel for if (N >= PARALLEL_ROWS)
    for (int64_t n = 0; n < N; n++) {
        float *xn = x + n * D, *r = residual ? residual + n * D : xn, *o = out + n * D;
        __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
        int64_t j = 0;
        for (; j + 16 <= D; j += 16) {
            __m256 a = _mm256_loadu_ps(r + j), b = _mm256_loadu_ps(r + j + 8);
            if (residual) {
                a = _mm256_add_ps(a, _mm256_loadu_ps(xn + j));
                b = _mm256_add_ps(b, _mm256_loadu_ps(xn + j + 8));
                _mm256_storeu_ps(r + j, a);
                _mm256_storeu_ps(r + j + 8, b);
            }
            s0 = _mm256_fmadd_ps(a, a, s0);
            s1 = _mm256_fmadd_ps(b, b, s1);
        }
        float lanes[8], sum = 0.f;
        _mm256_storeu_ps(lanes, _mm256_add_ps(s0, s1));
        for (int l = 0; l < 8; l++) sum += lanes[l];
        for (; j < D; j++) {
            if (residual) r[j] += xn[j];
            sum += r[j] * r[j];
        }
        const float inv = 1.f / sqrtf(sum / (float)D + eps);
        const __m256 vinv = _mm256_set1_ps(inv);
        for (j = 0; j + 8 <= D; j += 8)
            _mm256_storeu_ps(o + j, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(r + j), vinv), _mm256_loadu_ps(weight + j)));
        for (; j < D; j++) o[j] = r[j] * inv * weight[j];
    }
}

/* RoPE as tinyvllm.layers' `apply_rotary` computes it (the rotate-half form of GPT-NeoX and Llama),
 * for one of q or k: out[n, h, j] = x[n, h, j] * cos[n, j] + r[j] * sin[n, j], r the head's
 * halves swapped and the first negated; each product rounded, then their sum, no FMA: PyTorch's
 * operators' numbers bit for bit, in one pass instead of seven. x: N rows of `heads` heads of d
 * floats, a row `row` floats apart (q or k as a view of the qkv product); cos, sin (N, d); out
 * (N, heads, d); d a multiple of 16. */
void rope(const float *x, int64_t row, int64_t heads, const float *cos, const float *sin, float *out, int64_t N,
          int64_t d) {
    const int64_t half = d / 2;
    const __m256 sign = _mm256_set1_ps(-0.f);
    #pragma omp parallel for if (N >= PARALLEL_ROWS)
    for (int64_t n = 0; n < N; n++)
        for (int64_t h = 0; h < heads; h++) {
            const float *xh = x + n * row + h * d, *c = cos + n * d, *s = sin + n * d;
            float *o = out + (n * heads + h) * d;
            for (int64_t j = 0; j < half; j += 8) {
                __m256 lo = _mm256_loadu_ps(xh + j), hi = _mm256_loadu_ps(xh + half + j);
                __m256 a = _mm256_mul_ps(lo, _mm256_loadu_ps(c + j));
                __m256 b = _mm256_mul_ps(_mm256_xor_ps(hi, sign), _mm256_loadu_ps(s + j));
                _mm256_storeu_ps(o + j, _mm256_add_ps(a, b));
                a = _mm256_mul_ps(hi, _mm256_loadu_ps(c + half + j));
                b = _mm256_mul_ps(lo, _mm256_loadu_ps(s + half + j));
                _mm256_storeu_ps(o + half + j, _mm256_add_ps(a, b));
            }
        }
}
