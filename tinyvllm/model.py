"""A Llama-family decoder in plain PyTorch: RMSNorm, RoPE, grouped-query attention, SwiGLU.

The same code runs every family `tinyvllm.registry` lists (Llama, Mistral, Qwen2, Qwen3): what
differs between them is a few switches of `ModelConfig` (biases on the projections, an RMSNorm
over each head's q and k).

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

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from tinyvllm.config import ModelConfig
from tinyvllm.layers import Linear, RMSNorm, RotaryEmbedding


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
        out = attn(self.layer_idx, q, k, v)                             # (N, H, d)
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        h, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = Linear(h, i, bias=bias)
        self.up_proj = Linear(h, i, bias=bias)
        self.down_proj = Linear(i, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    """Attention then the MLP, each on the normalized residual stream, each output added to it.

    As in vLLM, the stream is carried beside the block's output (`residual`) and the add is left
    to the next norm, `norm(x, residual) -> (norm(x + residual), x + residual)`, which a faster
    RMSNorm does in one pass: the same sums as `x = x + block(norm(x))`."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: tuple,
                attn: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor]:
        """(the last block's output, the stream before it; None for the first layer) -> this
        layer's MLP output and the stream before it, each (N, D)."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, rope, attn)
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

    def forward(self, input_ids, positions, attn):
        x = self.embed_tokens(input_ids)                                # (N, D)
        cos, sin = self.rotary_emb(positions, x.dtype)                  # (N, 1, d) each
        rope, residual = (cos, sin, self.rotary_emb.rotate), None
        for layer in self.layers:
            x, residual = layer(x, residual, rope, attn)
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
