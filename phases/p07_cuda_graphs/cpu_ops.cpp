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
 * A layer whose many rows multiply in bfloat16 (tinyvllm.model's `Linear.bf16_rows`) runs them
 * here too, through oneDNN's operator on the weight's packed bfloat16 copy (use_packed hands
 * them over with the step), as `onednn_matmul` does from Python.
 *
 * Built by tinyvllm.ckernel with PyTorch's headers (about 15 s, once per machine). */
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

/* phase 5 (cpu_int8.c), phase 4 (cpu_attention.c) and tinyvllm/cpu_gemv.c: their C signatures */
using Int4Fn = void (*)(const float *, const uint8_t *, const void *, const void *, float *, int8_t *,
                        float *, float *, int64_t, int64_t, int64_t, int64_t);
using Int8Fn = void (*)(const float *, const int8_t *, const float *, float *, int16_t *, float *, int64_t,
                        int64_t, int64_t);
using F32Fn = void (*)(const float *, const float *, float *, int64_t, int64_t, int64_t);  /* tinyvllm/cpu_gemv.c */
using LosslessFn = void (*)(const float *, const uint8_t *, const float *, const float *, float *, int64_t, int64_t,
                           int64_t, int64_t);  /* phase 5's cpu_lossless.c */
using AttentionFn = void (*)(const float *, const float *, const float *, float *, float *, const int64_t *,
                             const int64_t *, const int64_t *, float *, float *, int64_t, int64_t, int64_t,
                             int64_t, int64_t, int64_t, int64_t, float);

/* a layer's row of the layer table (int64 each; pointers as integers); BITS: 32, 8 or 4 for the float32, int8
 * and int4 products, 1 for a float32 weight read from its codes (GROUP: their bits) */
enum { FN, BITS, WEIGHT, SCALE, ZERO, BIAS, OUT, IN, GROUP, MANY, LAYER_FIELDS };
/* the step's attention row */
enum { A_FN, SLOTS, TABLES, TABLE_STRIDE, LENS, MAX_LEN, BLOCK, KV_HEADS, KV, LAYER_STRIDE, V_OFFSET };

struct Step {
    const int64_t *layers = nullptr;
    int64_t num_layers = 0;
    const int64_t *attention = nullptr;
};
static thread_local Step step;                 /* this thread's step: a background thread has its own */
/* each layer's bfloat16 weight in oneDNN's layout and the rows from which it serves (0: never) */
static thread_local std::vector<at::Tensor> packed;
static thread_local std::vector<int64_t> packed_from;
static thread_local std::vector<float> space;  /* scratch, reused from call to call */

static float *scratch(int64_t floats) {
    if ((int64_t)space.size() < floats) space.resize(floats);
    return space.data();
}

extern "C" void use_step(const int64_t *layers, int64_t num_layers, const int64_t *attention) {
    step = Step{layers, num_layers, attention};
}

void use_packed(at::TensorList weights, at::IntArrayRef from_rows) {
    packed.assign(weights.begin(), weights.end());
    packed_from.assign(from_rows.begin(), from_rows.end());
}

/* x (M, I) float32 @ the packed bfloat16 weight: x rounded to bfloat16, the output float32 */
static at::Tensor bf16_product(const at::Tensor &x, const at::Tensor &weight) {
    static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
    torch::jit::Stack stack{x.to(at::kBFloat16), weight, c10::IValue(), std::string("none"),
                            c10::List<std::optional<at::Scalar>>(), std::optional<std::string>(std::string(""))};
    op.callBoxed(&stack);
    return stack[0].toTensor().to(at::kFloat);
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
    at::Tensor y = bf16 ? bf16_product(x, packed[index]) : at::empty({M, O}, x.options());
    float *out = y.data_ptr<float>();
    if (bf16) {          /* many rows in bfloat16: done above, the bias below */
    } else if (e[BITS] == 32) { /* float32: tinyvllm/cpu_gemv.c, as tinyvllm.model.Linear runs it */
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
    if (!a || query.scalar_type() != at::kFloat || query.dim() != 3 || key.scalar_type() != at::kFloat
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
    reinterpret_cast<AttentionFn>(a[A_FN])(q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), k_cache,
        k_cache + a[V_OFFSET], (const int64_t *)a[SLOTS], (const int64_t *)a[TABLES], (const int64_t *)a[LENS],
        out.data_ptr<float>(), scratch(B * H * a[MAX_LEN]), B, H, a[KV_HEADS], d, a[BLOCK], a[TABLE_STRIDE],
        a[MAX_LEN], (float)(1.0 / std::sqrt((double)d)));
    return out;
}

TORCH_LIBRARY_FRAGMENT(tinyvllm, m) {
    m.def("use_packed(Tensor[] weights, int[] from_rows) -> ()", &use_packed);
}

TORCH_LIBRARY_IMPL(tinyvllm, CPU, m) {
    m.impl("opaque_linear", opaque_linear);
    m.impl("unified_attention", unified_attention);
}
