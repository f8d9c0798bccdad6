"""Phase 3's scheduler, counting draft tokens.

A sequence with k draft tokens (`spec_token_ids`, vLLM's name) is scheduled for 1 + k tokens: its
last sampled token and the drafts, verified in the same pass. They take the step's token budget
and cache slots like any other tokens. When the budget or the free blocks run short, the drafts
are cut first; speculation never preempts another sequence.
"""

from __future__ import annotations

from phases.p03_continuous_batching.scheduler import Scheduler
from tinyvllm.sequence import Sequence


class SpecScheduler(Scheduler):
    """A `Scheduler` whose decodes may carry draft tokens."""

    def __init__(self, *args, spec_token_ids: dict[Sequence, list[int]], **kwargs):
        super().__init__(*args, **kwargs)
        self.spec_token_ids = spec_token_ids  # this step's drafts (the engine's), set before schedule()

    def num_new_tokens(self, seq: Sequence, budget: int) -> int:
        n = super().num_new_tokens(seq, budget)
        drafts = self.spec_token_ids.get(seq)
        if n == 1 and drafts and seq.num_computed_tokens + 1 == seq.num_tokens:  # a decode
            k = min(len(drafts), budget - 1)
            while k > 0 and not self.can_grow(seq, 1 + k):
                k -= 1
            if k < len(drafts):
                self.spec_token_ids[seq] = drafts[:k]
            n += k
        return n
