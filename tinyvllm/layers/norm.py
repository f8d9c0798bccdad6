"""`RMSNorm`, with vLLM's fused residual add.

    y = x / sqrt(mean(x^2) + eps) * weight          (the mean over the hidden size, in float32)

A decoder layer adds each block's output to the residual stream and normalizes the sum for the
next block; vLLM's `RMSNorm.forward(x, residual)` does both, returning the normalized sum and the
sum (the new residual), so a faster implementation can do them in one pass over the row (phase
4's `CpuRMSNorm`).
"""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); given `residual`, (norm(x + residual), x + residual)."""
        if residual is not None:
            x = x + residual
            return self.norm(x), x
        return self.norm(x)

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()  # the variance in float32, as the reference does, whatever the model dtype
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)
