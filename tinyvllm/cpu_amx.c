/* tinyvllm: a float32 model's bfloat16 products at decode rows, on AMX tiles (Intel Xeon, `amx` kind).
 *
 * `dtype="auto"` runs a float32 model's products of many rows in bfloat16 (tinyvllm.model's
 * `BF16_PRODUCT_ROWS`). oneDNN does that on AMX tiles too, but at a decode step's few rows its
 * product is bound by reading the weights, and it reads them at about 10 GB/s on a 2-core Xeon
 * VM where the VM gives 17: this file reads them in one pass, in the order they lie.
 *
 * AMX: eight tile registers of 16 rows x 64 bytes; TDPBF16PS multiplies a 16 x 32 bfloat16 tile
 * (A: 16 rows of x, 32 of their inputs) by a tile of 16 pairs x 16 outputs (B: the weight, each
 * pair two inputs of one output, "VNNI" order) into 16 x 16 float32 sums (C). Here C is up to four
 * tiles (64 rows), A one tile loaded per C tile from the rows rounded to bfloat16, B one tile, so a
 * B tile of the weight is read once per step, for every row.
 *
 * The weight comes as bfloat16 B tiles, [N/16][K/32][16 pairs][16][2] (tinyvllm.model's
 * `amx_packed`: PyTorch's rounding, then a permute): an output block's tiles one after the other,
 * so a thread streams its share of the weight from start to end. amx_linear: y (M, N) = x (M, K) @ W^T (+ bias), float32 in and out, M <= 64 per
 * pass over the weight (more rows: another pass), N a multiple of 16, K of 32. A process must ask
 * Linux for the tile state once (amx_permit: 0 when granted). */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

int amx_permit(void) { return (int)syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); }

/* rows m0.. of x rounded to bfloat16 into xb (16 * tiles rows of k), rows past m zero */
static void round_rows(const float *x, uint16_t *xb, int64_t m0, int64_t m, int64_t tiles, int64_t k) {
    for (int64_t i = 0; i < 16 * tiles; i++)
        for (int64_t c = 0; c < k; c += 16) {
            __m512 v = m0 + i < m ? _mm512_loadu_ps(x + (m0 + i) * k + c) : _mm512_setzero_ps();
            _mm256_storeu_si256((__m256i *)(xb + i * k + c), (__m256i)_mm512_cvtneps_pbh(v));
        }
}

/* C tile t += the t-th 16 rows of xb against the B tile in register 5 (tile numbers must be constants) */
#define DOT(t) { _tile_loadd(4, xb + (t) * 16 * k + kb * 32, k * 2); _tile_dpbf16ps(t, 4, 5); }
#define STORE(t) { _tile_stored(t, sums, 64); put(sums, y, bias, m0 + (t) * 16, m, nb, n); }

static void put(const float *sums, float *y, const float *bias, int64_t row, int64_t m, int64_t nb, int64_t n) {
    for (int r = 0; r < 16 && row + r < m; r++)
        for (int j = 0; j < 16; j++)
            y[(row + r) * n + nb * 16 + j] = sums[r * 16 + j] + (bias ? bias[nb * 16 + j] : 0.0f);
}

void amx_linear(const float *x, const uint16_t *w, const float *bias, float *y, uint16_t *xb,
                int64_t m, int64_t n, int64_t k) {
    const int64_t kbn = k / 32;
    for (int64_t m0 = 0; m0 < m; m0 += 64) {
        const int64_t tiles = (m - m0 + 15) / 16 < 4 ? (m - m0 + 15) / 16 : 4;
        round_rows(x, xb, m0, m, tiles, k);
        #pragma omp parallel
        {
            TileConfig cfg;
            memset(&cfg, 0, sizeof cfg);
            cfg.palette = 1;
            for (int t = 0; t < 6; t++) {
                cfg.rows[t] = 16;
                cfg.colsb[t] = 64;
            }
            _tile_loadconfig(&cfg);
            float sums[256] __attribute__((aligned(64)));
            #pragma omp for schedule(static)
            for (int64_t nb = 0; nb < n / 16; nb++) {
                const uint16_t *wn = w + nb * kbn * 512;
                _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
                for (int64_t kb = 0; kb < kbn; kb++) {
                    for (int line = 0; line < 16; line++)   /* the B tile four ahead, 16 cache lines */
                        _mm_prefetch((const char *)(wn + (kb + 4) * 512 + line * 32), _MM_HINT_T0);
                    _tile_loadd(5, wn + kb * 512, 64);
                    DOT(0)
                    if (tiles > 1) DOT(1)
                    if (tiles > 2) DOT(2)
                    if (tiles > 3) DOT(3)
                }
                STORE(0)
                if (tiles > 1) STORE(1)
                if (tiles > 2) STORE(2)
                if (tiles > 3) STORE(3)
            }
            _tile_release();
        }
    }
}
