"""`Linear`: y = x W^T + b, PyTorch's product (`F.linear`).

On a CPU the speed of a matrix product depends on the library that runs it and on its shape far
more than on its arithmetic; phase 4 replaces these modules by its `CpuLinear`, which routes each
product by its row count, and phase 5 by layers that read quantized weights. Each keeps this
module's weight and bias Parameters, so a tied LM head stays tied.
"""

from __future__ import annotations

from torch import nn


class Linear(nn.Linear):
    """`nn.Linear` under the names vLLM's and Hugging Face's checkpoints use (`weight`, `bias`)."""

    @classmethod
    def like(cls, linear: nn.Linear, **attrs) -> "Linear":
        """A module of this class holding `linear`'s very weight and bias (no copy), with `attrs`
        set on it: how a phase gives a layer another implementation."""
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        new.weight, new.bias = linear.weight, linear.bias
        for name, value in attrs.items():
            setattr(new, name, value)
        return new
