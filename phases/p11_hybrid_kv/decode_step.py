"""A step of decodes as phase 7 runs one, over every group's block tables.

Phase 7 runs a decode step of a fused model (its q/k/v and gate/up products fused) as one call
of cpu_step.c (`CStep`), or where that does not serve through `decode_forward`, the same layers
with fewer operators. Its static path keeps one block table per sequence in its persistent batch;
phase 11 keeps one per group, so its runner builds the step's inputs as phase 2's does (every
group's tables, `HybridMetadata`) and hands them to the same two: cpu_step.c reads, for each
layer, where its group's slots and tables lie (`group_attention_row`: phase 4's row of the step,
each layer's own place in its last field), and `decode_forward` calls the attention part, which
picks each layer's group. A model whose layers are not Llama's (Gemma 3) keeps its own forward.
"""

from __future__ import annotations

from functools import partial

import torch

from phases.p07_cuda_graphs.cpu_step import CStep
from phases.p07_cuda_graphs.fused import decode_forward, fused_model, layer_row

from .hybrid_attention import group_attention_row


class DecodeStep:
    """`step(input_ids, positions, attention)`: the final norm's output (N, D) of a step of
    decodes of a fused model. `c_norm`, `c_step`: the platform's rules (phase 7's `c_norm_decode`
    and `c_step`) on this engine's device."""

    def __init__(self, model: torch.nn.Module, c_norm: bool, c_step: bool):
        assert fused_model(model), "DecodeStep runs a fused model (phase 7's fuse_projections)"
        self.forward = partial(decode_forward, model, c_norm=c_norm)
        step = CStep(model, layer_row) if c_step else None
        self.c_step = step if step is not None and step.max_rows else None   # None: it serves no step
        self.num_c_steps = 0   # steps cpu_step.c ran (for tests)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, attention) -> torch.Tensor:
        if self.c_step is not None:
            hidden = self.c_step(input_ids, positions, group_attention_row(attention))
            if hidden is not None:
                self.num_c_steps += 1
                return hidden
        return self.forward(input_ids, positions, attention)
