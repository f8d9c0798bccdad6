"""Phase 2's model runner with each decoding sequence's drafts in the batch (the verify pass).

A sequence the scheduler gave 1 + k tokens (its last sampled token and k drafts,
`SpecScheduler.spec_token_ids`) has its drafts appended to its tokens for the pass only, so the
pass computes their K/V like a prefill chunk's, and it gets k + 1 rows of logits: the target's
distribution after its last real token and after each draft. `verifying` tells the engine whose
rows those are (`take_verifying`).
"""

from __future__ import annotations

import torch

from phases.p02_paged_kv import ModelRunner
from tinyvllm.sequence import Sequence


class SpecModelRunner(ModelRunner):
    """`ModelRunner` whose batch may carry draft tokens, scored in the same pass."""

    def __init__(self, *args, spec_token_ids: dict[Sequence, list[int]], **kwargs):
        super().__init__(*args, **kwargs)
        self.spec_token_ids = spec_token_ids                       # the scheduler's, this step's drafts
        self.verifying: dict[Sequence, list[int]] = {}             # the drafts the last pass scored

    def run(self, batch: list[tuple[Sequence, int]]) -> tuple[torch.Tensor, list[Sequence]]:
        """k + 1 logits rows for a sequence with k drafts in the batch, 1 for the others."""
        self.verifying = {}
        for seq, n in batch:
            tokens = self.spec_token_ids.get(seq)
            if tokens and n > 1 and seq.num_computed_tokens + 1 == seq.num_tokens:
                self.verifying[seq] = tokens[: n - 1]
        for seq, tokens in self.verifying.items():
            seq.token_ids.extend(tokens)
        try:
            return super().run(batch)
        finally:
            for seq, tokens in self.verifying.items():
                del seq.token_ids[-len(tokens):]

    def take_verifying(self) -> dict[Sequence, list[int]]:
        """The drafts the last pass scored, by sequence, once (then empty)."""
        verifying, self.verifying = self.verifying, {}
        return verifying

    def logits_rows(self, batch, query_start_loc):
        rows, sampled = super().logits_rows(batch, query_start_loc)
        if not self.verifying:
            return rows, sampled
        out = []
        for row, seq in zip(rows, sampled):
            k = len(self.verifying.get(seq, ()))
            out.extend(range(row - k, row + 1))  # the last real token's row, then one per draft
        return out, sampled
