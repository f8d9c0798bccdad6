"""Phase 2's model runner, scoring each decoding sequence's drafts in the same pass.

A sequence the scheduler gave 1 + k tokens (its last sampled token and k drafts, which
`SchedulerOutput.new_token_ids` puts after its tokens) runs like a prefill chunk: the pass
computes the drafts' K/V too, and the sequence gets k + 1 rows of logits, the target's
distribution after its last real token and after each draft. The output says which drafts
those rows verify.
"""

from __future__ import annotations

from phases.p02_paged_kv import ModelRunner
from tinyvllm.step import ModelRunnerOutput, SchedulerOutput


class SpecModelRunner(ModelRunner):
    """`ModelRunner` whose batch may carry draft tokens, scored in the same pass."""

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        out = super().execute(plan)
        verifying = [seq for seq in out.seqs if seq in plan.spec_token_ids]
        out.spec_token_ids = {seq: plan.spec_token_ids[seq] for seq in verifying}
        out.spec_draft_probs = {seq: plan.spec_draft_probs.get(seq) for seq in verifying}
        return out

    def logits_rows(self, plan: SchedulerOutput, query_start_loc: list[int]) -> tuple[list[int], list]:
        """k + 1 rows for a sequence with k drafts (its last real token's, then one per draft),
        one for the others."""
        rows, seqs = super().logits_rows(plan, query_start_loc)
        out = []
        for row, seq in zip(rows, seqs):
            k = len(plan.spec_token_ids.get(seq, ()))
            out.extend(range(row - k, row + 1))
        return out, seqs
