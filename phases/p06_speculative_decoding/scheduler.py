"""Phase 3's scheduler, with draft tokens: it asks the proposer for them, schedules them, and
rolls back the ones the target rejected.

Before each step, every running sequence that is decoding gets up to k drafts from the proposer
(none while more than `disable_by_batch_size` run, and never past max_model_len or max_tokens:
the verified run can emit k + 1 tokens). A sequence with k drafts is scheduled for 1 + k tokens:
its last sampled token and the drafts, verified in the same pass (`SchedulerOutput.spec_token_ids`,
vLLM's name). They take the step's token budget and cache slots like any other tokens; when the
budget or the free blocks run short the drafts are cut first, and speculation never preempts
another sequence.

After the step, a sequence that kept j of its k drafts has valid K/V for its last token and those
j: the other slots are given back (`truncate_table`), before phase 3's update counts what was
computed, keys full blocks for the prefix cache and frees the finished.
"""

from __future__ import annotations

import dataclasses

import torch

from phases.p03_continuous_batching import Scheduler
from tinyvllm.sequence import Sequence
from tinyvllm.step import SamplerOutput, SchedulerOutput

from .ngram_proposer import NgramProposer
from .rollback import truncate_table
from .spec_config import SpeculativeConfig


class SpecScheduler(Scheduler):
    """A `Scheduler` whose decodes may carry draft tokens.

    Args (after `Scheduler`'s): proposer: `NgramProposer` or `DraftModelProposer`;
    spec: the `SpeculativeConfig`.
    """

    def __init__(self, *args, proposer, spec: SpeculativeConfig, **kwargs):
        super().__init__(*args, **kwargs)
        self.proposer, self.spec = proposer, spec
        self.drafts: dict[Sequence, list[int]] = {}           # this step's, while it is scheduled
        self.draft_probs: dict[Sequence, torch.Tensor | None] = {}

    def schedule(self) -> SchedulerOutput:
        self.drafts, self.draft_probs = self.propose()
        plan = super().schedule()
        for seq, n in plan.scheduled:
            k = len(self.drafts.get(seq, ()))
            if k and n == 1 + k and seq.num_computed_tokens + 1 == seq.num_tokens:
                plan.spec_token_ids[seq] = self.drafts[seq]
                q = self.draft_probs.get(seq)
                plan.spec_draft_probs[seq] = None if q is None else q[:k]
        self.drafts, self.draft_probs = {}, {}
        return plan

    def propose(self) -> tuple[dict[Sequence, list[int]], dict[Sequence, torch.Tensor | None]]:
        """Drafts for every running sequence that is decoding, unless the batch is too large."""
        spec, drafts, probs = self.spec, {}, {}
        if spec.disable_by_batch_size is not None and len(self.running) > spec.disable_by_batch_size:
            return drafts, probs
        wanted = []
        for seq in self.running:
            if seq.num_computed_tokens + 1 != seq.num_tokens:
                continue  # still prefilling
            k = min(spec.num_speculative_tokens, self.max_model_len - seq.num_tokens - 1)
            if seq.params.max_tokens is not None:
                k = min(k, seq.params.max_tokens - seq.num_output_tokens - 1)
            if k > 0:
                wanted.append((seq, k))
        if isinstance(self.proposer, NgramProposer):
            for seq, k in wanted:
                tokens = self.proposer.propose(seq.token_ids, k)
                if tokens:
                    drafts[seq] = tokens
        else:
            for seq, (tokens, q) in self.proposer.propose(wanted).items():
                drafts[seq], probs[seq] = tokens, q
        return drafts, probs

    def num_new_tokens(self, seq: Sequence, budget: int) -> int:
        """Phase 3's count, plus the drafts of a decode: as many as the budget and the free
        blocks allow (the drafts are cut to them)."""
        n = super().num_new_tokens(seq, budget)
        drafts = self.drafts.get(seq)
        if n == 1 and drafts and seq.num_computed_tokens + 1 == seq.num_tokens:  # a decode
            k = min(len(drafts), budget - 1)
            while k > 0 and not self.can_grow(seq, 1 + k):
                k -= 1
            self.drafts[seq] = drafts[:k]
            n += k
        return n

    def update(self, plan: SchedulerOutput, sampled: SamplerOutput) -> None:
        """Give back the rejected drafts' slots, then phase 3's update with what was kept."""
        emitted = dict(zip(sampled.seqs, sampled.token_ids))
        kept = []
        for seq, n in plan.scheduled:
            drafts = plan.spec_token_ids.get(seq)
            if drafts:
                n -= len(drafts) - (len(emitted[seq]) - 1)   # j accepted: keep 1 + j slots
                self.roll_back(seq, seq.num_computed_tokens + n)
            kept.append((seq, n))
        super().update(dataclasses.replace(plan, scheduled=kept), sampled)
        if hasattr(self.proposer, "sync"):  # the draft model's cache follows the target's
            self.proposer.sync(self.running)

    def roll_back(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the slots of `seq` past `num_tokens`: its rejected drafts'."""
        truncate_table(self.allocator, seq.block_table, num_tokens)

    def finish(self, seq: Sequence) -> None:
        super().finish(seq)
        if hasattr(self.proposer, "forget"):
            self.proposer.forget(seq)
