/* tinyvllm phase 7: the compiled step's two operators as C++ kernels, for the CPU.
 *
 * The compiled graph is C++ (inductor's cpp_wrapper) and calls tinyvllm::opaque_linear and
 * tinyvllm::unified_attention through PyTorch's dispatcher. With only their Python kernels
 * (compiled.py), each call enters the interpreter: boxing the arguments, taking the GIL, the
 * forward context, the ctypes call of the C kernel (some 20 us, 151 times a step of the default
 * model). Registered here for the CPU dispatch key, the dispatcher calls these instead, and they
 * call phase 5's C products (or tinyvllm's float32 one) and phase 4's C decode attention
 * directly: the step never enters Python. What they need comes from the step's *tables*
 * (compiled.py makes them), which the runner hands this thread before the graph runs (use_step)
 * and takes back after; a layer or a step these do not serve (another kernel, many rows, no
 * table) goes to the Python kernel, registered as the *_eager twin of each operator.
 *
 * A layer whose many rows multiply in bfloat16 (phase 4's `CpuLinear.bf16_rows`) runs them
 * here too, through oneDNN's operator on the weight's packed bfloat16 copy, or up to
 * amx_product_max_rows rows through phase 4's cpu_amx.c on its AMX copy where that runs (use_packed
 * hands them over with the step), as `onednn_matmul` does from Python.
 *
 * Built by tinyvllm.ckernel with PyTorch's headers (about 15 s, once per machine). */
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <immintrin.h>
#include <cmath>
#include <vector>

/* phase 5 (cpu_int8.c), phase 4 (cpu_attention.c) and phase 4's cpu_gemv.c: their C signatures */
using Int4Fn = void (*)(const float *, const uint8_t *, const void *, const void *, float *, int8_t *,
                        float *, float *, int64_t, int64_t, int64_t, int64_t);
using Int8Fn = void (*)(const float *, const int8_t *, const float *, float *, int16_t *, float *, int64_t,
                        int64_t, int64_t);
using F32Fn = void (*)(const float *, const float *, float *, int64_t, int64_t, int64_t);  /* phase 4's cpu_gemv.c */
using LosslessFn = void (*)(const float *, const uint8_t *, const float *, const float *, float *, int64_t, int64_t,
                           int64_t, int64_t);  /* phase 5's cpu_lossless.c */
using AmxFn = void (*)(const float *, const uint16_t *, const float *, float *, uint16_t *, int64_t, int64_t,
                      int64_t);  /* phase 4's cpu_amx.c */
using AttentionFn = void (*)(const float *, const float *, const float *, float *, float *, const int64_t *,
                             const int64_t *, const int64_t *, float *, float *, int64_t, int64_t, int64_t,
                             int64_t, int64_t, int64_t, int64_t, float);
using WindowFn = void (*)(const float *, const float *, const float *, float *, float *, const int64_t *,
                          const int64_t *, const int64_t *, const int64_t *, float *, float *, int64_t, int64_t,
                          int64_t, int64_t, int64_t, int64_t, int64_t, float);

/* a layer's row of the layer table (int64 each; pointers as integers); BITS: 32, 8 or 4 for the float32, int8
 * and int4 products, 1 for a float32 weight read from its codes (GROUP: their bits) */
enum { FN, BITS, WEIGHT, SCALE, ZERO, BIAS, OUT, IN, GROUP, MANY, LAYER_FIELDS };
/* the step's attention row (LAYER_KV: each layer's own tables, cpu_step.c's; here the eager attention's) */
enum { A_FN, SLOTS, TABLES, TABLE_STRIDE, LENS, MAX_LEN, BLOCK, KV_HEADS, KV, LAYER_STRIDE, V_OFFSET, WINDOWS,
       W_FN, STARTS, LAYER_KV };

struct Step {
    const int64_t *layers = nullptr;
    int64_t num_layers = 0;
    const int64_t *attention = nullptr;
};
static thread_local Step step;                 /* this thread's step: a background thread has its own */
/* each layer's bfloat16 weight in oneDNN's layout and the rows from which it serves (0: never) */
static thread_local std::vector<at::Tensor> packed;
static thread_local std::vector<int64_t> packed_from;
/* each layer's AMX copy (empty: none), cpu_amx.c's product and up to how many rows it serves */
static thread_local std::vector<at::Tensor> amx;
static thread_local AmxFn amx_fn = nullptr;
static thread_local int64_t amx_rows = 0;
static thread_local std::vector<float> space;  /* scratch, reused from call to call */
static const int64_t CONVERT_GRAIN = 32768;   /* values a thread converts at least (ATen's grain) */

static float *scratch(int64_t floats) {
    if ((int64_t)space.size() < floats) space.resize(floats);
    return space.data();
}

extern "C" void use_step(const int64_t *layers, int64_t num_layers, const int64_t *attention) {
    step = Step{layers, num_layers, attention};
}

void use_packed(at::TensorList weights, at::IntArrayRef from_rows, at::TensorList amx_weights, int64_t fn,
                int64_t rows) {
    packed.assign(weights.begin(), weights.end());
    packed_from.assign(from_rows.begin(), from_rows.end());
    amx.assign(amx_weights.begin(), amx_weights.end());
    amx_fn = reinterpret_cast<AmxFn>(fn);
    amx_rows = rows;
}

/* float32 -> bfloat16 rounded to nearest, ties to even, on the bits, as PyTorch's .to(torch.bfloat16)
 * (a NaN stays a NaN): 8 values in the low 16 bits of each lane */
__attribute__((target("avx2"))) static inline __m256i round_bf16(const float *p) {
    const __m256 v = _mm256_loadu_ps(p);
    const __m256i b = _mm256_castps_si256(v), lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    return _mm256_blendv_epi8(_mm256_set1_epi32(0x7fc0), r, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_ORD_Q)));
}

/* n values, 16 an iteration (packus interleaves the two halves' 128-bit lanes: the permute puts them back) */
__attribute__((target("avx2"))) static void to_bf16(const float *x, uint16_t *y, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i *)(y + i),
                            _mm256_permute4x64_epi64(_mm256_packus_epi32(round_bf16(x + i), round_bf16(x + i + 8)), 0xd8));
    for (; i < n; i++) y[i] = c10::BFloat16(x[i]).x;
}

/* bfloat16 -> float32 (exact: the 16 bits moved up), plus the bias if there is one */
__attribute__((target("avx2"))) static void from_bf16(const uint16_t *y, const float *bias, float *out, int64_t M, int64_t O) {
    for (int64_t m = 0; m < M; m++, y += O, out += O) {
        int64_t o = 0;
        for (; o + 8 <= O; o += 8) {
            __m256 v = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(y + o))), 16));
            _mm256_storeu_ps(out + o, bias ? _mm256_add_ps(v, _mm256_loadu_ps(bias + o)) : v);
        }
        for (; o < O; o++) out[o] = float(c10::BFloat16(y[o], c10::BFloat16::from_bits())) + (bias ? bias[o] : 0.f);
    }
}

/* x (M, I) float32 @ the packed bfloat16 weight (O, I) + bias: x rounded to bfloat16, the output made
 * float32 again. The two conversions are this file's loops (split between PyTorch's threads where
 * they are long, at::parallel_for), not two Tensor.to calls each with an operator's dispatch: the
 * default model's 48-row step 64.3 -> 63.6 ms */
static at::Tensor bf16_product(const at::Tensor &x, const at::Tensor &weight, const float *bias, int64_t O) {
    static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
    const int64_t M = x.size(0), I = x.size(1);
    at::Tensor xb = at::empty({M, I}, x.options().dtype(at::kBFloat16));
    const float *xp = x.data_ptr<float>();
    uint16_t *xbp = reinterpret_cast<uint16_t *>(xb.data_ptr());
    at::parallel_for(0, M, CONVERT_GRAIN / I + 1, [&](int64_t m0, int64_t m1) { to_bf16(xp + m0 * I, xbp + m0 * I, (m1 - m0) * I); });
    torch::jit::Stack stack{xb, weight, c10::IValue(), std::string("none"),
                            c10::List<std::optional<at::Scalar>>(), std::optional<std::string>(std::string(""))};
    op.callBoxed(&stack);
    const at::Tensor yb = stack[0].toTensor();
    at::Tensor y = at::empty({M, O}, x.options());
    const uint16_t *ybp = reinterpret_cast<const uint16_t *>(yb.data_ptr());
    float *yp = y.data_ptr<float>();
    at::parallel_for(0, M, CONVERT_GRAIN / O + 1, [&](int64_t m0, int64_t m1) { from_bf16(ybp + m0 * O, bias, yp + m0 * O, m1 - m0, O); });
    return y;
}

at::Tensor opaque_linear(const at::Tensor &x, int64_t index, int64_t out_features) {
    const int64_t *e = index < step.num_layers ? step.layers + index * LAYER_FIELDS : nullptr;
    const bool bf16 = e && e[FN] && index < (int64_t)packed_from.size() && packed_from[index] > 0
                      && x.dim() == 2 && x.size(0) >= packed_from[index];
    if (!e || !e[FN] || x.scalar_type() != at::kFloat || x.dim() != 2 || !x.is_contiguous()
            || x.size(1) != e[IN] || (x.size(0) >= e[MANY] && !bf16)) {
        static auto eager = c10::Dispatcher::singleton().findSchemaOrThrow("tinyvllm::opaque_linear_eager", "")
                                .typed<at::Tensor(const at::Tensor &, int64_t, int64_t)>();
        return eager.call(x, index, out_features);
    }
    const int64_t M = x.size(0), O = e[OUT], I = e[IN];
    at::Tensor y;
    if (bf16 && M <= amx_rows && index < (int64_t)amx.size() && amx[index].numel()) {   /* on AMX tiles */
        y = at::empty({M, O}, x.options());
        amx_fn(x.data_ptr<float>(), (const uint16_t *)amx[index].data_ptr(), (const float *)e[BIAS],
               y.data_ptr<float>(), (uint16_t *)scratch(32 * I), M, O, I);
        return y;
    }
    if (bf16)            /* many rows in bfloat16, the bias added with the conversion back */
        return bf16_product(x, packed[index], (const float *)e[BIAS], O);
    y = at::empty({M, O}, x.options());
    float *out = y.data_ptr<float>();
    if (e[BITS] == 32) { /* float32: phase 4's cpu_gemv.c, as CpuLinear runs it */
        reinterpret_cast<F32Fn>(e[FN])(x.data_ptr<float>(), (const float *)e[WEIGHT], out, M, O, I);
    } else if (e[BITS] == 1) {  /* float32 from its 4- or 8-bit codes: no scratch */
        reinterpret_cast<LosslessFn>(e[FN])(x.data_ptr<float>(), (const uint8_t *)e[WEIGHT], (const float *)e[SCALE],
            (const float *)e[ZERO], out, M, O, I, e[GROUP]);
    } else if (e[BITS] == 4) {  /* x as int8 blocks, their scales, the groups' sums: as cpu_int8.int4_matmul */
        const int64_t C = (I + 63) / 64;
        float *s = scratch(M * (16 * C + 2 * C + I / e[GROUP]));
        reinterpret_cast<Int4Fn>(e[FN])(x.data_ptr<float>(), (const uint8_t *)e[WEIGHT], (const void *)e[SCALE],
            (const void *)e[ZERO], out, (int8_t *)s, s + M * 16 * C, s + M * 18 * C, M, O, I, e[GROUP]);
    } else {             /* x in int16 and its rows' scales: as cpu_int8.int8_matmul */
        const int64_t half = (M * I + 1) / 2;
        float *s = scratch(half + M);
        reinterpret_cast<Int8Fn>(e[FN])(x.data_ptr<float>(), (const int8_t *)e[WEIGHT], (const float *)e[SCALE],
            out, (int16_t *)s, s + half, M, O, I);
    }
    if (e[BIAS]) {
        const float *b = (const float *)e[BIAS];
        for (int64_t m = 0; m < M; m++)
            for (int64_t o = 0; o < O; o++) out[m * O + o] += b[o];
    }
    return y;
}

at::Tensor unified_attention(int64_t layer_idx, const at::Tensor &query, const at::Tensor &key,
                             const at::Tensor &value) {
    const int64_t *a = step.attention;
    if (!a || a[LAYER_KV] || query.scalar_type() != at::kFloat || query.dim() != 3 || key.scalar_type() != at::kFloat
            || value.scalar_type() != at::kFloat) {
        static auto eager = c10::Dispatcher::singleton().findSchemaOrThrow("tinyvllm::unified_attention_eager", "")
                                .typed<at::Tensor(int64_t, const at::Tensor &, const at::Tensor &, const at::Tensor &)>();
        return eager.call(layer_idx, query, key, value);
    }
    const at::Tensor q = query.contiguous(), k = key.contiguous(), v = value.contiguous();
    /* a step of decodes: this layer's new k, v written to their slots, then attended over the
     * block table, in one call (as cpu_attention.c_decode_attention makes it) */
    const int64_t B = q.size(0), H = q.size(1), d = q.size(2);
    at::Tensor out = at::empty(q.sizes(), q.options());
    float *k_cache = (float *)a[KV] + layer_idx * a[LAYER_STRIDE];
    const int64_t *lens = (const int64_t *)a[LENS], T = a[MAX_LEN];
    const int64_t window = a[WINDOWS] ? ((const int64_t *)a[WINDOWS])[layer_idx] : 0;
    const float scale = (float)(1.0 / std::sqrt((double)d));
    if (window > 0 && window < T) {   /* a sliding window: each row from its key lens[b] - window on */
        int64_t *starts = (int64_t *)a[STARTS];
        for (int64_t b = 0; b < B; b++) starts[b] = lens[b] > window ? lens[b] - window : 0;
        reinterpret_cast<WindowFn>(a[W_FN])(q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), k_cache,
            k_cache + a[V_OFFSET], (const int64_t *)a[SLOTS], (const int64_t *)a[TABLES], lens, starts,
            out.data_ptr<float>(), scratch(B * H * T), B, H, a[KV_HEADS], d, a[BLOCK], a[TABLE_STRIDE], T, scale);
        return out;
    }
    reinterpret_cast<AttentionFn>(a[A_FN])(q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), k_cache,
        k_cache + a[V_OFFSET], (const int64_t *)a[SLOTS], (const int64_t *)a[TABLES], lens,
        out.data_ptr<float>(), scratch(B * H * T), B, H, a[KV_HEADS], d, a[BLOCK], a[TABLE_STRIDE], T, scale);
    return out;
}

TORCH_LIBRARY_FRAGMENT(tinyvllm, m) {
    m.def("use_packed(Tensor[] weights, int[] from_rows, Tensor[] amx_weights, int amx_fn, int amx_rows) -> ()",
          &use_packed);
}

TORCH_LIBRARY_IMPL(tinyvllm, CPU, m) {
    m.impl("opaque_linear", opaque_linear);
    m.impl("unified_attention", unified_attention);
}
