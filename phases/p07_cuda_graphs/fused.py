"""Fewer operator calls per layer, the same numbers: fused projections and a leaner decode forward.

    q_proj, k_proj, v_proj  (x @ Wq^T, x @ Wk^T, x @ Wv^T)  ->  qkv_proj: x @ [Wq; Wk; Wv]^T, split
    gate_proj, up_proj                                      ->  gate_up_proj: x @ [Wg; Wu]^T, split

vLLM's model files load the weights fused this way (`QKVParallelLinear`,
`MergedColumnParallelLinear`). Each output column is still the same dot product of x with the
same weight row; what changes is the number of operator calls per layer (5 products -> 2), each
a few microseconds of dispatch on a CPU, a kernel launch on a GPU. Done once at engine start, on
float layers (`tinyvllm.layers.Linear`, phase 4's `CpuLinear`) and on phase 5's quantized ones
alike: int8 keeps a scale per
output row and int4 its groups within a row, so stacking the quantized rows (and their scales) is
the quantization of the stacked float rows, exactly. There it pays most: each int8 call quantizes
its activations and crosses into phase 5's C kernel, a fixed cost whatever the weight's size.
Phase 5's `LosslessLinear` layers fuse as float ones, and the codes of the stacked rows are found
again.

`decode_forward` is the model's forward written with fewer operators around those products
(vLLM's fused residual add + RMSNorm, one rotation for q and k together), for the decode steps
of a fused model; its outputs are the model's own, bit for bit, but where the fused add + RMSNorm
is one C call (phase 4's `fused_add_rms_norm`, where the platform's `c_norm_decode` rule says),
which sums the squares in its own order (float32 rounding apart).

A prompt's fused MLP can stay in bfloat16 between its two products (phase 4's `bf16_mlp`, where
the platform's `bf16_mlp` rule says and both products are oneDNN's bfloat16 ones): half the bytes
of float32's and no float32 copy of the widest activation.

`layer_row` describes a layer's product for a caller in C: the kernel's address and the
weight's pointers and sizes. tinyvllm's `CStep` (cpu_step.c) runs `decode_forward`'s layers in
one C call from these rows, and the compiled step's C++ operators (cpu_ops.cpp) read them too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from phases.p04_triton_kernels.cpu_layers import GEMV, CpuLinear, bf16_mlp, fused_add_rms_norm
from phases.p05_quantization import cpu_int8
from phases.p05_quantization.lossless import LOSSLESS, LosslessLinear, lossless
from phases.p05_quantization.quant import QuantizedLinear
from tinyvllm import platform
from tinyvllm.layers import Linear, RMSNorm, SiluAndMul
from tinyvllm.model import LlamaAttention, LlamaMLP


def _fuse_quantized(layers: list[QuantizedLinear]) -> QuantizedLinear | None:
    first = layers[0]
    if len({(m.method, m.group_size, m.kernel, m.dtype, m.bias is None) for m in layers}) > 1:
        return None
    # the layers' quantized rows stacked (quantizing the float rows again is what we avoid);
    # the fused layer stores them in its kernel's layout
    rows = torch.cat([m.int8_rows() if m.method == "int8" else m.qweight for m in layers])
    zero = torch.cat([m.zero for m in layers]) if first.method == "int4" else None
    bias = None if first.bias is None else torch.cat([m.bias for m in layers])
    return QuantizedLinear.from_quantized(rows, torch.cat([m.scale for m in layers]), zero, bias,
                                          first.method, first.group_size, first.kernel, first.dtype)


def _fuse(layers: list) -> torch.nn.Module | None:
    if all(type(m) is QuantizedLinear for m in layers):
        return _fuse_quantized(layers)
    float_types = {type(m) if type(m) is not LosslessLinear else CpuLinear for m in layers}
    if len(float_types) > 1 or not float_types <= {Linear, CpuLinear}:
        return None
    w = torch.cat([m.weight.detach() for m in layers])
    bias = None if layers[0].bias is None else torch.cat([m.bias.detach() for m in layers])
    fused = float_types.pop()(w.shape[1], w.shape[0], bias=bias is not None, device="meta")   # Linear or CpuLinear
    fused.weight, fused.bias = (None if t is None else torch.nn.Parameter(t, requires_grad=False) for t in (w, bias))
    return lossless(fused) if all(type(m) is LosslessLinear for m in layers) else fused   # the codes found again


class FusedLlamaAttention(torch.nn.Module):
    """`LlamaAttention` with q, k and v from one product."""

    def __init__(self, unfused: LlamaAttention, qkv_proj: torch.nn.Module):
        super().__init__()
        self.layer_idx, self.head_dim = unfused.layer_idx, unfused.head_dim
        self.num_heads, self.num_kv_heads = unfused.num_heads, unfused.num_kv_heads
        self.qkv_proj, self.o_proj = qkv_proj, unfused.o_proj
        self.q_norm, self.k_norm = unfused.q_norm, unfused.k_norm       # None but on Qwen3

    def forward(self, x, rope, attn):
        n, h, kvh, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = self.qkv_proj(x).split([h * d, kvh * d, kvh * d], dim=-1)
        q, k, v = q.reshape(n, h, d), k.reshape(n, kvh, d), v.reshape(n, kvh, d)   # (N, H, d), (N, KVH, d) x 2
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin, rotate = rope
        q, k = rotate(q, k, cos, sin)
        out = attn(self.layer_idx, q, k, v)                              # (N, H, d)
        return self.o_proj(out.reshape(n, h * d))


class FusedLlamaMLP(torch.nn.Module):
    """`LlamaMLP` with gate and up from one product (and its activation vLLM's `SiluAndMul`)."""

    def __init__(self, unfused: LlamaMLP, gate_up_proj: torch.nn.Module):
        super().__init__()
        self.gate_up_proj, self.down_proj, self.act_fn = gate_up_proj, unfused.down_proj, SiluAndMul()
        self.bf16 = bool(platform.current().rule("bf16_mlp"))   # a prompt's MLP in bfloat16 (phase 4's bf16_mlp)

    def forward(self, x):
        if self.bf16 and (y := bf16_mlp(self.gate_up_proj, self.down_proj, x)) is not None:
            return y
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


def fuse_projections(model: torch.nn.Module) -> int:
    """Fuse every decoder layer's q/k/v and gate/up projections, replacing its attention and MLP
    modules. Returns how many modules were fused."""
    count = 0
    for layer in model.model.layers:
        if type(layer.self_attn) is LlamaAttention:
            a = layer.self_attn
            fused = _fuse([a.q_proj, a.k_proj, a.v_proj])
            if fused is not None:
                layer.self_attn = FusedLlamaAttention(a, fused)
                count += 1
        if type(layer.mlp) is LlamaMLP:
            m = layer.mlp
            fused = _fuse([m.gate_proj, m.up_proj])
            if fused is not None:
                layer.mlp = FusedLlamaMLP(m, fused)
                count += 1
    return count


def fused_model(model: torch.nn.Module) -> bool:
    """True when every decoder layer was fused (what `decode_forward` needs)."""
    return all(type(layer.self_attn) is FusedLlamaAttention and type(layer.mlp) is FusedLlamaMLP
               for layer in model.model.layers)


def rms_norm(x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
    """`norm(x)`. In float32 `F.rms_norm` computes exactly `RMSNorm`'s numbers in one operator
    call instead of the module's eight (another dtype takes the module, whose variance is in
    float32)."""
    if x.dtype != torch.float32:
        return norm(x)
    return F.rms_norm(x, norm.weight.shape, norm.weight, norm.eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm, c_norm: bool = False):
    """vLLM's fused residual add + RMSNorm: residual <- x + residual, returns (norm(residual),
    residual). With `c_norm`, in float32 on a CPU one C call, `fused_add_rms_norm` (x overwritten)."""
    if c_norm and (fused := fused_add_rms_norm(x, residual, norm)) is not None:
        return fused
    residual = x if residual is None else x + residual
    return rms_norm(residual, norm), residual


def decode_forward(model: torch.nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
                   attn, c_norm: bool = False) -> torch.Tensor:
    """`model.forward` for a fused model, with fewer operators: the same hidden states (N, D).

    What it saves per layer, against `LlamaDecoderLayer` and the fused modules above:
    - the residual add and the next RMSNorm as `add_rms_norm` (one call or two instead of nine;
      one C call each with `c_norm`);
    - Qwen3's per-head norms of q and k as one `F.rms_norm` call each;
    - RoPE once on q and k together (they sit side by side in qkv_proj's output), with
      `rotate_half(x) * sin` written as `roll(x, d/2) * [-sin, sin]`: the same products,
      since the two halves of `sin` are equal (one roll instead of chunk, neg and cat, twice);
    - no module calls around it: the loop reads the weights' modules and the rotary tables
      directly, and writes the SiLU and product inline (`SiluAndMul`'s two operators).
    """
    m = model.model
    x = m.embed_tokens(input_ids)                                     # (N, D)
    cos, sin = (t[positions].unsqueeze(1).to(x.dtype) for t in (m.rotary_emb.cos, m.rotary_emb.sin))  # (N, 1, d)
    n, half = x.shape[0], cos.shape[-1] // 2
    sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)      # [-sin, sin], once a step
    h, residual = add_rms_norm(x, None, m.layers[0].input_layernorm, c_norm)
    for i, layer in enumerate(m.layers):
        a = layer.self_attn
        hq, hkv, d = a.num_heads, a.num_kv_heads, a.head_dim
        qkv = a.qkv_proj(h).view(n, hq + 2 * hkv, d)                  # (N, H + 2 KVH, d)
        qk = qkv[:, : hq + hkv]
        if a.q_norm is not None:                                      # Qwen3: before RoPE
            qk = torch.cat((rms_norm(qk[:, :hq], a.q_norm), rms_norm(qk[:, hq:], a.k_norm)), dim=1)
        qk = qk * cos + qk.roll(half, dims=-1) * sin                  # RoPE on q and k at once
        out = attn(a.layer_idx, qk[:, :hq], qk[:, hq:], qkv[:, hq + hkv:])   # (N, H, d)
        h, residual = add_rms_norm(a.o_proj(out.reshape(n, hq * d)), residual,
                                   layer.post_attention_layernorm, c_norm)
        nxt = m.layers[i + 1].input_layernorm if i + 1 < len(m.layers) else m.norm
        mlp = layer.mlp
        y = bf16_mlp(mlp.gate_up_proj, mlp.down_proj, h) if mlp.bf16 else None   # a prompt's rows only
        if y is None:
            gate, up = mlp.gate_up_proj(h).chunk(2, dim=-1)
            y = mlp.down_proj(F.silu(gate) * up)
        h, residual = add_rms_norm(y, residual, nxt, c_norm)
    return h


def layer_row(m: torch.nn.Module) -> list[int]:
    """A layer's product as a C caller runs it (the compiled step's cpu_ops.cpp, tinyvllm's
    cpu_step.c): the C product its kernel runs, its kind (4, 8 or 32 bits; 1 for float32 read
    from codes, their bits in the group field), the weight's pointers
    (values, scales, zero points, bias), its sizes and group, the row count from which another
    kernel serves (`dequant_sgemm`, or PyTorch's float32 product); zeros where its kernel is none
    of phase 5's C ones over a weight as it is stored (cpu_ops.cpp calls the layer from Python)."""
    kernel = m.choose_kernel(1) if type(m) is QuantizedLinear else None
    if type(m) is CpuLinear and m.gemv_max_rows():   # float32 (phase 4's): cpu_gemv.c
        fn, kind, tensors = GEMV.address("f32_matmul"), 32, (m.weight, None, None)
        group, many = 1, m.gemv_max_rows() + 1
    elif type(m) is LosslessLinear and m.max_rows and LOSSLESS.available():   # float32 from its codes
        fn, kind, tensors = LOSSLESS.address("lossless_matmul"), 1, (m.codes, m.scale, m.zero)
        group, many = m.bits, m.own_rows(m.max_rows) + 1
    elif (kernel == "cpu_int4" or kernel == "cpu_int8" and m.layout == "rows") and cpu_int8.AVX2.available():
        four = kernel == "cpu_int4"
        tensors = (m.qweight, *m.packed("scales")) if four else (m.qweight, m.scale, None)
        fn = cpu_int8.AVX2.address(cpu_int8.INT4_FNS[tensors[1].dtype] if four else "int8_matmul")
        kind, group, many = 4 if four else 8, m.group_size if four else 1, m.dequant_from_rows() or 1 << 62
    else:
        return [0] * 10
    return [fn, kind, *(0 if t is None else t.data_ptr() for t in (*tensors, m.bias)), m.out_features, m.in_features,
            group, many]
