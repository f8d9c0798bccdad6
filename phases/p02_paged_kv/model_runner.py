"""The model runner: one step's plan in, the logits of the rows to sample out.

    plan: [(sequence, num_new_tokens), ...]   the scheduler's decision (their blocks allocated)
      -> flat input_ids, positions, slot_mapping + AttentionMetadata    (`prepare`)
      -> the model over every new token, attending through the cache  (`forward`)
      -> logits of each sequence whose last token was computed        (`logits_rows`)

As vLLM's `GPUModelRunner`, it is the only part that turns sequences into tensors, and it only
reads them: the scheduler moves `num_computed_tokens` on after the step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from phases.p01_naive_attention import prompt_logits
from tinyvllm.step import ModelRunnerOutput, SchedulerOutput

from .paged_attention import AttentionMetadata


@dataclass
class ModelInputs:
    """A step's flat batch, as the model takes it."""

    input_ids: torch.Tensor      # (N,)
    positions: torch.Tensor      # (N,)
    meta: AttentionMetadata


class ModelRunner:
    """Runs the model on a step's batch of sequences.

    Args:
        model: the `LlamaForCausalLM`.
        attention: the recipe's attention part: AttentionMetadata -> the step's attention.
        block_size: tokens per KV block (slots are block_id * block_size + offset).
        device: where the inputs go.
    """

    def __init__(self, model: torch.nn.Module, attention: Callable, block_size: int, device: torch.device):
        self.model, self.attention = model, attention
        self.block_size, self.device = block_size, device

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        """Run `num_new` tokens of each scheduled sequence (they follow its cached ones). Returns
        the logits of the sequences whose last token was computed, (S, V), and those sequences."""
        inputs = self.prepare(plan)
        hidden = self.forward(inputs)                                          # (N, D)
        starts = inputs.meta.query_start_loc
        prompt = prompt_logits(self.model, hidden, [(seq, seq.num_computed_tokens, n, starts[i])
                                                    for i, (seq, n) in enumerate(plan.scheduled)])
        rows, seqs = self.logits_rows(plan, starts)
        rows = torch.tensor(rows, dtype=torch.long, device=self.device)
        return ModelRunnerOutput(self.model.compute_logits(hidden[rows]), seqs, prompt_logits=prompt)

    def prepare(self, plan: SchedulerOutput) -> ModelInputs:
        """The flat tokens of the batch, their positions, their cache slots and how they group."""
        # >>> exercise prepare_inputs (2 stars): Turn a plan of (sequence, num_new) into the flat input_ids, positions and cache slots, and the AttentionMetadata.
        # hint: plan.new_token_ids(seq, n) gives a sequence's new tokens, which start at its num_computed_tokens; its slot for position p is block_table.slot(p, block_size); seq_lens count the tokens after this step.
        # checked by: test_prepare_flattens_the_plan, test_greedy_equals_phase1, test_seeded_sampling_equals_phase1, test_greedy_matches_transformers
        bs = self.block_size
        input_ids, positions, slots, query_lens, seq_lens = [], [], [], [], []
        for seq, n in plan.scheduled:
            start = seq.num_computed_tokens
            input_ids += plan.new_token_ids(seq, n)
            positions += range(start, start + n)
            slots += [seq.block_table.slot(p, bs) for p in range(start, start + n)]
            query_lens.append(n)
            seq_lens.append(start + n)
        meta = AttentionMetadata.build(slots, query_lens, seq_lens,
                                       [seq.block_table.block_ids for seq, _ in plan.scheduled], self.device)
        return ModelInputs(torch.tensor(input_ids, device=self.device),
                           torch.tensor(positions, device=self.device), meta)
        # <<< exercise prepare_inputs

    def forward(self, inputs: ModelInputs) -> torch.Tensor:
        """The model's hidden states of every token of the step, (N, D)."""
        return self.model(inputs.input_ids, inputs.positions, self.attention(inputs.meta))

    def logits_rows(self, plan: SchedulerOutput, query_start_loc: list[int]) -> tuple[list[int], list]:
        """Which rows of the flat batch need logits: the last row of every sequence whose last
        token is computed this step. Returns the rows and those sequences."""
        done = [i for i, (seq, n) in enumerate(plan.scheduled) if seq.num_computed_tokens + n >= seq.num_tokens]
        return [query_start_loc[i + 1] - 1 for i in done], [plan.scheduled[i][0] for i in done]
