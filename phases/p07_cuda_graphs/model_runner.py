"""Phase 7's model runner: decode-only steps on the persistent batch and the static buffers.

A step in which every scheduled request computes exactly its newest token (no prefill chunk, no
draft, no more requests than the largest bucket) runs here: the persistent `InputBatch` takes
what changed since the last step, its rows are copied into the `StaticDecodeBuffers`, and the
decode runner (`DecodeRunner`, a captured graph on a GPU, a compiled forward on a CPU) runs the
forward on the bucket just above their number where its shapes are fixed (a graph's; padded
rows write to the scratch block), or on just their rows (a CPU's).
Every other step goes to the runner this one wraps, the phase before's, unchanged.

Its output carries the batch's sampling parameters as tensors, in the step's row order, read
from the persistent batch (`ModelRunnerOutput.sampling`): the sampler does not read them again
from every sequence.
"""

from __future__ import annotations

import torch

from tinyvllm.sampler import SamplingTensors
from tinyvllm.step import ModelRunnerOutput, SchedulerOutput

from .decode_runner import StaticDecodeBuffers, bucket_for
from .input_batch import InputBatch


class StaticModelRunner:
    """The model runner for decode-only steps; `inner` (the phase before's) runs the others."""

    def __init__(self, inner, input_batch: InputBatch, buffers: StaticDecodeBuffers, decode_runner,
                 capture_sizes: list[int], checked: bool = False):
        self.inner, self.input_batch, self.buffers = inner, input_batch, buffers
        self.decode_runner, self.capture_sizes = decode_runner, capture_sizes
        self.checked = checked                 # checked mode: the persistent batch checked each step
        self.num_static_steps = 0              # steps run on the static buffers (for tests)

    def is_static_decode(self, plan: SchedulerOutput) -> bool:
        """True for a step the static path runs: every request computes just its newest token."""
        return (len(plan.scheduled) <= self.capture_sizes[-1]
                and all(n == 1 and seq.num_computed_tokens == seq.num_tokens - 1 for seq, n in plan.scheduled))

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        """`ModelRunner.execute`'s contract: the logits of the sequences whose last token was computed."""
        if not self.is_static_decode(plan):
            return self.inner.execute(plan)
        seqs = [seq for seq, _ in plan.scheduled]
        ib = self.input_batch
        rows, n = ib.sync(seqs), ib.num_reqs      # each sequence's row, in the plan's order; how many rows
        if self.checked:
            ib.check(seqs, rows)
        bucket = bucket_for(n, self.capture_sizes) if self.decode_runner.fixed_shapes else n   # a graph's shape
        in_rows = [seq for _, seq in sorted(zip(rows, seqs), key=lambda pair: pair[0])]   # in the logits' order
        sampling = SamplingTensors(ib.temperature[:n], ib.top_k[:n], ib.top_p[:n], ib.min_p[:n], ib.generators[:n])
        self.buffers.fill(ib.token_ids[:n], ib.num_computed[:n], ib.block_table[:n], ib.num_blocks[:n], bucket)
        ib.num_computed[:n] += 1
        self.num_static_steps += 1
        logits = self.decode_runner.run(bucket)[:n]     # (n, V): the padded rows dropped
        return ModelRunnerOutput(logits, in_rows, sampling=sampling)   # not gathered into the plan's: 9 MB at 48
