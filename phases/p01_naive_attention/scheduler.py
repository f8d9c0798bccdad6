"""Phase 1's scheduler: one request at a time, in arrival order, and nothing remembered.

Each step runs the sequence at the head of the queue over *all* of its tokens (`num_new` is its
whole length, and its `num_computed_tokens` stays 0: there is no cache to count them in). When
it finishes, the next one starts. This is the scheduler interface every phase keeps:

    add(seq)                      queue a sequence
    check_fits(n, params)         raise ValueError if a request of n prompt tokens can never run
    schedule() -> SchedulerOutput who runs this step, and how many tokens each
    update(plan, sampled)         after the step: append the tokens, free what finished
    finish(seq)                   a sequence leaves (finished, or aborted) and frees what it holds
    running, waiting              the sequences in each state (for a server's page)
"""

from __future__ import annotations

import time
from collections import deque

from tinyvllm.sampling_params import SamplingParams
from tinyvllm.sequence import Sequence
from tinyvllm.step import SamplerOutput, SchedulerOutput, append_sampled


def mark_scheduled(seq: Sequence) -> None:
    """Record when a request first ran: its time in the queue ends there."""
    if seq.group is not None and seq.group.metrics.first_scheduled_time is None:
        seq.group.metrics.first_scheduled_time = time.perf_counter()


class FifoScheduler:
    """Runs the oldest unfinished sequence, all of it, every step."""

    def __init__(self) -> None:
        self.waiting: deque[Sequence] = deque()

    @property
    def running(self) -> list[Sequence]:
        return list(self.waiting)[:1]

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def check_fits(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """Phase 1 has no limit beyond max_model_len (a sequence stops there)."""

    def schedule(self) -> SchedulerOutput:
        if not self.waiting:
            return SchedulerOutput()
        seq = self.waiting[0]
        mark_scheduled(seq)
        return SchedulerOutput([(seq, seq.num_tokens)])

    def update(self, plan: SchedulerOutput, sampled: SamplerOutput) -> None:
        for seq in append_sampled(sampled):   # the sequences that finished
            self.finish(seq)

    def finish(self, seq: Sequence) -> None:
        if seq in self.waiting:
            self.waiting.remove(seq)
