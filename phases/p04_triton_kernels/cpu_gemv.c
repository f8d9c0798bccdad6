/* tinyvllm: the float32 product of a few rows (cpu_layers.py's `CpuLinear`), on an AVX2 CPU.
 *
 *     y (M, O) = x (M, I) @ w (O, I)^T        M small (a decode batch), w float32 as stored
 *
 * A batch-1 decode step reads every weight once and does one multiply-add with it: the product
 * is bound by how fast the weights stream from memory. PyTorch's float32 products on AMD's first
 * EPYC (MKL's, or oneDNN's on its packed copy) read them at about 10 GB/s of the 19 GB/s the two
 * cores read at; this loop, at about 17. Four output rows at a time share each load of x; each
 * row's 16 columns a step go to two sums (two chains of fused multiply-adds in flight); the
 * bytes 2 KB ahead are prefetched. For more rows of x the same weights come again from the L1
 * cache (four rows of the default model's widest layer: 24 KB), which pays up to a few rows:
 * from there PyTorch's blocked product, which reuses each weight across many rows, wins (the
 * row count where it takes over was measured, compiled.py). The sums run in another order than
 * PyTorch's: the results differ from F.linear's by float rounding (tested). */
#include <immintrin.h>
#include <stdint.h>

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* R (1 to 4) output rows against one row of x */
static inline __attribute__((always_inline)) void rows_dot(const float *x, const float *w, int64_t I,
                                                             const int R, float *out) {
    __m256 a[4], b[4];
    for (int r = 0; r < R; r++) a[r] = b[r] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= I; k += 16) {
        __m256 x0 = _mm256_loadu_ps(x + k), x1 = _mm256_loadu_ps(x + k + 8);
        for (int r = 0; r < R; r++) {
            const float *wr = w + r * I + k;
            _mm_prefetch((const char *)(wr + 512), _MM_HINT_T0);
            a[r] = _mm256_fmadd_ps(_mm256_loadu_ps(wr), x0, a[r]);
            b[r] = _mm256_fmadd_ps(_mm256_loadu_ps(wr + 8), x1, b[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        float s = hsum(_mm256_add_ps(a[r], b[r]));
        for (int64_t t = k; t < I; t++) s += w[r * I + t] * x[t];
        out[r] = s;
    }
}

void f32_matmul(const float *x, const float *w, float *y, int64_t M, int64_t O, int64_t I) {
    int64_t blocks = (O + 3) / 4;
    #pragma omp parallel for schedule(static) if (O * I >= 50000)
    for (int64_t bk = 0; bk < blocks; bk++) {
        int64_t o = 4 * bk;
        for (int64_t m = 0; m < M; m++) {
            if (o + 4 <= O) {
                float d[4];
                rows_dot(x + m * I, w + o * I, I, 4, d);
                for (int r = 0; r < 4; r++) y[m * O + o + r] = d[r];
            } else {
                for (int64_t r = o; r < O; r++) rows_dot(x + m * I, w + r * I, I, 1, y + m * O + r);
            }
        }
    }
}
