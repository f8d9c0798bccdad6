"""Phase 7's model runner: decode-only steps on the persistent batch and the static buffers.

A step in which every scheduled request computes exactly its newest token (no prefill chunk, no
draft, no more requests than the largest bucket) runs here: the persistent `InputBatch` takes
what changed since the last step, its rows are copied into the `StaticDecodeBuffers` of the
bucket just above their number (padded rows write to the scratch block), and the decode runner
(`DecodeRunner`, or `CudaGraphDecodeRunner` replaying a captured graph) runs the forward. Every
other step goes to the runner this one wraps, phase 6's, unchanged.

It also keeps that step's sampling parameters as tensors, in the step's row order, for the
vectorized sampler (`take_batch_params`).
"""

from __future__ import annotations

import torch

from tinyvllm.sequence import Sequence

from .decode_runner import StaticDecodeBuffers, bucket_for
from .input_batch import InputBatch


class StaticModelRunner:
    """The model runner for decode-only steps; `inner` (the phase before's) runs the others."""

    def __init__(self, inner, input_batch: InputBatch, buffers: StaticDecodeBuffers, decode_runner,
                 capture_sizes: list[int]):
        self.inner, self.input_batch, self.buffers = inner, input_batch, buffers
        self.decode_runner, self.capture_sizes = decode_runner, capture_sizes
        self.num_static_steps = 0              # steps run on the static buffers (for tests)
        self._batch_params: tuple | None = None

    def is_static_decode(self, batch: list[tuple[Sequence, int]]) -> bool:
        """True for a step the static path runs: every request computes just its newest token."""
        return (len(batch) <= self.capture_sizes[-1]
                and all(n == 1 and seq.num_computed_tokens == seq.num_tokens - 1 for seq, n in batch))

    @torch.inference_mode()
    def run(self, batch: list[tuple[Sequence, int]]) -> tuple[torch.Tensor, list[Sequence]]:
        """`ModelRunner.run`'s contract: the logits of the sequences whose last token was computed."""
        self._batch_params = None
        if not self.is_static_decode(batch):
            return self.inner.run(batch)
        seqs = [seq for seq, _ in batch]
        ib = self.input_batch
        rows = ib.sync(seqs)                      # rows 0..n-1, in the batch's own order
        n = ib.num_reqs
        bucket = bucket_for(n, self.capture_sizes)
        self.buffers.fill(ib.token_ids[:n], ib.num_computed[:n], ib.block_table[:n], ib.num_blocks[:n], bucket)
        logits = self.decode_runner.run(bucket)[:n]     # (n, V): the padded rows dropped
        for seq in seqs:
            seq.num_computed_tokens += 1
        ib.num_computed[:n] += 1
        order = torch.tensor(rows)
        self._batch_params = (ib.temperature[:n][order], ib.top_k[:n][order], ib.top_p[:n][order],
                              ib.min_p[:n][order], [ib.generators[r] for r in rows])
        self.num_static_steps += 1
        return logits[order.to(logits.device)], seqs

    def take_verifying(self) -> dict:
        """The inner runner's verified drafts (a static step has none)."""
        return self.inner.take_verifying()

    def take_batch_params(self) -> tuple | None:
        """The last static step's sampling parameters (temperature, top_k, top_p, min_p,
        generators), once; None after any other step."""
        params, self._batch_params = self._batch_params, None
        return params
