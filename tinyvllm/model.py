"""A Llama-family decoder in plain PyTorch: RMSNorm, RoPE, grouped-query attention, SwiGLU.

The same code runs every family `tinyvllm.registry` lists (Llama, Mistral, Qwen2, Qwen3, Gemma 3):
what differs between them is a few switches of `ModelConfig` (biases on the projections, an
RMSNorm over each head's q and k, Gemma's extra norms, embedding scale and GELU gate). Which
layers attend in a sliding window is the attention backend's business: the model only tells
each layer's rotary table apart (Gemma 3's windowed layers use a RoPE base of their own).

The model works on a *flat* batch of tokens, the way vLLM does: `input_ids` and `positions` are
1-D tensors of N tokens that may belong to several sequences. The model never needs to know how
the tokens are grouped: that knowledge lives in the *attention backend* passed to `forward`.
Every phase of tinyvllm plugs in its own backend (naive attention, paged attention, Triton
kernels, ...) and leaves the rest of the model untouched.

    backend(layer_idx, q, k, v) -> out      # q: (N, H, d)  k, v: (N, KVH, d)  out: (N, H, d)

Its layers are `tinyvllm.layers`' plain ones; a phase that brings faster ones (phase 4's CPU
kernels, phase 5's quantized products, phase 7's fused projections) swaps modules of the same
interface in when its recipe builds the model. Parameter names match Hugging Face's
`LlamaForCausalLM` (and Qwen3's `q_norm`/`k_norm`), so a checkpoint loads by name.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from tinyvllm.config import ModelConfig
from tinyvllm.layers import Linear, RMSNorm, RotaryEmbedding
from tinyvllm.registry import SLIDING


class AttentionBackend(Protocol):
    """What a phase plugs into the model: attention over whatever tokens the step holds."""

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> torch.Tensor: ...


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        h, d, bias = config.hidden_size, config.head_dim, config.qkv_bias
        self.q_proj = Linear(h, self.num_heads * d, bias=bias)
        self.k_proj = Linear(h, self.num_kv_heads * d, bias=bias)
        self.v_proj = Linear(h, self.num_kv_heads * d, bias=bias)
        self.o_proj = Linear(self.num_heads * d, h, bias=config.o_bias)
        # Qwen3: each head's q and k normalized over its d values (one weight of d, every head)
        self.q_norm = RMSNorm(d, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(d, config.rms_norm_eps) if config.qk_norm else None
        # Gemma 3 scales scores by 1/sqrt(query_pre_attn_scalar), every backend by 1/sqrt(d): q
        # times the ratio gives the family's scores through any backend
        self.q_scale = config.query_scale * d ** 0.5 if config.query_scale else None

    def forward(self, x: torch.Tensor, rope: tuple, attn: AttentionBackend) -> torch.Tensor:
        """x (N, D) -> (N, D). rope: the step's (cos, sin) rows and the function that rotates by
        them (`RotaryEmbedding.rotate`)."""
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.num_heads, self.head_dim)      # (N, H, d)
        k = self.k_proj(x).view(n, self.num_kv_heads, self.head_dim)   # (N, KVH, d)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)   # (N, KVH, d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin, rotate = rope
        q, k = rotate(q, k, cos, sin)
        if self.q_scale is not None:
            q = q * self.q_scale
        out = attn(self.layer_idx, q, k, v)                             # (N, H, d)
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        h, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = Linear(h, i, bias=bias)
        self.up_proj = Linear(h, i, bias=bias)
        self.down_proj = Linear(i, h, bias=bias)

        # SwiGLU's SiLU, or Gemma's GELU with the tanh approximation
        self.gelu = config.hidden_act == "gelu_pytorch_tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj(x)
        gate = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.down_proj(gate * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    """Attention then the MLP, each on the normalized residual stream, each output added to it.

    As in vLLM, the stream is carried beside the block's output (`residual`) and the add is left
    to the next norm, `norm(x, residual) -> (norm(x + residual), x + residual)`, which a faster
    RMSNorm does in one pass: the same sums as `x = x + block(norm(x))`.

    Gemma 3 (`post_norms`) normalizes each block's output too before adding it: its
    `post_attention_layernorm` is that norm of attention's output, and `pre_feedforward_layernorm`
    the MLP's input norm (what Llama calls post_attention_layernorm)."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = LlamaAttention(config, layer_idx)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.post_norms = config.post_norms
        if config.post_norms:
            self.pre_feedforward_layernorm = RMSNorm(h, eps)
            self.post_feedforward_layernorm = RMSNorm(h, eps)
        self.is_sliding = bool(config.layer_types) and config.layer_types[layer_idx] == SLIDING

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: tuple,
                attn: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor]:
        """(the last block's output, the stream before it; None for the first layer) -> this
        layer's MLP output and the stream before it, each (N, D)."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, rope, attn)
        if self.post_norms:
            x = self.post_attention_layernorm(x)
            x, residual = self.pre_feedforward_layernorm(x, residual)
            return self.post_feedforward_layernorm(self.mlp(x)), residual
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int):
        super().__init__()
        # `_weight`: no random init, the weights are always loaded (weights.load_model). On the
        # meta device the init (normal_) would cost ~2 s of PyTorch imports, once per process.
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config, max_positions)
        # Gemma 3's windowed layers rotate with a base of their own (10,000; its global ones 1M)
        self.local_rotary_emb = None
        if config.local_rope_theta is not None:
            local = dataclasses.replace(config, rope_theta=config.local_rope_theta, rope_scaling=None)
            self.local_rotary_emb = RotaryEmbedding(local, max_positions)
        self.embedding_scale = config.embedding_scale

    def forward(self, input_ids, positions, attn):
        x = self.embed_tokens(input_ids)                                # (N, D)
        if self.embedding_scale is not None:   # Gemma: sqrt(hidden), rounded to the model's dtype
            x = x * torch.tensor(self.embedding_scale, dtype=x.dtype)
        cos, sin = self.rotary_emb(positions, x.dtype)                  # (N, 1, d) each
        rope, residual = (cos, sin, self.rotary_emb.rotate), None
        local_rope = rope
        if self.local_rotary_emb is not None:
            local_rope = (*self.local_rotary_emb(positions, x.dtype), self.local_rotary_emb.rotate)
        for layer in self.layers:
            x, residual = layer(x, residual, local_rope if layer.is_sliding else rope, attn)
        return self.norm(x) if residual is None else self.norm(x, residual)[0]


class LlamaForCausalLM(nn.Module):
    """The decoder plus the LM head. `forward` returns hidden states; `compute_logits` turns the
    rows you need (usually the last token of each sequence) into vocabulary scores. Every family
    of `tinyvllm.registry` is this class with its config's switches."""

    def __init__(self, config: ModelConfig, max_positions: int | None = None):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, max_positions or config.max_position_embeddings)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn: AttentionBackend) -> torch.Tensor:
        """input_ids, positions: (N,) -> hidden states (N, D)."""
        return self.model(input_ids, positions, attn)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(M, D) -> (M, V) float32 logits."""
        return self.lm_head(hidden).float()
