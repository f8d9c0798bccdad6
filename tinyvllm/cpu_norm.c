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

/* x, out (N, D); residual (N, D) or NULL; weight (D,). out may be x. */
void add_rms_norm(float *x, float *residual, const float *weight, float *out, int64_t N, int64_t D, float eps) {
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
