"""A decode step's decoder layers in one C call (cpu_step.c): `CStep`.

An eager decode step on a CPU spends a third of its time between the kernels: each of the 592
PyTorch operator calls and 211 ctypes calls of `decode_forward` at batch 1 on the default model
costs microseconds in the interpreter. A CUDA graph removes that on a GPU and torch.compile
does on a CPU, once its graphs are made (a minute of compiling, seconds to read back).
cpu_step.c removes it at once: it is `decode_forward` (fused.py: fused q/k/v and gate/up
projections, the residual add fused with RMSNorm, Qwen3's per-head norms, one RoPE for q and k)
written as a C loop over the layers, the way llama.cpp runs a model, calling the kernels the
eager step calls by their addresses.

What each product's kernel is, the caller says, as a row of ten integers per layer
(`row_of(module)`: fused.py's `layer_row`, the same rows the compiled step's C++ operators
read), and so for the attention (phase 4's `attention_row`, a step's). The embedding, the
rotary table and the LM head stay in PyTorch: once a step each.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Callable

import torch

from phases.p04_triton_kernels.cpu_layers import NORM
from tinyvllm.ckernel import CKernel
from tinyvllm.hardware import AVX2_FLAGS

P = ctypes.c_void_p
STEP = CKernel(Path(__file__).with_name("cpu_step.c"), ["-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-shared",
               "-fPIC"], AVX2_FLAGS, {"decode_layers": [P, ctypes.c_int64, P, P, P, P, ctypes.c_float]},
               fallback="decode steps run in PyTorch")
FIELDS = 10   # a product's row: its kernel (0: none in C), kind, four pointers, out, in, group, rows it serves to


class CStep:
    """The decoder layers of a fused model (`qkv_proj`, `gate_up_proj`) in one call of cpu_step.c.

    `step(input_ids, positions, attention)`, attention a step's row (phase 4's `attention_row`),
    gives the final norm's output (N, D), or None where it does not serve. It serves up to
    `max_rows` rows, the fewest any product's kernel takes; none (0) where a product has no C
    kernel or the model is not float32 or has norms of different eps; and none from the first
    step whose attention is not phase 4's C kernel. Where it is built at all is the platform's
    `c_step` rule (the decode runner asks)."""

    def __init__(self, model: torch.nn.Module, row_of: Callable[[torch.nn.Module], list[int]]):
        self.model, m, self.max_rows = model, model.model, 0
        layers = m.layers
        if not all(hasattr(la.self_attn, "qkv_proj") and hasattr(la.mlp, "gate_up_proj") for la in layers) \
                or m.embed_tokens.weight.dtype != torch.float32 or not STEP.available():   # its C is float32's
            return
        nexts = [la.input_layernorm for la in layers[1:]] + [m.norm]      # the norm after each layer
        qk_norms = [() if getattr(la.self_attn, "q_norm", None) is None else (la.self_attn.q_norm, la.self_attn.k_norm)
                    for la in layers]                                   # Qwen3's per-head norms
        rows = [[la.post_attention_layernorm.weight.data_ptr(), nxt.weight.data_ptr()]
                + ([n.weight.data_ptr() for n in qk] or [0, 0])
                + [x for p in (la.self_attn.qkv_proj, la.self_attn.o_proj, la.mlp.gate_up_proj, la.mlp.down_proj)
                   for x in row_of(getattr(p, "layer", p))]   # a wrapper's own layer (phase 7's OpaqueLinear)
                for la, nxt, qk in zip(layers, nexts, qk_norms)]
        self.plan = torch.tensor(rows, dtype=torch.int64)                # (L, 4 norms + 4 products x FIELDS)
        products = self.plan[:, 4:].reshape(-1, FIELDS)
        eps = {m.norm.eps} | {n.eps for la, qk in zip(layers, qk_norms)
                              for n in (la.input_layernorm, la.post_attention_layernorm, *qk)}
        if not ((products[:, 0] != 0).all() and len(eps) == 1 and NORM.available()):
            return
        self.max_rows = int(products[:, 9].min()) - 1
        a = layers[0].self_attn
        self.sizes = (m.embed_tokens.weight.shape[1], a.num_heads, a.num_kv_heads, a.head_dim,
                      layers[0].mlp.gate_up_proj.out_features // 2)
        self.norm = (NORM.address("add_rms_norm"), layers[0].input_layernorm.weight.data_ptr())
        self.widest = int(products[:, 7].max())   # the widest product's input: its scratch

    def serves(self, rows: int) -> bool:
        return 0 < rows <= self.max_rows

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 attention: torch.Tensor | None) -> torch.Tensor | None:
        if not self.serves(n := len(input_ids)):
            return None
        if attention is None:        # the engine's attention part is not phase 4's C kernel
            self.max_rows = 0
            return None
        m = self.model.model
        x = m.embed_tokens(input_ids)                                    # (N, D): the residual stream
        cos, sin = m.rotary_emb(positions, x.dtype)                      # (N, 1, d) each
        _, H, KVH, d, F = self.sizes
        # cpu_step.c's buffers: q/k/v, then q, k and v apart; the attention's output and scores;
        # gate/up and SiLU x up; what an int8 or int4 product rounds its input into
        longest = int(attention[5])                                      # the step's longest sequence
        work = torch.empty(n * (2 * (H + 2 * KVH) * d + H * (d + longest) + 3 * F + self.widest + 32))
        h = torch.empty_like(x)
        shape = torch.tensor([n, *self.sizes, cos.data_ptr(), sin.data_ptr(), *self.norm, work.data_ptr()])
        STEP.lib.decode_layers(self.plan.data_ptr(), len(self.plan), attention.data_ptr(), shape.data_ptr(),
                               x.data_ptr(), h.data_ptr(), m.norm.eps)
        return h
