/* tinyvllm phase 3: the two kernels of the batch-invariant mode, for any AVX2 CPU.
 *
 * Floating-point addition is not associative: (a + b) + c and a + (b + c) can differ in the last
 * bit. A library matrix product picks its blocking, and so the order of each dot product's
 * additions, from the shape of the whole call: one row of a decode batch and the same row inside
 * a prefill of 200 tokens may come out a bit apart. These two kernels compute every output from
 * its own inputs in one fixed order, whatever else is in the call:
 *
 * - `bi_linear`: y[m, o] = sum_k x[m, k] w[o, k]. Each output sums k in 8 lanes (lane l takes
 *   k = l, l + 8, ...), then the lanes in a fixed tree, then the tail k one by one. Tiles of up
 *   to 4 rows x 3 outputs share loads; a tile's size changes nothing in any output's order.
 * - `bi_attention`: for each query token and head, attention over its own keys 0 .. p (with a
 *   sliding window of W > 0 tokens, p - W + 1 .. p), read in place from the paged cache in
 *   order, with the online softmax of phase 4's kernel: the same code for a prefill token and a
 *   decode token.
 *
 * Built by batch_invariant.py with `cc -O3 -mavx2 -mfma -fopenmp` (no -ffast-math: the compiler
 * must not reorder the additions either), called through ctypes.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

/* the 8 lanes of v, added in one fixed order */
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

#define MT 4  /* rows per tile */
#define NT 3  /* outputs per tile: 4 x 3 sums + 3 weights + 1 row of x = the 16 ymm registers */

/* y[m0 .. m0 + mr, o0 .. o0 + nr) */
static inline __attribute__((always_inline)) void linear_tile(
        const float *x, const float *w, float *y, int64_t O, int64_t K, int64_t m0, int64_t o0,
        int mr, int nr) {
    __m256 acc[MT][NT];
    for (int r = 0; r < MT; r++)
        for (int c = 0; c < NT; c++) acc[r][c] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        __m256 wv[NT];
        for (int c = 0; c < nr; c++) wv[c] = _mm256_loadu_ps(w + (o0 + c) * K + k);
        for (int r = 0; r < mr; r++) {
            __m256 xv = _mm256_loadu_ps(x + (m0 + r) * K + k);
            for (int c = 0; c < nr; c++) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
        }
    }
    for (int r = 0; r < mr; r++)
        for (int c = 0; c < nr; c++) {
            float s = hsum8(acc[r][c]);
            for (int64_t t = k; t < K; t++) s = fmaf(x[(m0 + r) * K + t], w[(o0 + c) * K + t], s);
            y[(m0 + r) * O + o0 + c] = s;
        }
}

/* x (M, K), w (O, K), bias (O,) or NULL -> y (M, O), all float32 */
void bi_linear(const float *x, const float *w, const float *bias, float *y, int64_t M, int64_t O, int64_t K) {
    int64_t tiles_o = (O + NT - 1) / NT, tiles_m = (M + MT - 1) / MT;
    #pragma omp parallel for collapse(2) schedule(static) if (M * O * K >= 100000)
    for (int64_t to = 0; to < tiles_o; to++)
        for (int64_t tm = 0; tm < tiles_m; tm++) {
            int64_t o0 = to * NT, m0 = tm * MT;
            int nr = O - o0 < NT ? (int)(O - o0) : NT, mr = M - m0 < MT ? (int)(M - m0) : MT;
            if (mr == MT && nr == NT) linear_tile(x, w, y, O, K, m0, o0, MT, NT);
            else linear_tile(x, w, y, O, K, m0, o0, mr, nr);
            if (bias)
                for (int r = 0; r < mr; r++)
                    for (int c = 0; c < nr; c++) y[(m0 + r) * O + o0 + c] += bias[o0 + c];
        }
}

/* q (N, H, D); k_cache, v_cache (num_blocks, block_size, KVH, D); block_tables (B, max_blocks);
 * token_seq (N,): each token's row of block_tables; token_pos (N,): its position p (it attends
 * to keys 0 .. p); out (N, H, D). D a multiple of 8, at most 256. */
void bi_attention(const float *q, const float *k_cache, const float *v_cache, float *out,
                  const int64_t *block_tables, const int64_t *token_seq, const int64_t *token_pos,
                  int64_t N, int64_t H, int64_t KVH, int64_t D, int64_t block_size, int64_t max_blocks,
                  int64_t window, float scale) {
    const int64_t group = H / KVH, row = KVH * D, nd = D / 8;
    #pragma omp parallel for collapse(2) schedule(static) if (N * H >= 8)
    for (int64_t n = 0; n < N; n++)
        for (int64_t h = 0; h < H; h++) {
            const float *qh = q + (n * H + h) * D;
            const int64_t *table = block_tables + token_seq[n] * max_blocks, kvh = h / group;
            __m256 acc[32];                       /* the output row, D / 8 vectors */
            for (int64_t i = 0; i < nd; i++) acc[i] = _mm256_setzero_ps();
            float m = -INFINITY, l = 0.f;         /* running max and sum of exp */
            int64_t first = window > 0 && token_pos[n] >= window ? token_pos[n] - window + 1 : 0;
            for (int64_t j = first; j <= token_pos[n]; j++) {
                int64_t slot = table[j / block_size] * block_size + j % block_size;
                const float *kj = k_cache + slot * row + kvh * D, *vj = v_cache + slot * row + kvh * D;
                __m256 d8 = _mm256_setzero_ps();
                for (int64_t i = 0; i < nd; i++)
                    d8 = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 8 * i), _mm256_loadu_ps(kj + 8 * i), d8);
                float s = hsum8(d8) * scale;
                float m_new = s > m ? s : m;
                float c = expf(m - m_new), p = expf(s - m_new);  /* rescale the old, weigh the new */
                l = l * c + p;
                __m256 cv = _mm256_set1_ps(c), pv = _mm256_set1_ps(p);
                for (int64_t i = 0; i < nd; i++)
                    acc[i] = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vj + 8 * i), _mm256_mul_ps(acc[i], cv));
                m = m_new;
            }
            __m256 inv = _mm256_set1_ps(1.f / l);
            for (int64_t i = 0; i < nd; i++) _mm256_storeu_ps(out + (n * H + h) * D + 8 * i, _mm256_mul_ps(acc[i], inv));
        }
}
