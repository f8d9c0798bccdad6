"""Rotary position embedding (RoPE): each pair of a head's values rotated by its position's angle.

`RotaryEmbedding` keeps the cos/sin tables of every position (Llama 3.x's "llama3" and linear
scaling applied to the frequencies) and looks up a step's rows once, shared by every layer;
`rotate(q, k, cos, sin)` rotates q and k. A faster implementation overrides `rotate` (phase 4's
`CpuRotaryEmbedding`).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tinyvllm.config import ModelConfig


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Per-pair rotation frequencies, with Llama 3.x ("llama3") or linear scaling applied."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = config.rope_scaling
    if not scaling:
        return inv_freq
    rope_type = scaling.get("rope_type", scaling.get("type"))
    factor = float(scaling["factor"])
    if rope_type == "linear":
        return inv_freq / factor
    # llama3: low frequencies (long wavelengths) are slowed by `factor`, high ones kept, and the
    # band between is blended smoothly. Same formula as Meta's reference and transformers.
    low_ff = float(scaling.get("low_freq_factor", 1.0))
    high_ff = float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling.get("original_max_position_embeddings", 8192))
    low_freq_wavelen = old_len / low_ff
    high_freq_wavelen = old_len / high_ff
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low_ff) / (high_ff - low_ff)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[x1, x2] -> [-x2, x1] over the last dimension (Hugging Face's half layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotate each (i, i + d/2) pair of q (N, H, d) and k (N, KVH, d) by its position's angle."""
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to `max_positions`, looked up per token (`tables`:
    another module's, shared)."""

    def __init__(self, config: ModelConfig, max_positions: int, tables: tuple | None = None):
        super().__init__()
        self.config, self.max_positions = config, max_positions
        # on the CPU even while the model is built on the meta device (weights.load_model): there
        # this arithmetic would first import much of PyTorch's compiler (~2 s, once per process)
        with torch.device("cpu"):
            cos, sin = tables or self._tables()
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = rope_inv_freq(self.config)
        t = torch.arange(self.max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)                       # (P, d/2)
        emb = torch.cat((freqs, freqs), dim=-1)                # (P, d): Hugging Face's half layout
        return emb.cos(), emb.sin()

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The (cos, sin) rows of the step's positions, each (N, 1, d): looked up once per step,
        shared by every layer."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)

    def rotate(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """q and k rotated by the step's (cos, sin) rows (`apply_rotary`)."""
        return apply_rotary(q, k, cos, sin)
