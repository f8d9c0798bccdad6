"""What the parts of one engine step hand each other: small data, made fresh every step.

    scheduler.schedule()        -> SchedulerOutput     who runs, how many tokens each, their drafts
    runner.execute(plan)        -> ModelRunnerOutput   the logits rows to sample, and whose they are
    sampler.sample(out)         -> SamplerOutput       the tokens each of those sequences gets
    scheduler.update(plan, sampled)                    append them (`append_sampled`), free, cache

The same split as vLLM V1 (`vllm/v1/core/sched/output.py`, `vllm/v1/outputs.py`). Nothing here
is shared state: a part reads what the part before it returned, and nothing is handed over on
the side.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from tinyvllm.outputs import Logprob
from tinyvllm.sequence import Sequence, SequenceGroup


@dataclass
class SchedulerOutput:
    """What runs this step.

    scheduled: (sequence, tokens of it to compute) in batch order; a sequence's tokens are the
        `num_new` after its `num_computed_tokens` (a whole prompt, a chunk of one, or the one
        token sampled last step), followed by its drafts when it has some.
    spec_token_ids: draft tokens scheduled after a sequence's last token, to be verified in the
        same pass (empty when no proposer runs).
    spec_draft_probs: for drafts a model drew, the (k, V) probabilities they were drawn from;
        None (or absent) for drafts that were certain, such as n-gram lookups.
    preempted: sequences that gave back their blocks this step, to be recomputed later.
    kv_connector_metadata: what a KV connector's scheduler side tells its worker side about this
        step (which blocks to load into the pool, which to save out of it); None without one.
    """

    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)
    spec_token_ids: dict[Sequence, list[int]] = field(default_factory=dict)
    spec_draft_probs: dict[Sequence, torch.Tensor | None] = field(default_factory=dict)
    preempted: list[Sequence] = field(default_factory=list)
    kv_connector_metadata: object | None = None

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    def request_ids(self) -> list[str]:
        """The requests of this step, each once, in batch order."""
        return list(dict.fromkeys(seq.group.request_id for seq, _ in self.scheduled if seq.group))

    def new_token_ids(self, seq: Sequence, num_new: int) -> list[int]:
        """The `num_new` tokens of `seq` this step computes: after its cached ones, its drafts last."""
        start = seq.num_computed_tokens
        tokens = seq.token_ids[start: start + num_new]
        if len(tokens) < num_new:
            tokens = tokens + self.spec_token_ids[seq][: num_new - len(tokens)]
        return tokens


@dataclass
class ModelRunnerOutput:
    """The model's answer for one step.

    logits: (R, V) float32 rows to sample from: one per sequence in `seqs`, or 1 + k for a
        sequence verifying k drafts (its rows one after another, in `seqs` order).
    seqs: the sequences whose last scheduled token was computed (a prefill chunk that is not
        the last has no row).
    spec_token_ids, spec_draft_probs: the drafts those extra rows verify, by sequence.
    sampling: the batch's sampling parameters as tensors when the runner keeps them so
        (`SamplingTensors`, rows in `seqs` order); None: the sampler reads each sequence's.
    prompt_logits: for requests that asked for prompt logprobs, (group, logits (P, V) of the
        prompt positions computed this step, the P prompt tokens they predict).
    """

    logits: torch.Tensor
    seqs: list[Sequence]
    spec_token_ids: dict[Sequence, list[int]] = field(default_factory=dict)
    spec_draft_probs: dict[Sequence, torch.Tensor | None] = field(default_factory=dict)
    sampling: object | None = None
    prompt_logits: list[tuple[SequenceGroup, torch.Tensor, list[int]]] = field(default_factory=list)


@dataclass
class SamplerOutput:
    """The tokens of one step: for each sequence of `seqs`, the tokens to append (one, or with
    drafts between one and k + 1) and a logprobs dict for each (None where none were asked for);
    and the prompt logprobs computed this step, by request."""

    seqs: list[Sequence]
    token_ids: list[list[int]]
    logprobs: list[list[dict[int, Logprob] | None]]
    prompt_logprobs: list[tuple[SequenceGroup, list[dict[int, Logprob]]]] = field(default_factory=list)


def append_sampled(sampled: SamplerOutput) -> list[Sequence]:
    """Record a step's tokens: append each sequence's, in order, until one of them ends it (EOS, a
    stop, max_tokens); time them; and record prompt logprobs. Returns the sequences that finished.
    Every scheduler's `update` calls it."""
    now, finished = time.perf_counter(), []
    for seq, tokens, logprobs in zip(sampled.seqs, sampled.token_ids, sampled.logprobs):
        for token, lp in zip(tokens, logprobs):
            seq.append_token(token, lp)
            if seq.is_finished:
                finished.append(seq)
                break
        if seq.group is not None:
            seq.group.record_token_time(now)
    for group, logprobs in sampled.prompt_logprobs:
        group.record_prompt_logprobs(logprobs)
    return finished
