"""The scheduler one step ahead of the model: placeholders for the tokens not sampled yet.

Phase 8's scheduler plans step N+1 from the state step N's `update` leaves: every token of a
sequence sampled, its `num_computed_tokens` moved on. To plan N+1 while N's model still runs,
`AsyncScheduler.schedule_ahead` moves the state on at once, when N is scheduled (vLLM's
`AsyncScheduler._update_after_schedule`, vllm/v1/core/sched/async_scheduler.py):

    seq:  ... t7 t8 | P            num_computed_tokens = 9 (t8's K/V: written by step N)
                     ^ a placeholder (-1) for the token step N samples (`num_output_placeholders`)

so phase 8's scheduler, run again, sees one token left to compute, P, and plans it into N+1 like
any decode. The runner and the sampler never see the live sequences: each step runs on
`frozen_copy`s made when it was scheduled, so the loop may move the real ones on meanwhile. Before
N+1 runs, its copies' placeholders are filled with the tokens N sampled (`fill_placeholders`,
vLLM's `_prepare_input_ids` in vllm/v1/worker/gpu_model_runner.py does it on the device); when
N lands (`land`), each real sequence's placeholder gives way to its token, appended as phase 8
appends one: logprobs, EOS, stop tokens, max_tokens, min_tokens.

A sequence whose token in N is certainly its last (max_tokens, the context length) gets no
placeholder, and so no row in N+1. One that EOS or a stop token ends in N was planned into N+1
already: that step's token for it is dropped when it lands, and its blocks were freed when N
landed. An abort frees them at once (`finish`); the tokens still in flight are dropped.

Some steps cannot run ahead (`sync_reason`): a speculative proposer drafts from the tokens just
sampled, a grammar's mask for the next token needs this one, and prompt logprobs are recorded a
chunk at a time, in order. While any such request is unfinished, the loop takes phase 8's
synchronous step, with nothing in flight (batch_queue.py).
"""

from __future__ import annotations

import copy
import dataclasses
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from tinyvllm.sequence import Sequence, SequenceStatus
from tinyvllm.step import SamplerOutput, SchedulerOutput

PLACEHOLDER = -1   # a token id no vocabulary has: what a run-ahead step computes before it is known


def frozen_copy(seq: Sequence) -> Sequence:
    """`seq` as it stands now, for the runner and the sampler of one step: its own token list and
    block table (the loop moves the real ones on while the step runs); its generator, parameters
    and request shared."""
    view = object.__new__(Sequence)
    view.__dict__.update(seq.__dict__)
    view.token_ids = list(seq.token_ids)
    if seq.block_table is not None:
        view.block_table = copy.copy(seq.block_table)
        view.block_table.block_ids = list(seq.block_table.block_ids)
    return view


@dataclass
class Batch:
    """One step scheduled ahead: phase 8's plan (the real sequences), the same plan over frozen
    copies (what the runner and sampler read), which sequences got a placeholder for this step's
    token, and how many of each sequence's tokens have K/V once it has run."""

    plan: SchedulerOutput
    view: SchedulerOutput
    real: dict[int, Sequence]                       # seq_id -> the real sequence
    placed: set[int] = field(default_factory=set)   # seq_ids given a placeholder for this step
    computed: dict[int, int] = field(default_factory=dict)
    future: Future | None = None                    # the worker's run: execute, then sample


def fill_placeholders(view: SchedulerOutput, before: SamplerOutput) -> None:
    """Put into each copy of `view` whose last token is a placeholder the token the step before
    sampled for the same sequence (`before`, over that step's own copies)."""
    # >>> exercise fill_placeholders (2 stars): Before a step scheduled ahead runs, replace each copy's placeholder (its last token id, PLACEHOLDER) with the token the step before sampled for the same sequence.
    # hint: the two steps hold different copies of a sequence, in different orders: match them by seq_id, never by row; a placeholder the step before did not fill is a bug (raise).
    # checked by: test_async_tokens_equal_phase8, test_async_preemption_and_prefix_caching, test_async_stops_and_aborts
    sampled = {seq.seq_id: tokens[-1] for seq, tokens in zip(before.seqs, before.token_ids)}
    for seq, _ in view.scheduled:
        if seq.token_ids and seq.token_ids[-1] == PLACEHOLDER:
            if seq.seq_id not in sampled:
                raise RuntimeError(f"seq {seq.seq_id}: a placeholder that the step before did not sample")
            seq.token_ids[-1] = sampled[seq.seq_id]
    # <<< exercise fill_placeholders


class AsyncScheduler:
    """Phase 8's scheduler (`inner`), which can also plan a step while the one before runs.

    `schedule` and `update` are `inner`'s: a synchronous step (phase 1's `Engine.step`) runs
    exactly as in phase 8. `schedule_ahead` and `land` are the batch queue's (batch_queue.py).
    Any other attribute is `inner`'s (its allocator, its counters).
    """

    def __init__(self, inner):
        self.inner = inner
        self.placeholders: dict[Sequence, int] = {}   # tokens in flight per sequence (at most 2)
        self.needs_sync: set[Sequence] = set()        # unfinished sequences that cannot run ahead

    def __getattr__(self, name):
        return getattr(self.inner, name)

    running = property(lambda self: self.inner.running)
    waiting = property(lambda self: self.inner.waiting)

    def add(self, seq: Sequence) -> None:
        if seq.grammar is not None or seq.params.prompt_logprobs is not None:
            self.needs_sync.add(seq)
        self.inner.add(seq)

    def check_fits(self, num_prompt_tokens, params) -> None:
        self.inner.check_fits(num_prompt_tokens, params)

    def schedule(self) -> SchedulerOutput:
        return self.inner.schedule()

    def update(self, plan: SchedulerOutput, sampled: SamplerOutput) -> None:
        self.inner.update(plan, sampled)

    def finish(self, seq: Sequence) -> None:
        self.placeholders.pop(seq, None)   # its tokens in flight are dropped when they land
        self.inner.finish(seq)

    def stats(self) -> dict[str, float]:
        return self.inner.stats()

    def reset_stats(self) -> None:
        self.inner.reset_stats()

    def sync_reason(self) -> str | None:
        """Why the next step cannot be planned before the last one's tokens land (None: it can)."""
        if getattr(self.inner, "proposer", None) is not None:
            return "speculative decoding: drafts follow the tokens just sampled"
        self.needs_sync = {s for s in self.needs_sync if not s.is_finished}
        if any(s.grammar is not None for s in self.needs_sync):
            return "structured outputs: the grammar's mask needs the token before"
        return "prompt logprobs: recorded chunk after chunk" if self.needs_sync else None

    # -- one step ahead ------------------------------------------------------------------------
    def schedule_ahead(self) -> Batch:
        """Phase 8's plan for the next step, made while the step before may still run: the plan
        over frozen copies, then the real sequences moved on as if the step had run, with a
        placeholder for each token it will sample (unless that token is certainly the last)."""
        plan = self.inner.schedule()
        view = dataclasses.replace(plan, scheduled=[(frozen_copy(s), n) for s, n in plan.scheduled])
        batch = Batch(plan, view, {s.seq_id: s for s, _ in plan.scheduled})
        for seq, n in plan.scheduled:
            seq.num_computed_tokens += n
            batch.computed[seq.seq_id] = seq.num_computed_tokens
            if seq.num_computed_tokens == seq.num_tokens and not self.surely_last(seq):
                seq.token_ids.append(PLACEHOLDER)
                self.placeholders[seq] = self.placeholders.get(seq, 0) + 1
                batch.placed.add(seq.seq_id)
        return batch

    @staticmethod
    def surely_last(seq: Sequence) -> bool:
        """The token this step samples for `seq` ends it whatever it is: max_tokens, the context."""
        max_tokens = seq.params.max_tokens
        return ((max_tokens is not None and seq.num_output_tokens + 1 >= max_tokens)
                or seq.num_tokens + 1 >= seq.max_model_len)

    def land(self, batch: Batch, sampled: SamplerOutput) -> SamplerOutput:
        """A step's tokens are here: each real sequence's placeholder gives way to its token (the
        later ones stay), the full blocks are keyed (prefix caching), the finished freed. Returns
        the tokens over the real sequences, those aborted or finished meanwhile left out."""
        now, out = time.perf_counter(), SamplerOutput([], [], [])
        for view, tokens, logprobs in zip(sampled.seqs, sampled.token_ids, sampled.logprobs):
            seq = batch.real[view.seq_id]
            if seq.is_finished:
                continue   # aborted, or ended by the step before: this token is dropped
            pending = self.placeholders.pop(seq, 0)
            del seq.token_ids[len(seq.token_ids) - pending:]
            seq.append_token(tokens[0], logprobs[0])
            pending -= view.seq_id in batch.placed
            if pending and not seq.is_finished:
                seq.token_ids += [PLACEHOLDER] * pending
                self.placeholders[seq] = pending
            seq.group.record_token_time(now)
            out.seqs.append(seq), out.token_ids.append(tokens[:1]), out.logprobs.append(logprobs[:1])
        if self.inner.prefix_caching:
            for seq, _ in batch.plan.scheduled:
                if seq.status == SequenceStatus.RUNNING:
                    self.inner.allocator.cache_full_blocks(seq.block_table, seq.token_ids,
                                                           batch.computed[seq.seq_id])
        for seq in out.seqs:
            if seq.is_finished:
                self.finish(seq)
        return out

    def pending(self, seq: Sequence) -> int:
        """Placeholders at the end of `seq`'s tokens: not in any output yet."""
        return self.placeholders.get(seq, 0)
