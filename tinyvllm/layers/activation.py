"""`SiluAndMul`: SwiGLU's gate, vLLM's name for it.

The MLP of a Llama-family layer is down(silu(gate(x)) * up(x)). Where gate and up are one fused
product (phase 7's `gate_up_proj`), its output is [gate, up] side by side, and this module takes
that: silu(gate) * up, half the width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        """(M, 2I) [gate, up] -> (M, I)."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
