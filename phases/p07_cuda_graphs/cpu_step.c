/* tinyvllm: a decode step's decoder layers in one C call, on an AVX2 CPU (cpu_step.py's CStep).
 *
 * Phase 7's `decode_forward` is a layer's work in about twenty PyTorch operators and seven C
 * calls through ctypes, each microseconds in the interpreter: a third of a batch-1 step of the
 * default model. This is the same loop in C, as llama.cpp runs its graph: per layer the fused
 * q/k/v product, RoPE, the step's K/V written and attended (phase 4's C kernel; a layer with a
 * sliding window from each row's window on, `attend`), o_proj, the
 * residual add and RMSNorm (cpu_norm.c), gate/up, SiLU times up, down, the next add + norm
 * (Qwen3's per-head norms of q and k too, before RoPE).
 * The products and the attention are the kernels the eager step calls, reached by the addresses
 * in the caller's tables (phase 7's layer_row and phase 4's attention_row, the rows its compiled
 * step's C++ operators read too), so their numbers are the eager step's own; RoPE is computed as
 * PyTorch computes `x * cos + roll(x, d/2) * [-sin, sin]` (each product rounded, then the sum:
 * built with -ffp-contract=off); SiLU takes libm's expf, which can differ from PyTorch's in the
 * last bit.
 *
 * The embedding, the rotary table and the LM head stay in PyTorch: once a step each. */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* the kernels, as phase 5 (cpu_int8.c, cpu_lossless.c), tinyvllm (cpu_gemv.c, cpu_norm.c) and
 * phase 4 (cpu_attention.c) define them */
typedef void (*F32Fn)(const float *, const float *, float *, int64_t, int64_t, int64_t);
typedef void (*LosslessFn)(const float *, const uint8_t *, const float *, const float *, float *, int64_t,
                           int64_t, int64_t, int64_t);
typedef void (*Int4Fn)(const float *, const uint8_t *, const void *, const void *, float *, int8_t *,
                       float *, float *, int64_t, int64_t, int64_t, int64_t);
typedef void (*Int8Fn)(const float *, const int8_t *, const float *, float *, int16_t *, float *, int64_t,
                       int64_t, int64_t);
typedef void (*NormFn)(float *, float *, const float *, float *, int64_t, int64_t, float);
typedef void (*AttentionFn)(const float *, const float *, const float *, float *, float *, const int64_t *,
                            const int64_t *, const int64_t *, float *, float *, int64_t, int64_t, int64_t,
                            int64_t, int64_t, int64_t, int64_t, float);
typedef void (*WindowFn)(const float *, const float *, const float *, float *, float *, const int64_t *,
                         const int64_t *, const int64_t *, const int64_t *, float *, float *, int64_t, int64_t,
                         int64_t, int64_t, int64_t, int64_t, int64_t, float);

/* a product's row (layer_row), the step's attention row (attention_row), as cpu_ops.cpp reads them */
enum { FN, BITS, WEIGHT, SCALE, ZERO, BIAS, OUT, IN, GROUP, MANY, LAYER_FIELDS };
enum { A_FN, SLOTS, TABLES, TABLE_STRIDE, LENS, MAX_LEN, BLOCK, KV_HEADS, KV, LAYER_STRIDE, V_OFFSET, WINDOWS,
       W_FN, STARTS, LAYER_KV };
/* LAYER_KV, where not 0: each layer's own place (phase 11: layers in groups, each group with its
 * own block tables): its K's offset from KV, in floats, its slots, its tables and their row stride */
enum { OWN_OFFSET, OWN_SLOTS, OWN_TABLES, OWN_STRIDE, OWN_FIELDS };
/* a decoder layer's row of the plan: its norms' weights (q's and k's per head, Qwen3's, or 0),
 * then its four products' rows */
enum { POST_NORM, NEXT_NORM, Q_NORM, K_NORM, QKV, O_PROJ = QKV + LAYER_FIELDS, GATE_UP = O_PROJ + LAYER_FIELDS,
       DOWN = GATE_UP + LAYER_FIELDS, PLAN_FIELDS = DOWN + LAYER_FIELDS };
/* the step's sizes and pointers (`shape`) */
enum { ROWS, HIDDEN, HEADS, KV_HEADS_, HEAD_DIM, FFN, COS, SIN, NORM_FN, FIRST_NORM, WORK, SHAPE_FIELDS };

/* y (M, OUT) = x (M, IN) @ W^T + bias through the layer's own C kernel; scratch: what an int8 or
 * int4 product rounds x into (under M * (I + 32) floats, as cpu_ops.cpp sizes it) */
static void linear(const int64_t *e, const float *x, float *y, int64_t M, float *scratch) {
    const int64_t O = e[OUT], I = e[IN];
    if (e[BITS] == 32)
        ((F32Fn)e[FN])(x, (const float *)e[WEIGHT], y, M, O, I);
    else if (e[BITS] == 1)   /* float32 from its codes; GROUP holds their bits */
        ((LosslessFn)e[FN])(x, (const uint8_t *)e[WEIGHT], (const float *)e[SCALE], (const float *)e[ZERO], y, M, O,
                            I, e[GROUP]);
    else if (e[BITS] == 4) {
        const int64_t C = (I + 63) / 64;
        ((Int4Fn)e[FN])(x, (const uint8_t *)e[WEIGHT], (const void *)e[SCALE], (const void *)e[ZERO], y,
                        (int8_t *)scratch, scratch + M * 16 * C, scratch + M * 18 * C, M, O, I, e[GROUP]);
    } else {
        const int64_t half = (M * I + 1) / 2;
        ((Int8Fn)e[FN])(x, (const int8_t *)e[WEIGHT], (const float *)e[SCALE], y, (int16_t *)scratch,
                        scratch + half, M, O, I);
    }
    if (e[BIAS])
        for (int64_t m = 0; m < M; m++)
            for (int64_t o = 0; o < O; o++) y[m * O + o] += ((const float *)e[BIAS])[o];
}

/* out (d,) = x * cos + roll(x, d/2) * [-sin, sin]: the first half takes -x[i + d/2] * sin[i] */
static void rope(const float *x, const float *cos, const float *sin, float *out, int64_t d) {
    const int64_t half = d / 2;
    for (int64_t i = 0; i < d; i++) {
        const float a = x[i] * cos[i], b = i < half ? -x[i + half] * sin[i] : x[i - half] * sin[i];
        out[i] = a + b;
    }
}

/* layer l's attention over the step's M rows (the new k, v written first), through its own part of
 * the cache where the row gives each layer one (LAYER_KV): in its sliding window where the row gives
 * it one shorter than the longest row, each row b from its key lens[b] - window on (as
 * cpu_attention.c_decode_attention starts it), else over every key */
void attend(const int64_t *a, int64_t l, const float *q, const float *k, const float *v, float *out,
            float *scores, int64_t M, int64_t H, int64_t KVH, int64_t d) {
    const int64_t *own = a[LAYER_KV] ? (const int64_t *)a[LAYER_KV] + l * OWN_FIELDS : NULL;
    float *k_cache = (float *)a[KV] + (own ? own[OWN_OFFSET] : l * a[LAYER_STRIDE]);
    const int64_t *slots = (const int64_t *)(own ? own[OWN_SLOTS] : a[SLOTS]);
    const int64_t *tables = (const int64_t *)(own ? own[OWN_TABLES] : a[TABLES]);
    const int64_t stride = own ? own[OWN_STRIDE] : a[TABLE_STRIDE];
    const int64_t *lens = (const int64_t *)a[LENS], T = a[MAX_LEN];
    const int64_t window = a[WINDOWS] ? ((const int64_t *)a[WINDOWS])[l] : 0;
    const float scale = (float)(1.0 / sqrt((double)d));
    if (window > 0 && window < T) {
        int64_t *starts = (int64_t *)a[STARTS];
        for (int64_t b = 0; b < M; b++) starts[b] = lens[b] > window ? lens[b] - window : 0;
        ((WindowFn)a[W_FN])(q, k, v, k_cache, k_cache + a[V_OFFSET], slots, tables, lens, starts, out, scores, M, H,
            KVH, d, a[BLOCK], stride, T, scale);
    } else {
        ((AttentionFn)a[A_FN])(q, k, v, k_cache, k_cache + a[V_OFFSET], slots, tables, lens, out, scores, M, H, KVH,
            d, a[BLOCK], stride, T, scale);
    }
}

/* Every layer of a decode step of M rows. x (M, D): the embeddings in, then the residual stream;
 * h (M, D): the final norm's output. work: the buffers below, sized by cpu_step.py. */
void decode_layers(const int64_t *plan, int64_t L, const int64_t *attention, const int64_t *shape, float *x,
                   float *h, float eps) {
    const int64_t M = shape[ROWS], D = shape[HIDDEN], H = shape[HEADS], KVH = shape[KV_HEADS_];
    const int64_t d = shape[HEAD_DIM], F = shape[FFN], W = (H + 2 * KVH) * d, T = attention[MAX_LEN];
    const float *cos = (const float *)shape[COS], *sin = (const float *)shape[SIN];
    const NormFn norm = (NormFn)shape[NORM_FN];
    float *qkv = (float *)shape[WORK], *q = qkv + M * W, *k = q + M * H * d, *v = k + M * KVH * d;
    float *att = v + M * KVH * d, *gu = att + M * H * d, *act = gu + M * 2 * F, *scores = act + M * F;
    float *scratch = scores + M * H * T;
    norm(x, NULL, (const float *)shape[FIRST_NORM], h, M, D, eps);   /* the first layer's input norm */
    for (int64_t l = 0; l < L; l++) {
        const int64_t *p = plan + l * PLAN_FIELDS;
        linear(p + QKV, h, qkv, M, scratch);
        for (int64_t m = 0; m < M; m++) {   /* q and k rotated, v copied: each (M, heads, d) in a row */
            float *row = qkv + m * W;
            const float *c = cos + m * d, *s = sin + m * d;
            if (p[Q_NORM]) {   /* Qwen3: each head of q and of k normed before RoPE, in place */
                norm(row, NULL, (const float *)p[Q_NORM], row, H, d, eps);
                norm(row + H * d, NULL, (const float *)p[K_NORM], row + H * d, KVH, d, eps);
            }
            for (int64_t j = 0; j < H; j++) rope(row + j * d, c, s, q + (m * H + j) * d, d);
            for (int64_t j = 0; j < KVH; j++) rope(row + (H + j) * d, c, s, k + (m * KVH + j) * d, d);
            memcpy(v + m * KVH * d, row + (H + KVH) * d, KVH * d * sizeof(float));
        }
        attend(attention, l, q, k, v, att, scores, M, H, KVH, d);
        linear(p + O_PROJ, att, h, M, scratch);
        norm(h, x, (const float *)p[POST_NORM], h, M, D, eps);       /* x += h; h = norm(x) */
        linear(p + GATE_UP, h, gu, M, scratch);
        for (int64_t m = 0; m < M; m++)
            for (int64_t i = 0; i < F; i++) {
                const float g = gu[m * 2 * F + i];
                act[m * F + i] = g / (1.f + expf(-g)) * gu[m * 2 * F + F + i];
            }
        linear(p + DOWN, act, h, M, scratch);
        norm(h, x, (const float *)p[NEXT_NORM], h, M, D, eps);       /* the next layer's, or the final */
    }
}
