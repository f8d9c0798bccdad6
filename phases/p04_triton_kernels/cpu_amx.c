/* tinyvllm: a float32 model's bfloat16 products at decode rows, on AMX tiles (Intel Xeon, `amx` kind);
 * after them, the SiLU and product of a prompt's bfloat16 MLP (silu_and_mul) and a prompt's
 * causal attention on the tiles (amx_attention).
 *
 * `dtype="auto"` runs a float32 model's products of many rows in bfloat16 (the platform's
 * `bf16_products_from_rows`). oneDNN does that on AMX tiles too, but at a decode step's few rows its
 * product is bound by reading the weights, and it reads them at about 10 GB/s on a 2-core Xeon
 * VM where the VM gives 17: this file reads them in one pass, in the order they lie.
 *
 * AMX: eight tile registers of 16 rows x 64 bytes; TDPBF16PS multiplies a 16 x 32 bfloat16 tile
 * (A: 16 rows of x, 32 of their inputs) by a tile of 16 pairs x 16 outputs (B: the weight, each
 * pair two inputs of one output, "VNNI" order) into 16 x 16 float32 sums (C). Here C is up to four
 * tiles (64 rows), A one tile loaded per C tile from the rows rounded to bfloat16, B one tile, so a
 * B tile of the weight is read once per step, for every row.
 *
 * The weight comes as bfloat16 B tiles, [N/16][K/32][16 pairs][16][2] (cpu_amx.py's
 * `amx_packed`: PyTorch's rounding, then a permute): an output block's tiles one after the other,
 * so a thread streams its share of the weight from start to end. amx_linear: y (M, N) = x (M, K) @ W^T (+ bias), float32 in and out, M <= 64 per
 * pass over the weight (more rows: another pass), N a multiple of 16, K of 32. A process must ask
 * Linux for the tile state once (amx_permit: 0 when granted). */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <omp.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

int amx_permit(void) { return (int)syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); }

/* this thread's first `n` tile registers as 16 rows of 64 bytes each */
static void configure_tiles(int n) {
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < n; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* rows m0.. of x rounded to bfloat16 into xb (16 * tiles rows of k), rows past m zero */
static void round_rows(const float *x, uint16_t *xb, int64_t m0, int64_t m, int64_t tiles, int64_t k) {
    for (int64_t i = 0; i < 16 * tiles; i++)
        for (int64_t c = 0; c < k; c += 16) {
            __m512 v = m0 + i < m ? _mm512_loadu_ps(x + (m0 + i) * k + c) : _mm512_setzero_ps();
            _mm256_storeu_si256((__m256i *)(xb + i * k + c), (__m256i)_mm512_cvtneps_pbh(v));
        }
}

/* The rows' tiles are read again for every 16 outputs: a chunk of the inputs at a time (CHUNK_KB KB of
 * them over the rows' tiles: in the core's L1 cache) for a group of GROUP output blocks, whose C tiles
 * wait in `parts` between chunks (the same sums in the same order). */
#define CHUNK_KB 24
#define GROUP 16
/* C tile t += the t-th 16 rows of xb against the B tile in register 5 (tile numbers must be constants) */
#define DOT(t) { _tile_loadd(4, xb + (t) * 16 * k + kb * 32, k * 2); _tile_dpbf16ps(t, 4, 5); }
#define STORE(t) { _tile_stored(t, sums, 64); put(sums, y, bias, m0 + (t) * 16, m, nb, n); }

static void put(const float *sums, float *y, const float *bias, int64_t row, int64_t m, int64_t nb, int64_t n) {
    for (int r = 0; r < 16 && row + r < m; r++)
        for (int j = 0; j < 16; j++)
            y[(row + r) * n + nb * 16 + j] = sums[r * 16 + j] + (bias ? bias[nb * 16 + j] : 0.0f);
}

/* C tiles 0..tiles-1 from the 16 x 16 float32 blocks 1 KB apart at `part` (load), or to them (store) */
#define PARTS(op) { op(0, part, 64);                         \
                    if (tiles > 1) op(1, part + 256, 64);      \
                    if (tiles > 2) op(2, part + 512, 64);      \
                    if (tiles > 3) op(3, part + 768, 64); }

void amx_linear(const float *x, const uint16_t *w, const float *bias, float *y, uint16_t *xb,
                int64_t m, int64_t n, int64_t k) {
    const int64_t kbn = k / 32, nbn = n / 16;
    for (int64_t m0 = 0; m0 < m; m0 += 64) {
        const int64_t tiles = (m - m0 + 15) / 16 < 4 ? (m - m0 + 15) / 16 : 4;
        const int64_t kc = CHUNK_KB / tiles;   /* blocks of 32 inputs a chunk */
        round_rows(x, xb, m0, m, tiles, k);
        #pragma omp parallel
        {
            configure_tiles(6);
            float sums[256] __attribute__((aligned(64))), parts[GROUP * 4 * 256] __attribute__((aligned(64)));
            const int64_t threads = omp_get_num_threads(), id = omp_get_thread_num();
            const int64_t lo = nbn * id / threads, hi = nbn * (id + 1) / threads;   /* this thread's outputs */
            for (int64_t g0 = lo; g0 < hi; g0 += GROUP)
                for (int64_t kb0 = 0; kb0 < kbn; kb0 += kc) {
                    const int64_t g1 = g0 + GROUP < hi ? g0 + GROUP : hi, kb1 = kb0 + kc < kbn ? kb0 + kc : kbn;
                    for (int64_t nb = g0; nb < g1; nb++) {
                        const uint16_t *wn = w + nb * kbn * 512;
                        float *part = parts + (nb - g0) * 4 * 256;
                        if (kb0 == 0) { _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3); }
                        else PARTS(_tile_loadd)
                        for (int64_t kb = kb0; kb < kb1; kb++) {
                            /* the B tile four ahead in this order (after this chunk, the next block's), 16 lines */
                            const uint16_t *ahead = wn + (kb + 4 < kb1 ? kb + 4 : kbn + kb0 + kb + 4 - kb1) * 512;
                            for (int line = 0; line < 16; line++)
                                _mm_prefetch((const char *)(ahead + line * 32), _MM_HINT_T0);
                            _tile_loadd(5, wn + kb * 512, 64);
                            DOT(0)
                            if (tiles > 1) DOT(1)
                            if (tiles > 2) DOT(2)
                            if (tiles > 3) DOT(3)
                        }
                        if (kb1 < kbn)
                            PARTS(_tile_stored)
                        else {
                            STORE(0)
                            if (tiles > 1) STORE(1)
                            if (tiles > 2) STORE(2)
                            if (tiles > 3) STORE(3)
                        }
                    }
                }
            _tile_release();
        }
    }
}

/* e^x for 16 float32 lanes: x = k ln2 + r, |r| <= ln2 / 2, e^r by its Taylor polynomial to r^6
 * (relative error under 2e-7, far below the bfloat16 rounding after it), times 2^k; x clamped to
 * [-87, 87], where e^x stays a normal float */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(87.f)), _mm512_set1_ps(-87.f));
    __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
    __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693145751953125f), x);   /* ln2 in two parts */
    r = _mm512_fnmadd_ps(k, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 p = _mm512_set1_ps(1.f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, k);
}

/* 2^x for 16 float32 lanes, x <= 0 (a score less the running maximum, in base 2): x = k + f,
 * |f| <= 1/2, 2^f by its Taylor polynomial to f^4 (relative error under 5e-5: the weights are
 * rounded to bfloat16, 4e-3, after it), times 2^k; x clamped at -126 */
static inline __m512 exp2_16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.f));
    __m512 k = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT), f = _mm512_sub_ps(x, k);
    __m512 p = _mm512_set1_ps(9.6181291e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, k);
}

static inline __m512 load_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* vLLM's silu_and_mul for a prompt's MLP in bfloat16 (cpu_layers.py's `bf16_mlp`): out (M, I) =
 * silu(gate) * up, gate_up (M, 2I) = [gate, up] as oneDNN's product leaves it, bfloat16 in and
 * out, float32 inside and rounded once; I a multiple of 16. PyTorch's F.silu(gate) * up is two
 * passes over the rows, each rounding to bfloat16. */
void silu_and_mul(const uint16_t *gate_up, uint16_t *out, int64_t m, int64_t inter) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < m; i++) {
        const uint16_t *g = gate_up + i * 2 * inter, *u = g + inter;
        for (int64_t j = 0; j < inter; j += 16) {
            __m512 gv = load_bf16(g + j);
            __m512 s = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
            __m256bh y = _mm512_cvtneps_pbh(_mm512_mul_ps(s, load_bf16(u + j)));
            _mm256_storeu_si256((__m256i *)(out + i * inter + j), (__m256i)y);
        }
    }
}

/* k, v (T tokens `kstride`/`vstride` floats apart, each kv_heads heads of 64 after one another)
 * rounded to bfloat16 into amx_attention's kp and vp (below), keys from T to P zero: a key tile's
 * 16 rows made bfloat16 pairs, then each pair's column of 16 keys gathered into a row of the tile;
 * two rows of values interleaved into pairs. */
void amx_pack_kv(const float *k, const float *v, int64_t kstride, int64_t vstride, uint32_t *kp, uint32_t *vp,
                 int64_t t, int64_t kv_heads) {
    const int64_t padded = (t + 63) / 64 * 64, ktiles = kv_heads * (padded / 16);
    #pragma omp parallel
    {
        uint32_t rows[16 * 32] __attribute__((aligned(64)));
        const __m512i column = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                                  _mm512_set1_epi32(32));
        #pragma omp for schedule(static)
        for (int64_t task = 0; task < ktiles + kv_heads * (padded / 32); task++) {
            if (task < ktiles) {   /* 16 keys of head g: [2 halves of d][16 pairs][16 keys] */
                const int64_t g = task / (padded / 16), t0 = task % (padded / 16) * 16;
                for (int r = 0; r < 16; r++)
                    for (int c = 0; c < 4; c++) {
                        __m512 x = t0 + r < t ? _mm512_loadu_ps(k + (t0 + r) * kstride + g * 64 + c * 16) : _mm512_setzero_ps();
                        _mm256_store_si256((__m256i *)(rows + r * 32 + c * 8), (__m256i)_mm512_cvtneps_pbh(x));
                    }
                for (int c = 0; c < 32; c++)
                    _mm512_storeu_si512(kp + task * 512 + c * 16, _mm512_i32gather_epi32(_mm512_add_epi32(column, _mm512_set1_epi32(c)), rows, 4));
            } else {               /* 32 keys of head g: [4 quarters of d][16 pairs of keys][16] */
                const int64_t vt = task - ktiles, g = vt / (padded / 32), t0 = vt % (padded / 32) * 32;
                for (int c = 0; c < 16; c++)
                    for (int j = 0; j < 4; j++) {
                        const int64_t a = t0 + 2 * c, b = a + 1;
                        __m512 x = a < t ? _mm512_loadu_ps(v + a * vstride + g * 64 + j * 16) : _mm512_setzero_ps();
                        __m512 y = b < t ? _mm512_loadu_ps(v + b * vstride + g * 64 + j * 16) : _mm512_setzero_ps();
                        __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x));
                        __m512i hi = _mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(y)), 16);
                        _mm512_storeu_si512(vp + (vt * 4 + j) * 256 + c * 16, _mm512_or_si512(lo, hi));
                    }
            }
        }
    }
}

/* A prompt's causal attention on AMX tiles, heads of d = 64 (phase 4's prefill, `dtype="auto"` on
 * the amx kind): the T queries are the last T of TK keys (TK > T: a chunk after cached keys, its
 * mask lower-right); flash attention's loop, a block of 16 queries of one head against 64 keys at
 * a time, an online softmax in float32 between the two products.
 *   S (16 x 64) = Q (16 x 64, two A tiles) . K^T          four C tiles, K packed as B tiles
 *   P = 2^(S * scale * log2 e - running max), bfloat16    AVX-512: the 16 rows' maxima first, then
 *                                                       their rescales in one vector; a row's
 *                                                       running sum in 16 lanes to the end
 *   O (16 x 64) = O * 2^(old max - new max) + P . V       four C tiles, V packed as B tiles
 * q: (T, heads, 64) float32, each block of 16 rounded to bfloat16 here (rows past T zero); kp:
 * each KV head's keys as [P/16][2][16 pairs of d][16 keys][2], vp: its values as [P/32][4][16
 * pairs of keys][16 of d][2], P = TK rounded up to 64, keys past TK zero (cpu_amx.py's
 * `amx_attention` packs both, `amx_pack_kv`); out (T, heads, 64) float32. */
#define QK(c) { _tile_loadd(6, kb + ((c) * 2) * 512, 64); _tile_dpbf16ps(c, 4, 6); \
                _tile_loadd(7, kb + ((c) * 2 + 1) * 512, 64); _tile_dpbf16ps(c, 5, 7); }
/* C tiles 0-3 = A tiles 4 and 5 (`a`: 16 rows of 64 bfloat16, a tile each half) against four pairs
 * of B tiles (`OP`), then stored to s as 16 rows of 64 float32 */
#define BLOCK(a, OP) { _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3); \
                       _tile_loadd(4, a, 128); _tile_loadd(5, (a) + 32, 128); OP(0) OP(1) OP(2) OP(3) \
                       _tile_stored(0, s, 256); _tile_stored(1, s + 16, 256); \
                       _tile_stored(2, s + 32, 256); _tile_stored(3, s + 48, 256); }
#define PV(c) { _tile_loadd(6, vb + (c) * 512, 64); _tile_dpbf16ps(c, 4, 6); \
                _tile_loadd(7, vb + (4 + (c)) * 512, 64); _tile_dpbf16ps(c, 5, 7); }

void amx_attention(const float *q, const uint16_t *kp, const uint16_t *vp, float *out, int64_t t, int64_t tk,
                   int64_t heads, int64_t kv_heads, float scale) {
    const int64_t qblocks = (t + 15) / 16, group = heads / kv_heads, padded = (tk + 63) / 64 * 64;
    const float scale2 = scale * 1.44269504f;   /* the scores in base 2: e^(s scale) = 2^(s scale log2 e) */
    #pragma omp parallel
    {
        configure_tiles(8);
        float s[16 * 64] __attribute__((aligned(64))), o[16 * 64] __attribute__((aligned(64)));
        uint16_t p[16 * 64] __attribute__((aligned(64))), qt[16 * 64] __attribute__((aligned(64)));
        float m[16] __attribute__((aligned(64))), mnew[16] __attribute__((aligned(64)));
        float alpha[16] __attribute__((aligned(64))), l[16 * 16] __attribute__((aligned(64)));
        #pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < heads * qblocks; task++) {
            const int64_t qb = qblocks - 1 - task / heads, h = task % heads, g = h / group;   /* longest first */
            /* query i0 + r sits at key position p0 + r: the queries are the last t of the tk keys */
            const int64_t i0 = qb * 16, p0 = tk - t + i0, last = (p0 + 15 < tk - 1 ? p0 + 15 : tk - 1) / 64;
            for (int r = 0; r < 16; r++) {   /* the block's queries rounded to bfloat16, rows past t zero */
                m[r] = -INFINITY;
                _mm512_store_ps(l + r * 16, _mm512_setzero_ps());
                for (int c = 0; c < 4; c++) {
                    __m512 x = i0 + r < t ? _mm512_loadu_ps(q + ((i0 + r) * heads + h) * 64 + c * 16) : _mm512_setzero_ps();
                    _mm256_store_si256((__m256i *)(qt + r * 64 + c * 16), (__m256i)_mm512_cvtneps_pbh(x));
                }
            }
            memset(o, 0, sizeof o);
            for (int64_t j = 0; j <= last; j++) {
                const uint16_t *kb = kp + (g * (padded / 16) + j * 4) * 2 * 512;
                BLOCK(qt, QK)
                for (int r = 0; r < 16; r++) {   /* the scores in base 2, masked, and each row's maximum */
                    __m512 mx = _mm512_set1_ps(-INFINITY);
                    for (int c = 0; c < 4; c++) {
                        __m512 x = _mm512_mul_ps(_mm512_load_ps(s + r * 64 + c * 16), _mm512_set1_ps(scale2));
                        if (j * 64 + 63 > p0) {   /* keys past this query masked */
                            int64_t allowed = p0 + r - (j * 64 + c * 16) + 1;
                            __mmask16 keep = allowed >= 16 ? 0xFFFF : allowed <= 0 ? 0 : (__mmask16)((1u << allowed) - 1);
                            x = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), keep, x);
                        }
                        _mm512_store_ps(s + r * 64 + c * 16, x);
                        mx = _mm512_max_ps(mx, x);
                    }
                    mnew[r] = _mm512_reduce_max_ps(mx);
                }
                /* the 16 rows' new maxima and rescales at once: alpha = 2^(old max - new max) */
                const __m512 mold = _mm512_load_ps(m), mn = _mm512_max_ps(mold, _mm512_load_ps(mnew));
                _mm512_store_ps(alpha, exp2_16(_mm512_sub_ps(mold, mn)));
                _mm512_store_ps(m, mn);
                for (int r = 0; r < 16; r++) {   /* P = 2^(x - max), bfloat16; each row's sum kept in 16 lanes */
                    __m512 x[4], sum = _mm512_setzero_ps();
                    for (int c = 0; c < 4; c++) {
                        x[c] = _mm512_load_ps(s + r * 64 + c * 16);
                        __mmask16 live = _mm512_cmp_ps_mask(x[c], _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
                        x[c] = _mm512_maskz_mov_ps(live, exp2_16(_mm512_sub_ps(x[c], _mm512_set1_ps(m[r]))));
                        sum = _mm512_add_ps(sum, x[c]);
                    }
                    _mm512_store_ps(l + r * 16, _mm512_fmadd_ps(_mm512_load_ps(l + r * 16), _mm512_set1_ps(alpha[r]), sum));
                    _mm512_store_si512((__m512i *)(p + r * 64), (__m512i)_mm512_cvtne2ps_pbh(x[1], x[0]));
                    _mm512_store_si512((__m512i *)(p + r * 64 + 32), (__m512i)_mm512_cvtne2ps_pbh(x[3], x[2]));
                }
                const uint16_t *vb = vp + (g * (padded / 32) + j * 2) * 4 * 512;
                BLOCK(p, PV)
                for (int r = 0; r < 16; r++)
                    for (int c = 0; c < 4; c++) {
                        __m512 acc = _mm512_load_ps(o + r * 64 + c * 16);
                        if (alpha[r] != 1.f) acc = _mm512_mul_ps(acc, _mm512_set1_ps(alpha[r]));
                        _mm512_store_ps(o + r * 64 + c * 16, _mm512_add_ps(acc, _mm512_load_ps(s + r * 64 + c * 16)));
                    }
            }
            for (int r = 0; r < 16 && i0 + r < t; r++)
                for (int c = 0; c < 4; c++)
                    _mm512_storeu_ps(out + ((i0 + r) * heads + h) * 64 + c * 16,
                                     _mm512_mul_ps(_mm512_load_ps(o + r * 64 + c * 16),
                                                   _mm512_set1_ps(1.f / _mm512_reduce_add_ps(_mm512_load_ps(l + r * 16)))));
        }
        _tile_release();
    }
}
