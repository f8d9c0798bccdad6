/* tinyvllm phase 4: a decode step's attention over the paged float32 cache, for x86 CPUs with AVX2
 * (and, at the end of the file, a prefill chunk's).
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
 * A sequence longer than SEG_TOKENS keys is attended in segments, one task each (split-KV: one
 * sequence of a few KV heads would otherwise leave threads idle), each leaving its max and sums
 * for a merge, as the Triton kernel's segments do for merge_attn_states. At batch 1 each query
 * head is a task of its own, so that three KV heads keep two threads busy.
 *
 * In AVX2 registers of 8 floats: the scores of 8 keys at a time (dots8), the exponentials 8 at a
 * time (exp8), the output's d values held in registers while a block's values are added
 * (block_weighted_sum); the sums divide the output once, at the end.
 *
 * Every row's result depends only on its own sequence (the same numbers at any batch size).
 * Shapes: q (B, H, d); k_new, v_new (B, KVH, d); the caches (num_blocks, block_size, KVH, d);
 * block_tables (B rows M apart) and seq_lens (B,) int64, seq_lens counting the new token; slots
 * (B,) the new token's slot, or NULL where the K/V is already written (decodes beside a
 * prefill). scores: B * H * T floats of scratch, T >= the longest sequence.
 *
 * Built by cpu_attention.py with `cc -O3 -mavx2 -mfma -fno-math-errno -fopenmp -DFETCH_AHEAD=0|1`,
 * called through ctypes.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* keys per task at most (rounded up to whole blocks): see paged_decode_attention */
#define SEG_TOKENS 512

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

/* s[j] = (q . k_j) * scale for the 8 keys k_j = k + j * stride (d a multiple of 8): eight chains,
 * then their lanes summed together, three rounds of pairwise adds (hadd) for all eight, where
 * dots() sums each key's lanes on its own */
static inline __m256 dots8(const float *q, const float *k, int64_t stride, int64_t d, __m256 scale) {
    __m256 a[8];
    for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 8) {
        __m256 qv = _mm256_loadu_ps(q + i);
        for (int j = 0; j < 8; j++) a[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + j * stride + i), a[j]);
    }
    __m256 s0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));  /* keys 0-3, per half */
    __m256 s1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));  /* keys 4-7 */
    __m256 sum = _mm256_add_ps(_mm256_permute2f128_ps(s0, s1, 0x20), _mm256_permute2f128_ps(s0, s1, 0x31));
    return _mm256_mul_ps(sum, scale);
}

/* exp(x) for 8 floats at once (Cephes' expf: x = n ln 2 + r, |r| <= ln 2 / 2, e^r by a polynomial
 * of degree 7, 2^n written into the exponent bits; about 1e-7 relative error). Here x <= 0 (a
 * score minus the row's max); below -87.3 it returns e^-87.3 (~1e-38) instead of less, which no
 * sum of at least 1 can tell from 0. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);     /* ln 2 in two parts */
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

/* p[t] = exp(s[t] - max_t s) over the n scores, in place; returns sum_t p[t], and the max in *top_out */
static float softmax_numerators(float *s, int64_t n, float *top_out) {
    __m256 m8 = _mm256_set1_ps(-INFINITY);
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) m8 = _mm256_max_ps(m8, _mm256_loadu_ps(s + t));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    float top = fmaxf(_mm_cvtss_f32(m4), _mm_cvtss_f32(_mm_movehdup_ps(m4)));
    for (; t < n; t++) top = fmaxf(top, s[t]);
    __m256 top8 = _mm256_set1_ps(top), sum8 = _mm256_setzero_ps();
    for (t = 0; t + 8 <= n; t += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), top8));
        _mm256_storeu_ps(s + t, e);
        sum8 = _mm256_add_ps(sum8, e);
    }
    float sum = hsum(sum8);
    for (; t < n; t++) sum += (s[t] = expf(s[t] - top));
    *top_out = top;
    return sum;
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

/* FETCH_AHEAD (-DFETCH_AHEAD=1, the platform's `decode_fetch_ahead` rule): while a block is read, the
 * next one's lines (this head's d floats of each of its tokens) are asked of memory ahead. A block's
 * tokens lie in one place but the blocks of a sequence anywhere (the block table), so the CPU's own
 * prefetcher cannot guess the next; without this a task waits on memory at each block. */
#ifndef FETCH_AHEAD
#define FETCH_AHEAD 0
#endif
static inline void fetch_block(const float *p, int64_t row, int64_t left, int64_t block_size, int64_t d) {
    for (int64_t t = 0; t < (left < block_size ? left : block_size); t++)
        for (int64_t i = 0; i < d; i += 16) _mm_prefetch((const char *)(p + t * row + i), _MM_HINT_T0);
}

/* starts: each row's first visible key (a layer's sliding window: seq_len - window, at least 0), or
 * NULL for every key. A row reads from the block holding its first key; that block's keys before
 * it score -inf (a softmax weight of 0), and the segments wholly before it are skipped. */
static void decode_attention_from(const float *q, const float *k_new, const float *v_new, float *k_cache,
                                  float *v_cache, const int64_t *slots, const int64_t *block_tables,
                                  const int64_t *seq_lens, const int64_t *starts, float *out, float *scores,
                                  int64_t B, int64_t H, int64_t KVH, int64_t d, int64_t block_size, int64_t M,
                                  int64_t T, float scale) {
    int64_t row = KVH * d;  /* floats per token in a cache */
    for (int64_t b = 0; slots && b < B; b++) {  /* the step's K/V into their slots, if given */
        memcpy(k_cache + slots[b] * row, k_new + b * row, row * sizeof(float));
        memcpy(v_cache + slots[b] * row, v_new + b * row, row * sizeof(float));
    }
    /* tasks: (sequence, KV head, segment of `seg` keys). A long sequence's keys are split between
     * threads (split-KV, as the Triton kernel's segments) at the same places at any batch size, so
     * a row's numbers never depend on its batch; a sequence of one segment writes its output at
     * once, the others leave each segment's sums for the merge below */
    int64_t G = H / KVH, seg = (SEG_TOKENS + block_size - 1) / block_size * block_size;
    int64_t S = (T + seg - 1) / seg, part_len = G * (d + 2);   /* a part: (G, d) sums, G maxima, G sums of p */
    float *parts = S > 1 ? malloc(B * KVH * S * part_len * sizeof(float)) : NULL;
    if (S > 1 && !parts)   /* no memory for the parts: each sequence in one task, as before splitting */
        seg = (T + block_size - 1) / block_size * block_size, S = 1;
    /* One sequence (batch 1): each query head of a group is a task of its own, reading its KV
     * head's keys apart, so that a few KV heads or segments of unequal length do not leave a
     * thread waiting (measured, lab note 4). A head's numbers are the same either way. */
    int64_t P = B == 1 ? G : 1, Gp = G / P;
    #pragma omp parallel for schedule(static) if (B * KVH * S * P > 1)
    for (int64_t task = 0; task < B * KVH * S * P; task++) {
        int64_t part = task / P, bh = part / S, b = bh / KVH, h = bh % KVH, n = seq_lens[b];
        int64_t lo = part % S * seg, hi = n < lo + seg ? n : lo + seg, g0 = task % P * Gp, g1 = g0 + Gp;
        int64_t first = starts ? starts[b] : 0, from = first / block_size * block_size;
        if (lo >= n || hi <= from)
            continue;
        if (lo < from)   /* the segment holding the window's first key: from that key's block */
            lo = from;
        const int64_t *table = block_tables + b * M;
        const float *qb = q + (b * H + h * G) * d;
        float *s = scores + (b * H + h * G) * T, *o = n <= seg ? out + (b * H + h * G) * d : parts + part * part_len;
        __m256 scale8 = _mm256_set1_ps(scale);
        for (int64_t t0 = lo; t0 < hi; t0 += block_size) {   /* block by block: no division per token */
            const float *k = k_cache + table[t0 / block_size] * block_size * row + h * d;
            int64_t end = hi < t0 + block_size ? hi : t0 + block_size, t = t0;
            if (FETCH_AHEAD)   /* the next block's keys, or after the last the first block's values */
                fetch_block(end < hi ? k_cache + table[end / block_size] * block_size * row + h * d
                                     : v_cache + table[lo / block_size] * block_size * row + h * d,
                            row, end < hi ? hi - end : hi - lo, block_size, d);
            if (d % 8 == 0)
                for (; t + 8 <= end; t += 8, k += 8 * row)
                    for (int64_t g = g0; g < g1; g++) _mm256_storeu_ps(s + g * T + t, dots8(qb + g * d, k, row, d, scale8));
            for (; t < end; t += 4, k += 4 * row)
                for (int64_t g = g0; g < g1; g++) dots(qb + g * d, k, row, end - t < 4 ? end - t : 4, d, scale, s + g * T + t);
        }
        for (int64_t t = lo; t < first; t++)   /* the first block's keys before the window */
            for (int64_t g = g0; g < g1; g++) s[g * T + t] = -INFINITY;
        float top[G], sum[G];   /* the softmax's numerators in place of the scores; the sums divide at the end */
        for (int64_t g = g0; g < g1; g++) {
            sum[g] = softmax_numerators(s + g * T + lo, hi - lo, &top[g]);
            memset(o + g * d, 0, d * sizeof(float));
        }
        for (int64_t t0 = lo; t0 < hi; t0 += block_size) {   /* a block's values, once per query head */
            const float *v = v_cache + table[t0 / block_size] * block_size * row + h * d;
            int64_t m = hi - t0 < block_size ? hi - t0 : block_size;
            if (FETCH_AHEAD && t0 + m < hi)
                fetch_block(v_cache + table[(t0 + m) / block_size] * block_size * row + h * d, row, hi - t0 - m,
                            block_size, d);
            for (int64_t g = g0; g < g1; g++) block_weighted_sum_any(o + g * d, s + g * T + t0, v, m, row, d);
        }
        for (int64_t g = g0; g < g1; g++) {
            if (n <= seg)
                for (int64_t i = 0; i < d; i++) o[g * d + i] /= sum[g];
            else
                o[G * d + g] = top[g], o[G * d + G + g] = sum[g];
        }
    }
    if (!parts)
        return;
    /* the merge: segment j weighs exp(max_j - max), as merge_attn_states weighs the Triton segments */
    #pragma omp parallel for schedule(static)
    for (int64_t bh = 0; bh < B * KVH; bh++) {
        int64_t b = bh / KVH, h = bh % KVH, n = seq_lens[b], nseg = (n + seg - 1) / seg;
        int64_t j0 = starts ? starts[b] / block_size * block_size / seg : 0;   /* the segments read */
        if (n <= seg)
            continue;
        const float *part = parts + bh * S * part_len;
        for (int64_t g = 0; g < G; g++) {
            float *o = out + (b * H + h * G + g) * d, top = -INFINITY, den = 0.f;
            for (int64_t j = j0; j < nseg; j++) top = fmaxf(top, part[j * part_len + G * d + g]);
            memset(o, 0, d * sizeof(float));
            for (int64_t j = j0; j < nseg; j++) {
                float w = expf(part[j * part_len + G * d + g] - top);
                den += w * part[j * part_len + G * d + G + g];
                for (int64_t i = 0; i < d; i++) o[i] += w * part[j * part_len + g * d + i];
            }
            for (int64_t i = 0; i < d; i++) o[i] /= den;
        }
    }
    free(parts);
}

void paged_decode_attention(const float *q, const float *k_new, const float *v_new, float *k_cache,
                            float *v_cache, const int64_t *slots, const int64_t *block_tables,
                            const int64_t *seq_lens, float *out, float *scores, int64_t B, int64_t H,
                            int64_t KVH, int64_t d, int64_t block_size, int64_t M, int64_t T, float scale) {
    decode_attention_from(q, k_new, v_new, k_cache, v_cache, slots, block_tables, seq_lens, NULL, out, scores,
                          B, H, KVH, d, block_size, M, T, scale);
}

/* the same, each row b seeing its keys from starts[b] on (a sliding window) */
void paged_window_decode_attention(const float *q, const float *k_new, const float *v_new, float *k_cache,
                                   float *v_cache, const int64_t *slots, const int64_t *block_tables,
                                   const int64_t *seq_lens, const int64_t *starts, float *out, float *scores,
                                   int64_t B, int64_t H, int64_t KVH, int64_t d, int64_t block_size, int64_t M,
                                   int64_t T, float scale) {
    decode_attention_from(q, k_new, v_new, k_cache, v_cache, slots, block_tables, seq_lens, starts, out, scores,
                          B, H, KVH, d, block_size, M, T, scale);
}

/* ---- A prefill chunk: Tq queries, the last Tq of Tk keys, causal (lower-right) ----
 *
 * The same flash-attention loop as the Triton kernel's (and as SDPA's CPU kernel): a task is one
 * KV head and PREFILL_ROWS query rows (BQ tokens x the G query heads sharing that KV head, so
 * each key tile is read once for all of them); it walks the key tiles of PREFILL_KEYS keys up to
 * its last query's position, keeping each row's running max, sum and output (online softmax):
 *
 *     s = q k^T * scale                  (rows, keys)   scores_6x16, six rows by 16 keys at a time
 *     top = max(max_row, max_t s);  alpha = exp(max_row - top)
 *     p = exp(s - top), 0 past the row's own position;   sum = sum * alpha + sum_t p
 *     o = o * alpha + p v                (rows, d)      values_6x16, six rows by 16 of d at a time
 *
 * and divides by the sums at the end. Both products are register tiles of 6 x 16 floats (12 AVX2
 * registers of sums): a key's 16 floats are loaded once for six rows, a query's float broadcast
 * once for 16 keys. So the keys are first laid out transposed, tile by tile ((KVH, tiles, d,
 * PREFILL_KEYS) in kt, which the caller allocates): row i of a tile holds dimension i of its keys.
 * A row's numbers depend on its own query and keys only, with tiles that start at key 0 whatever
 * the chunk: the same at any chunking of a prompt.
 *
 * q: rows of qs floats, each (H, d); k, v: rows of ks, vs floats, each (KVH, d); out: rows of os
 * floats, each (H, d). d a multiple of 16. */
#define PREFILL_KEYS 64   /* keys per tile */
#define PREFILL_ROWS 48   /* query rows per task, about: BQ = PREFILL_ROWS / G tokens */

/* s[r][0..16) = qp_r . kt[:, 0..16) for the 6 rows r of qp (d floats each), kt a tile's columns:
 * the 12 sums named one by one (GCC keeps an array of them in memory) */
#define QK2(r) a##r##0 = _mm256_fmadd_ps(x = _mm256_broadcast_ss(qp + r * d + i), k0, a##r##0), \
               a##r##1 = _mm256_fmadd_ps(x, k1, a##r##1)
#define STORE2(r, dst, ld) _mm256_storeu_ps(dst + r * ld, a##r##0), _mm256_storeu_ps(dst + r * ld + 8, a##r##1)
static inline void scores_6x16(const float *qp, int64_t d, const float *kt, float *s) {
    __m256 x, a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00,
           a31 = a00, a40 = a00, a41 = a00, a50 = a00, a51 = a00;
    for (int64_t i = 0; i < d; i++, kt += PREFILL_KEYS) {
        __m256 k0 = _mm256_loadu_ps(kt), k1 = _mm256_loadu_ps(kt + 8);
        QK2(0); QK2(1); QK2(2); QK2(3); QK2(4); QK2(5);
    }
    STORE2(0, s, PREFILL_KEYS); STORE2(1, s, PREFILL_KEYS); STORE2(2, s, PREFILL_KEYS);
    STORE2(3, s, PREFILL_KEYS); STORE2(4, s, PREFILL_KEYS); STORE2(5, s, PREFILL_KEYS);
}

/* o[r][0..16) += sum_j p[r][j] v_j[0..16) for 6 rows r (d floats apart) and the n keys v_j = v + j * vs */
#define PV2(r) a##r##0 = _mm256_fmadd_ps(x = _mm256_broadcast_ss(p + r * PREFILL_KEYS + j), v0, a##r##0), \
               a##r##1 = _mm256_fmadd_ps(x, v1, a##r##1)
#define LOAD2(r) __m256 a##r##0 = _mm256_loadu_ps(o + r * d), a##r##1 = _mm256_loadu_ps(o + r * d + 8)
static inline void values_6x16(const float *p, const float *v, int64_t vs, int64_t n, float *o, int64_t d) {
    __m256 x;
    LOAD2(0); LOAD2(1); LOAD2(2); LOAD2(3); LOAD2(4); LOAD2(5);
    for (int64_t j = 0; j < n; j++, v += vs) {
        __m256 v0 = _mm256_loadu_ps(v), v1 = _mm256_loadu_ps(v + 8);
        PV2(0); PV2(1); PV2(2); PV2(3); PV2(4); PV2(5);
    }
    STORE2(0, o, d); STORE2(1, o, d); STORE2(2, o, d); STORE2(3, o, d); STORE2(4, o, d); STORE2(5, o, d);
}

/* the online softmax of one row's tile of scores s, of which the first `see` count (0 < see):
 * p = exp(s - top) in place, 0 past `see`; the row's max and sum updated; returns alpha, the
 * factor its output so far takes */
static inline float tile_softmax(float *s, int64_t see, float *top_io, float *sum_io) {
    for (int64_t j = see; j < PREFILL_KEYS; j++) s[j] = -INFINITY;
    __m256 m8 = _mm256_loadu_ps(s);
    for (int64_t j = 8; j < PREFILL_KEYS; j += 8) m8 = _mm256_max_ps(m8, _mm256_loadu_ps(s + j));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    float top = fmaxf(*top_io, fmaxf(_mm_cvtss_f32(m4), _mm_cvtss_f32(_mm_movehdup_ps(m4))));
    float alpha = top == *top_io ? 1.f : _mm256_cvtss_f32(exp8(_mm256_set1_ps(*top_io - top)));
    __m256 top8 = _mm256_set1_ps(top), acc = _mm256_setzero_ps();
    for (int64_t j = 0; j < PREFILL_KEYS; j += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), top8));
        if (see < j + 8)   /* keys past the row's own position weigh nothing (exp8 stops at ~1e-38) */
            e = _mm256_and_ps(e, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)(see - j)),
                                                                       _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))));
        _mm256_storeu_ps(s + j, e);
        acc = _mm256_add_ps(acc, e);
    }
    *top_io = top;
    *sum_io = *sum_io * alpha + hsum(acc);
    return alpha;
}

/* one row's tile of scores s made probabilities (tile_softmax) and the row's output so far, o (d
 * floats), rescaled to its new max; a row that sees none of the tile's keys (see <= 0) gets zeros */
static inline void tile_row(float *s, int64_t see, int64_t n, float *top, float *sum, float *o, int64_t d) {
    if (see <= 0) {
        memset(s, 0, PREFILL_KEYS * sizeof(float));
        return;
    }
    __m256 alpha = _mm256_set1_ps(tile_softmax(s, see < n ? see : n, top, sum));
    for (int64_t i = 0; _mm256_cvtss_f32(alpha) != 1.f && i < d; i += 8)
        _mm256_storeu_ps(o + i, _mm256_mul_ps(alpha, _mm256_loadu_ps(o + i)));
}

void causal_prefill_attention(const float *q, const float *k, const float *v, float *out, float *kt, int64_t Tq,
                              int64_t Tk, int64_t H, int64_t KVH, int64_t d, int64_t qs, int64_t ks, int64_t vs,
                              int64_t os, float scale) {
    const int64_t BK = PREFILL_KEYS;
    int64_t G = H / KVH, BQ = PREFILL_ROWS / G > 0 ? PREFILL_ROWS / G : 1, M = (BQ * G + 5) / 6 * 6;
    int64_t tiles = (Tk + BK - 1) / BK, tasks = KVH * ((Tq + BQ - 1) / BQ), past = Tk - Tq;
    #pragma omp parallel
    {
        #pragma omp for schedule(static)
        for (int64_t ht = 0; ht < KVH * tiles; ht++) {   /* kt: each tile of keys transposed, zeros past Tk */
            float *t = kt + ht * d * BK;
            for (int64_t j = 0, key = ht % tiles * BK; j < BK; j++, key++)
                for (int64_t i = 0; i < d; i++) t[i * BK + j] = key < Tk ? k[key * ks + ht / tiles * d + i] : 0.f;
        }
        /* a task's rows: r = token * G + head; M rows, a multiple of 6 (the rows past BQ * G are zeros) */
        float qp[M * d], o[M * d], s[M * BK], top[M], sum[M];
        #pragma omp for schedule(dynamic, 1)
        for (int64_t task = tasks - 1; task >= 0; task--) {   /* the longest tasks (the last queries') first */
            int64_t h = task % KVH, t0 = task / KVH * BQ, t1 = t0 + BQ < Tq ? t0 + BQ : Tq, rows = (t1 - t0) * G;
            memset(qp, 0, sizeof(qp));
            memset(o, 0, sizeof(o));
            for (int64_t r = 0; r < M; r++) {
                for (int64_t i = 0; r < rows && i < d; i++)
                    qp[r * d + i] = q[(t0 + r / G) * qs + (h * G + r % G) * d + i] * scale;
                top[r] = -INFINITY, sum[r] = 0.f;
            }
            int64_t last = past + t1 - 1;   /* the last query's position: it sees keys 0 .. last */
            for (int64_t b = 0; b * BK <= last; b++) {
                int64_t j0 = b * BK, n = last + 1 - j0 < BK ? last + 1 - j0 : BK;
                const float *tile = kt + (h * tiles + b) * d * BK;
                for (int64_t r = 0; r < M; r += 6)
                    for (int64_t c = 0; c < BK; c += 16) scores_6x16(qp + r * d, d, tile + c, s + r * BK + c);
                for (int64_t r = 0; r < M; r++)   /* row r sees this tile's first `see` keys */
                    tile_row(s + r * BK, r < rows ? past + t0 + r / G + 1 - j0 : 0, n, top + r, sum + r, o + r * d, d);
                for (int64_t r = 0; r < M; r += 6)
                    for (int64_t c = 0; c < d; c += 16)
                        values_6x16(s + r * BK, v + j0 * vs + h * d + c, vs, n, o + r * d + c, d);
            }
            for (int64_t r = 0; r < rows; r++) {
                float *dst = out + (t0 + r / G) * os + (h * G + r % G) * d, inv = 1.f / sum[r];
                for (int64_t i = 0; i < d; i++) dst[i] = o[r * d + i] * inv;
            }
        }
    }
}

/* ---- The same prefill with bfloat16 products, on a CPU that multiplies bfloat16 (AVX512-BF16) ----
 *
 * The loop above, its two register tiles made of VDPBF16PS: one instruction takes 16 pairs of
 * bfloat16 from each operand and adds each pair's two products to one of 16 float32 sums, so a
 * tile does twice the multiply-adds of a float32 FMA in the same time. The pairs run along the
 * sum's index: for the scores two dimensions of d (a query's pair broadcast, 16 keys' pairs in a
 * register), for the values two keys (a row's two probabilities broadcast, 16 dimensions' pairs).
 * So the keys are laid out per tile as (d / 2, PREFILL_KEYS) pairs, the values as
 * (PREFILL_KEYS / 2, d) pairs, both rounded to bfloat16 once per call; the scaled queries and
 * each tile's probabilities p are rounded as they are made. The maxima, the sums and the output
 * stay float32 (the online softmax above, unchanged). */
#if (defined(__clang__) && __clang_major__ >= 9) || (!defined(__clang__) && __GNUC__ >= 10)
/* a compiler that knows AVX512-BF16 (GCC 10, clang 9 on); with an older one the rest of this file
 * still builds, and `bf16_prefill_built` says 0 (cpu_attention.py then never calls the stub) */
const int bf16_prefill_built = 1;
#define BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")))

/* x (n floats, n a multiple of 16) to bfloat16, rounded to nearest even, into y */
BF16_TARGET static inline void to_bf16(const float *x, int64_t n, uint16_t *y) {
    for (int64_t i = 0; i < n; i += 16)
        _mm256_storeu_si256((__m256i *)(y + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i)));
}

#define DP2(r) b##r##0 = _mm512_dpbf16_ps(b##r##0, x0, y = (__m512bh)_mm512_set1_epi32(a[r * la])), \
               b##r##1 = _mm512_dpbf16_ps(b##r##1, x1, y)
#define ZERO2(r) __m512 b##r##0 = _mm512_setzero_ps(), b##r##1 = b##r##0
#define STOREZ2(r) _mm512_storeu_ps(c + r * lc, b##r##0), _mm512_storeu_ps(c + r * lc + 16, b##r##1)
/* c[r][0..32) (+)= sum_i a[r][i] . x[i][0..32) for 6 rows r: a's rows `la` pairs apart, x's rows
 * `lx` pairs apart, c's rows `lc` floats apart; n pairs; `add`: onto c (else c is overwritten) */
BF16_TARGET static inline void tile_6x32_bf16(const uint32_t *a, int64_t la, const uint32_t *x, int64_t lx,
                                              int64_t n, float *c, int64_t lc, int add) {
    __m512bh y;
    ZERO2(0); ZERO2(1); ZERO2(2); ZERO2(3); ZERO2(4); ZERO2(5);
    if (add) {
        b00 = _mm512_loadu_ps(c), b01 = _mm512_loadu_ps(c + 16), b10 = _mm512_loadu_ps(c + lc), b11 = _mm512_loadu_ps(c + lc + 16);
        b20 = _mm512_loadu_ps(c + 2 * lc), b21 = _mm512_loadu_ps(c + 2 * lc + 16);
        b30 = _mm512_loadu_ps(c + 3 * lc), b31 = _mm512_loadu_ps(c + 3 * lc + 16);
        b40 = _mm512_loadu_ps(c + 4 * lc), b41 = _mm512_loadu_ps(c + 4 * lc + 16);
        b50 = _mm512_loadu_ps(c + 5 * lc), b51 = _mm512_loadu_ps(c + 5 * lc + 16);
    }
    for (int64_t i = 0; i < n; i++, a++, x += lx) {
        __m512bh x0 = (__m512bh)_mm512_loadu_si512(x), x1 = (__m512bh)_mm512_loadu_si512(x + 16);
        DP2(0); DP2(1); DP2(2); DP2(3); DP2(4); DP2(5);
    }
    STOREZ2(0); STOREZ2(1); STOREZ2(2); STOREZ2(3); STOREZ2(4); STOREZ2(5);
}

/* causal_prefill_attention's arguments, with kt and vt scratch for the keys' and values' pairs
 * (KVH * ceil(Tk / PREFILL_KEYS) * PREFILL_KEYS * d / 2 each); d a multiple of 32 */
BF16_TARGET void causal_prefill_attention_bf16(const float *q, const float *k, const float *v, float *out,
                                               uint32_t *kt, uint32_t *vt, int64_t Tq, int64_t Tk, int64_t H,
                                               int64_t KVH, int64_t d, int64_t qs, int64_t ks, int64_t vs,
                                               int64_t os, float scale) {
    const int64_t BK = PREFILL_KEYS, d2 = d / 2;
    int64_t G = H / KVH, BQ = PREFILL_ROWS / G > 0 ? PREFILL_ROWS / G : 1, M = (BQ * G + 5) / 6 * 6;
    int64_t tiles = (Tk + BK - 1) / BK, tasks = KVH * ((Tq + BQ - 1) / BQ), past = Tk - Tq;
    #pragma omp parallel
    {
        uint16_t ka[d], kb[d];
        #pragma omp for schedule(static)
        for (int64_t ht = 0; ht < KVH * tiles; ht++) {   /* a tile's pairs: kt (d/2, BK), vt (BK/2, d); zeros past Tk */
            uint32_t *kp = kt + ht * d2 * BK, *vp = vt + ht * d2 * BK;
            int64_t h = ht / tiles, key0 = ht % tiles * BK;
            for (int64_t j = 0; j < BK; j += 2) {
                for (int64_t e = 0; e < 2; e++) {
                    uint16_t *y = e ? kb : ka;
                    if (key0 + j + e < Tk) to_bf16(k + (key0 + j + e) * ks + h * d, d, y);
                    else memset(y, 0, sizeof(ka));
                    for (int64_t i = 0; i < d2; i++) kp[i * BK + j + e] = y[2 * i] | (uint32_t)y[2 * i + 1] << 16;
                }
                if (key0 + j < Tk) to_bf16(v + (key0 + j) * vs + h * d, d, ka); else memset(ka, 0, sizeof(ka));
                if (key0 + j + 1 < Tk) to_bf16(v + (key0 + j + 1) * vs + h * d, d, kb); else memset(kb, 0, sizeof(kb));
                for (int64_t i = 0; i < d; i++) vp[j / 2 * d + i] = ka[i] | (uint32_t)kb[i] << 16;
            }
        }
        float qf[d], o[M * d], s[M * BK], top[M], sum[M];
        uint32_t qp[M * d2], p[M * BK / 2];
        #pragma omp for schedule(dynamic, 1)
        for (int64_t task = tasks - 1; task >= 0; task--) {   /* the longest tasks (the last queries') first */
            int64_t h = task % KVH, t0 = task / KVH * BQ, t1 = t0 + BQ < Tq ? t0 + BQ : Tq, rows = (t1 - t0) * G;
            memset(o, 0, sizeof(o));
            for (int64_t r = 0; r < M; r++) {   /* the scaled queries in bfloat16, zeros past `rows` */
                for (int64_t i = 0; i < d; i++) qf[i] = r < rows ? q[(t0 + r / G) * qs + (h * G + r % G) * d + i] * scale : 0.f;
                to_bf16(qf, d, (uint16_t *)(qp + r * d2));
                top[r] = -INFINITY, sum[r] = 0.f;
            }
            int64_t last = past + t1 - 1;   /* the last query's position: it sees keys 0 .. last */
            for (int64_t b = 0; b * BK <= last; b++) {
                int64_t j0 = b * BK, n = last + 1 - j0 < BK ? last + 1 - j0 : BK;
                const uint32_t *ktile = kt + (h * tiles + b) * d2 * BK, *vtile = vt + (h * tiles + b) * d2 * BK;
                for (int64_t r = 0; r < M; r += 6)
                    for (int64_t c = 0; c < BK; c += 32) tile_6x32_bf16(qp + r * d2, d2, ktile + c, BK, d2, s + r * BK + c, BK, 0);
                for (int64_t r = 0; r < M; r++) {   /* the probabilities, then in bfloat16 */
                    tile_row(s + r * BK, r < rows ? past + t0 + r / G + 1 - j0 : 0, n, top + r, sum + r, o + r * d, d);
                    to_bf16(s + r * BK, BK, (uint16_t *)(p + r * BK / 2));
                }
                for (int64_t r = 0; r < M; r += 6)
                    for (int64_t c = 0; c < d; c += 32) tile_6x32_bf16(p + r * BK / 2, BK / 2, vtile + c, d, (n + 1) / 2, o + r * d + c, d, 1);
            }
            for (int64_t r = 0; r < rows; r++) {
                float *dst = out + (t0 + r / G) * os + (h * G + r % G) * d, inv = 1.f / sum[r];
                for (int64_t i = 0; i < d; i++) dst[i] = o[r * d + i] * inv;
            }
        }
    }
}
#else
const int bf16_prefill_built = 0;
void causal_prefill_attention_bf16(const float *q, const float *k, const float *v, float *out, uint32_t *kt,
                                   uint32_t *vt, int64_t Tq, int64_t Tk, int64_t H, int64_t KVH, int64_t d,
                                   int64_t qs, int64_t ks, int64_t vs, int64_t os, float scale) {
    abort();
}
#endif
