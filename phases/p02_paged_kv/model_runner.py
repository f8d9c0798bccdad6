"""The model runner: one step's batch in, the logits of the rows to sample out.

    batch: [(sequence, num_new_tokens), ...]   the scheduler's decision (their blocks allocated)
      -> flat input_ids, positions, slot_mapping + AttentionMetadata    (`prepare`)
      -> the model over every new token, attending through the cache  (`execute`)
      -> logits of each sequence whose last token was computed, and those sequences

As vLLM's `GPUModelRunner`, it is the only part that turns sequences into tensors. The engine
builds it with `make_model_runner`; a later phase may hand the engine another one (its drafts
in the batch, its inputs in static buffers) without touching the engine's loop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from phases.p01_naive_attention import record_prompt_logprobs
from tinyvllm.sequence import Sequence

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
        sampler: what turns prompt rows into prompt logprobs (`Sampler.prompt_logprobs`).
        block_size: tokens per KV block (slots are block_id * block_size + offset).
        make_attention: the engine's hook, AttentionMetadata -> the step's attention backend.
        device: where the inputs go.
    """

    def __init__(self, model, sampler, block_size: int, make_attention: Callable, device: torch.device):
        self.model, self.sampler, self.block_size = model, sampler, block_size
        self.make_attention, self.device = make_attention, device

    def run(self, batch: list[tuple[Sequence, int]]) -> tuple[torch.Tensor, list[Sequence]]:
        """Run `num_new` tokens of each sequence (they follow its cached ones). Returns the logits
        of the sequences whose last token was computed, (S, V), and those sequences; every
        sequence's `num_computed_tokens` moves past what was run."""
        inputs = self.prepare(batch)
        hidden = self.execute(inputs)                                          # (N, D)
        starts = inputs.meta.query_start_loc
        record_prompt_logprobs(self.model, self.sampler, hidden,
                               [(seq, seq.num_computed_tokens, n, starts[i]) for i, (seq, n) in enumerate(batch)])
        rows, sampled = self.logits_rows(batch, starts)
        for seq, n in batch:
            seq.num_computed_tokens += n
        rows = torch.tensor(rows, dtype=torch.long, device=self.device)
        return self.model.compute_logits(hidden[rows]), sampled

    def prepare(self, batch: list[tuple[Sequence, int]]) -> ModelInputs:
        """The flat tokens of the batch, their positions, their cache slots and how they group."""
        # >>> exercise prepare_inputs (2 stars): Turn a batch of (sequence, num_new) into the flat input_ids, positions and cache slots, and the AttentionMetadata.
        # hint: a sequence's new tokens are token_ids[num_computed_tokens : num_computed_tokens + n]; its slot for position p is block_table.slot(p, block_size); seq_lens count the tokens after this step.
        # checked by: test_greedy_equals_phase1, test_seeded_sampling_equals_phase1, test_greedy_matches_transformers
        bs = self.block_size
        input_ids, positions, slots, query_lens, seq_lens = [], [], [], [], []
        for seq, n in batch:
            start = seq.num_computed_tokens
            input_ids += seq.token_ids[start: start + n]
            positions += range(start, start + n)
            slots += [seq.block_table.slot(p, bs) for p in range(start, start + n)]
            query_lens.append(n)
            seq_lens.append(start + n)
        meta = AttentionMetadata.build(slots, query_lens, seq_lens,
                                       [seq.block_table.block_ids for seq, _ in batch], self.device)
        return ModelInputs(torch.tensor(input_ids, device=self.device),
                           torch.tensor(positions, device=self.device), meta)
        # <<< exercise prepare_inputs

    def execute(self, inputs: ModelInputs) -> torch.Tensor:
        """The model's hidden states of every token of the step, (N, D)."""
        return self.model(inputs.input_ids, inputs.positions, self.make_attention(inputs.meta))

    def logits_rows(self, batch: list[tuple[Sequence, int]], query_start_loc: list[int]
                    ) -> tuple[list[int], list[Sequence]]:
        """Which rows of the flat batch need logits: the last row of every sequence whose last
        token is computed this step (called before num_computed_tokens moves). Returns the rows
        and those sequences. (An extension point: a runner may ask for several rows of one
        sequence.)"""
        done = [i for i, (seq, n) in enumerate(batch) if seq.num_computed_tokens + n == seq.num_tokens]
        return [query_start_loc[i + 1] - 1 for i in done], [batch[i][0] for i in done]
