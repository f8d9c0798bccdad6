"""Fused projections: one matrix product where the model does two or three on the same input.

    q_proj, k_proj, v_proj  (x @ Wq^T, x @ Wk^T, x @ Wv^T)  ->  qkv_proj: x @ [Wq; Wk; Wv]^T, split
    gate_proj, up_proj                                      ->  gate_up_proj: x @ [Wg; Wu]^T, split

vLLM's model files load the weights fused this way (`QKVParallelLinear`,
`MergedColumnParallelLinear`). Each output column is still the same dot product of x with the
same weight row; what changes is the number of operator calls per layer (5 products -> 2), each
a few microseconds of dispatch on a CPU, a kernel launch on a GPU. Done once at engine start, on
plain `tinyvllm.model.Linear` layers only (a quantized layer from phase 5 is left as it is).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tinyvllm.model import Linear, LlamaAttention, LlamaMLP, apply_rotary


def _fuse(layers: list[Linear]) -> Linear | None:
    if any(type(m) is not Linear for m in layers):
        return None
    w = torch.cat([m.weight.detach() for m in layers])
    bias = None if layers[0].bias is None else torch.cat([m.bias.detach() for m in layers])
    fused = Linear(w.shape[1], w.shape[0], bias=bias is not None, device="meta")
    fused.weight = torch.nn.Parameter(w, requires_grad=False)
    if bias is not None:
        fused.bias = torch.nn.Parameter(bias, requires_grad=False)
    return fused


class FusedLlamaAttention(LlamaAttention):
    """`LlamaAttention` with q, k and v from one product."""

    def forward(self, x, rope, attn):
        n, h, kvh, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = self.qkv_proj(x).split([h * d, kvh * d, kvh * d], dim=-1)
        q, k = q.reshape(n, h, d), k.reshape(n, kvh, d)                  # (N, H, d), (N, KVH, d)
        v = v.reshape(n, kvh, d)
        q, k = apply_rotary(q, k, *rope)
        out = attn(self.layer_idx, q, k, v)                              # (N, H, d)
        return self.o_proj(out.reshape(n, h * d))


class FusedLlamaMLP(LlamaMLP):
    """`LlamaMLP` with gate and up from one product."""

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


def fuse_projections(model: torch.nn.Module) -> int:
    """Fuse every decoder layer's q/k/v and gate/up projections in place. Returns how many
    modules were fused."""
    count = 0
    for module in model.modules():
        if type(module) is LlamaAttention:
            fused = _fuse([module.q_proj, module.k_proj, module.v_proj])
            if fused is not None:
                module.qkv_proj = fused
                del module.q_proj, module.k_proj, module.v_proj
                module.__class__ = FusedLlamaAttention
                count += 1
        elif type(module) is LlamaMLP:
            fused = _fuse([module.gate_proj, module.up_proj])
            if fused is not None:
                module.gate_up_proj = fused
                del module.gate_proj, module.up_proj
                module.__class__ = FusedLlamaMLP
                count += 1
    return count
