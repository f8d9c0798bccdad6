"""Phase 1's model runner: the model over the whole sequence, every step.

    plan: [(sequence, all its tokens)]
      -> the model over every token, attending with `NaiveAttention` (the full causal score matrix)
      -> the logits of the last row only: the next token's distribution

Nothing is kept between steps, so each new token costs a pass over the whole, growing sequence.
"""

from __future__ import annotations

import torch

from tinyvllm.sequence import Sequence, SequenceGroup
from tinyvllm.step import ModelRunnerOutput, SchedulerOutput

from .attention import NaiveAttention


class RecomputeRunner:
    """Runs the model over all the tokens of the one scheduled sequence."""

    def __init__(self, model, device: torch.device, windows: tuple[int | None, ...] = ()):
        self.model, self.device, self.windows = model, device, windows   # windows: each layer's, or ()

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        """The logits of the scheduled sequence's last position, (1, V)."""
        # >>> exercise recompute_step (1 star): Run the model over every token of the plan's one sequence, and return the logits of its last row.
        # hint: plan.scheduled holds one (seq, n); torch.arange(n) gives the positions; NaiveAttention(self.windows) is the attention (each layer's window); compute_logits on hidden[-1:]; prompt_logits(...) for prompt logprobs.
        # checked by: test_every_step_recomputes_the_whole_sequence, test_greedy_matches_transformers, test_prompt_logprobs_equal_transformers
        (seq, n), = plan.scheduled
        ids = torch.tensor(plan.new_token_ids(seq, n), device=self.device)   # (T,)
        positions = torch.arange(n, device=self.device)                      # (T,)
        hidden = self.model(ids, positions, NaiveAttention(self.windows))   # (T, D): all of it again
        logits = self.model.compute_logits(hidden[-1:])                      # (1, V): only the last row
        return ModelRunnerOutput(logits, [seq], prompt_logits=prompt_logits(self.model, hidden, [(seq, 0, n, 0)]))
        # <<< exercise recompute_step


def prompt_logits(model, hidden: torch.Tensor, spans: list[tuple[Sequence, int, int, int]]
                  ) -> list[tuple[SequenceGroup, torch.Tensor, list[int]]]:
    """For requests with `prompt_logprobs`: the logits of the prompt rows this step computed, and
    only those (a prompt's rows are otherwise never turned into logits). `spans`: (seq, first
    position, positions computed, its first row in `hidden` (N, D)). Returns (request, logits
    (P, V), the P prompt tokens they predict) for each request that has rows to record."""
    out, recorded = [], {}   # a request's next position not yet taken (its n sequences share a prompt)
    for seq, start, num_new, row in spans:
        group = seq.group
        if group is None:  # a sequence that belongs to no request (a draft model's)
            continue
        positions = [p for p in group.prompt_rows_wanted(start, num_new) if p >= recorded.get(group, 0)]
        if positions:
            recorded[group] = positions[-1] + 1
            rows = torch.tensor([row + p - start for p in positions], device=hidden.device)
            out.append((group, model.compute_logits(hidden[rows]), [group.prompt_token_ids[p + 1] for p in positions]))
    return out
