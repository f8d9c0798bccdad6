/* tinyvllm phase 4: a decode step's attention over the paged float32 cache, for x86 CPUs with AVX2.
 *
 * What the Triton kernel does on a GPU, for the step that runs most: B sequences, one new query
 * each. PyTorch's path (phase 2's decode_attention) spends ten operator calls per layer around
 * a few hundred thousand multiply-adds: a gather of each sequence's blocks into a padded copy,
 * a mask, views, the fused attention. Here one call per layer writes the step's K/V into the
 * cache and attends in place, reading each key and value once for every query head that shares
 * its KV head (grouped-query attention):
 *
 *     for each sequence b and KV head h (split between OpenMP threads):
 *         s[g, t] = (q[b, g] . k[t, h]) * scale      g: the query heads of KV head h
 *         p[g, t] = exp(s[g, t] - max_t s[g, t])     t: the sequence's tokens, block by block
 *         out[b, g] = sum_t p[g, t] v[t, h] / sum_t p[g, t]
 *
 * Every row's result depends only on its own sequence (the same numbers at any batch size).
 * Shapes: q (B, H, d); k_new, v_new (B, KVH, d); the caches (num_blocks, block_size, KVH, d);
 * block_tables (B rows M apart) and seq_lens (B,) int64, seq_lens counting the new token; slots
 * (B,) the new token's slot, or NULL where the K/V is already written (decodes beside a
 * prefill). scores: B * H * T floats of scratch, T >= the longest sequence.
 *
 * Built by cpu_attention.py with `cc -O3 -mavx2 -mfma -fno-math-errno -fopenmp`, called through
 * ctypes.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float hsum(__m256 v) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}

/* s[j] = (q . k_j) * scale for the n <= 4 keys k_j = k + j * stride: four independent chains of
 * multiply-adds, where one key at a time would wait on each add's latency */
static inline void dots(const float *q, const float *k, int64_t stride, int64_t n, int64_t d, float scale, float *s) {
    __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    int64_t i = 0;
    for (; i + 8 <= d; i += 8) {
        __m256 qv = _mm256_loadu_ps(q + i);
        for (int64_t j = 0; j < n; j++) a[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + j * stride + i), a[j]);
    }
    for (int64_t j = 0; j < n; j++) {
        float t = hsum(a[j]);
        for (int64_t r = i; r < d; r++) t += q[r] * k[j * stride + r];
        s[j] = t * scale;
    }
}

/* o += sum_t p[t] v_t over the n keys of one block (v the first, `row` floats apart): o's D values
 * stay in registers for the block (D = 64 or 128: a multiple of 8 the compiler unrolls), so a key
 * costs D / 8 loads and multiply-adds, no stores */
static inline __attribute__((always_inline)) void block_weighted_sum(float *o, const float *p, const float *v,
                                                                    int64_t n, int64_t row, const int D) {
    __m256 acc[D / 8];
    for (int i = 0; i < D / 8; i++) acc[i] = _mm256_loadu_ps(o + 8 * i);
    for (int64_t t = 0; t < n; t++, v += row) {
        __m256 pv = _mm256_set1_ps(p[t]);
        for (int i = 0; i < D / 8; i++) acc[i] = _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + 8 * i), acc[i]);
    }
    for (int i = 0; i < D / 8; i++) _mm256_storeu_ps(o + 8 * i, acc[i]);
}

static void block_weighted_sum_any(float *o, const float *p, const float *v, int64_t n, int64_t row, int64_t d) {
    if (d == 64) return block_weighted_sum(o, p, v, n, row, 64);
    if (d == 128) return block_weighted_sum(o, p, v, n, row, 128);
    for (int64_t t = 0; t < n; t++, v += row)
        for (int64_t i = 0; i < d; i++) o[i] += p[t] * v[i];
}

void paged_decode_attention(const float *q, const float *k_new, const float *v_new, float *k_cache,
                            float *v_cache, const int64_t *slots, const int64_t *block_tables,
                            const int64_t *seq_lens, float *out, float *scores, int64_t B, int64_t H,
                            int64_t KVH, int64_t d, int64_t block_size, int64_t M, int64_t T, float scale) {
    int64_t row = KVH * d;  /* floats per token in a cache */
    for (int64_t b = 0; slots && b < B; b++) {  /* the step's K/V into their slots, if given */
        memcpy(k_cache + slots[b] * row, k_new + b * row, row * sizeof(float));
        memcpy(v_cache + slots[b] * row, v_new + b * row, row * sizeof(float));
    }
    int64_t G = H / KVH;
    #pragma omp parallel for schedule(static) if (B * KVH > 1)
    for (int64_t bh = 0; bh < B * KVH; bh++) {
        int64_t b = bh / KVH, h = bh % KVH, n = seq_lens[b];
        const int64_t *table = block_tables + b * M;
        const float *qb = q + (b * H + h * G) * d;
        float *s = scores + (b * H + h * G) * T, *o = out + (b * H + h * G) * d;
        for (int64_t t0 = 0; t0 < n; t0 += block_size) {   /* block by block: no division per token */
            const float *k = k_cache + table[t0 / block_size] * block_size * row + h * d;
            int64_t end = n < t0 + block_size ? n : t0 + block_size;
            for (int64_t t = t0; t < end; t += 4, k += 4 * row)
                for (int64_t g = 0; g < G; g++) dots(qb + g * d, k, row, end - t < 4 ? end - t : 4, d, scale, s + g * T + t);
        }
        for (int64_t g = 0; g < G; g++) {
            float *sg = s + g * T, top = -INFINITY, sum = 0.f;
            for (int64_t t = 0; t < n; t++) top = fmaxf(top, sg[t]);
            for (int64_t t = 0; t < n; t++) sum += (sg[t] = expf(sg[t] - top));
            float inv = 1.f / sum;
            for (int64_t t = 0; t < n; t++) sg[t] *= inv;
            memset(o + g * d, 0, d * sizeof(float));
        }
        for (int64_t t0 = 0; t0 < n; t0 += block_size) {   /* a block's values, once per query head */
            const float *v = v_cache + table[t0 / block_size] * block_size * row + h * d;
            int64_t m = n - t0 < block_size ? n - t0 : block_size;
            for (int64_t g = 0; g < G; g++) block_weighted_sum_any(o + g * d, s + g * T + t0, v, m, row, d);
        }
    }
}
