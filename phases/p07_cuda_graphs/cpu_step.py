"""A decode step's layers in one C call (cpu_step.c): the eager step without Python between operators.

An eager decode step on a CPU spends a third of its time between the operators: each of some
450 PyTorch calls and 150 ctypes calls a step of the default model costs microseconds in the
interpreter. A CUDA graph removes that on a GPU and the compiled step does on a CPU, once made
(a minute of compiling, seconds to read back). `CStep` removes it at once, for the steps whose
every product has a C kernel (phase 5's, tinyvllm's cpu_gemv.c) and whose attention is phase 4's
C kernel over a float32 cache, up to the rows those kernels serve: cpu_step.c runs the layers
of `decode_forward`, calling the same kernels through the tables the compiled step's C++
operators read (`layer_row`, `attention_row`). Anything else (a GPU, oneDNN's products, Qwen3's
per-head norms, more rows) takes `decode_forward`.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from phases.p04_triton_kernels.cpu_attention import DECODE, CpuPagedAttention, c_decode_runs
from phases.p05_quantization import QuantizedLinear, cpu_int8
from phases.p05_quantization.lossless import LOSSLESS, LosslessLinear
from tinyvllm.ckernel import CKernel
from tinyvllm.hardware import AVX2_FLAGS
from tinyvllm.model import GEMV, NORM, Linear

from .fused import fused_model

P, I64 = ctypes.c_void_p, ctypes.c_int64
STEP = CKernel(Path(__file__).with_name("cpu_step.c"), ["-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-shared",
               "-fPIC"], AVX2_FLAGS, {"decode_layers": [P, I64, P, P, P, P, ctypes.c_float]},
               fallback="decode steps run decode_forward")


def layer_row(m) -> list[int]:
    """A layer's product as cpu_ops.cpp and cpu_step.c read it: the C product its kernel runs, its kind (4, 8 or
    32 bits; 1 for float32 read from codes, their bits in the group field), the weight's pointers
    (values, scales, zero points, bias), its sizes and group, the row count from which another
    kernel serves (`dequant_sgemm`, or PyTorch's float32 product); zeros where its kernel is none
    of phase 5's C ones over a weight as it is stored (cpu_ops.cpp calls the layer from Python)."""
    kernel = m.choose_kernel(1) if type(m) is QuantizedLinear else None
    if type(m) is Linear and m.gemv_max_rows():   # float32 (tinyvllm.model): cpu_gemv.c
        fn, kind, tensors = GEMV.address("f32_matmul"), 32, (m.weight, None, None)
        group, many = 1, m.gemv_max_rows() + 1
    elif type(m) is LosslessLinear and m.max_rows and LOSSLESS.available():   # float32 from its codes
        fn, kind, tensors = LOSSLESS.address("lossless_matmul"), 1, (m.codes, m.scale, m.zero)
        group, many = m.bits, m.max_rows + 1
    elif (kernel == "cpu_int4" or kernel == "cpu_int8" and m.layout == "rows") and cpu_int8.AVX2.available():
        four = kernel == "cpu_int4"
        fn, kind = cpu_int8.AVX2.address("int4_matmul" if four else "int8_matmul"), 4 if four else 8
        tensors, group = (m.qweight, m.scale, m.zero if four else None), m.group_size if four else 1
        many = m.dequant_from_rows() or 1 << 62
    else:
        return [0] * 10
    return [fn, kind, *(0 if t is None else t.data_ptr() for t in (*tensors, m.bias)), m.out_features, m.in_features,
            group, many]


def attention_row(attention) -> torch.Tensor | None:
    """The step's attention as cpu_ops.cpp reads it, where it is decodes through phase 4's
    `CpuPagedAttention` with its C kernel over a float32 cache: the C function, the step's
    slots, block table (and its row stride), lengths and longest length (the static buffers'
    tensors, contiguous: read in place), the block size, KV heads, and where the cache starts
    and each layer's K and V lie in it. None for any other step or attention part."""
    if type(attention) is not CpuPagedAttention or attention.meta.prefill_rows:
        return None
    meta, kv = attention.meta, attention.cache.kv        # kv: (layers, 2, blocks, block_size, KVH, d)
    tables, lens = meta.decode_block_tables, meta.decode_seq_lens
    if not c_decode_runs(kv, kv) or tables.stride(1) != 1 or not lens.is_contiguous():
        return None
    return torch.tensor([DECODE.address("paged_decode_attention"), meta.slot_mapping.data_ptr(), tables.data_ptr(),
                         tables.stride(0), lens.data_ptr(), meta.max_decode_seq_len, *kv.shape[3:5], kv.data_ptr(),
                         *kv.stride()[:2]])


class CStep:
    """`decode_forward` for `model` as one call of cpu_step.c: `step(ids, positions, attention)`
    gives the final norm's output (N, D), or None for a step it does not serve. `max_rows`: the
    most rows every product's C kernel takes (0: none, for this model's layers or this CPU)."""

    def __init__(self, model: torch.nn.Module):
        self.model, m, self.max_rows = model, model.model, 0
        if not fused_model(model) or m.layers[0].self_attn.q_norm is not None or not STEP.available():
            return
        norms = [(la.input_layernorm, la.post_attention_layernorm) for la in m.layers]
        products = [(la.self_attn.qkv_proj, la.self_attn.o_proj, la.mlp.gate_up_proj, la.mlp.down_proj) for la in m.layers]
        nexts = [first for first, _ in norms[1:]] + [m.norm]        # the norm after each layer
        rows = [[post.weight.data_ptr(), nxt.weight.data_ptr()]
                + [x for p in ps for x in layer_row(getattr(p, "layer", p))]   # an OpaqueLinear's own layer
                for (_, post), nxt, ps in zip(norms, nexts, products)]
        self.plan = torch.tensor(rows, dtype=torch.int64)                  # (L, 2 + 4 x 10)
        fields = self.plan[:, 2:].reshape(-1, 10)                          # one row a product
        if not ((fields[:, 0] != 0).all() and len({n.eps for n in (*sum(norms, ()), m.norm)}) == 1
                and NORM.available()):   # a product without a C kernel, or norms of different eps
            return
        self.max_rows = int(fields[:, 9].min()) - 1
        a = m.layers[0].self_attn
        self.sizes = (m.embed_tokens.weight.shape[1], a.num_heads, a.num_kv_heads, a.head_dim,
                      m.layers[0].mlp.gate_up_proj.out_features // 2)
        self.norm = (NORM.address("add_rms_norm"), norms[0][0].weight.data_ptr())
        self.most_in = int(fields[:, 7].max())   # the widest product's input: its scratch

    def serves(self, rows: int) -> bool:
        return 0 < rows <= self.max_rows

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, attention) -> torch.Tensor | None:
        if not self.serves(len(input_ids)):
            return None
        if (row := attention_row(attention)) is None:   # not phase 4's C kernel: this engine's part
            self.max_rows = 0
            return None
        n = len(input_ids)
        m = self.model.model
        x = m.embed_tokens(input_ids)                                     # (N, D), the residual stream
        cos, sin = m.rotary_emb(positions, x.dtype)                       # (N, 1, d) each
        _, H, KVH, d, F = self.sizes
        # cpu_step.c's buffers: q/k/v, then q, k, v apart; the attention's output and its scores;
        # gate/up and SiLU x up; what an int8 or int4 product rounds its input into
        work = torch.empty(n * (2 * (H + 2 * KVH) * d + H * (d + int(row[5])) + 3 * F + self.most_in + 32))
        h = torch.empty_like(x)
        shape = torch.tensor([n, *self.sizes, cos.data_ptr(), sin.data_ptr(), *self.norm, work.data_ptr()])
        STEP.lib.decode_layers(self.plan.data_ptr(), len(self.plan), row.data_ptr(), shape.data_ptr(), x.data_ptr(),
                               h.data_ptr(), m.norm.eps)
        return h
