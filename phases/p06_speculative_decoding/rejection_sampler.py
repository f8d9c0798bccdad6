"""Verification: keep exactly the tokens the target model would have produced.

The target model has scored, in one pass, every position of a run of k draft tokens d_1..d_k:
row j of its logits is the distribution p_j of the token after (sequence + d_1..d_j). The draft
proposed d_{j+1} from its own distribution q_j (one-hot for the n-gram proposer). Going left to
right (Leviathan et al. 2023; Chen et al. 2023):

- accept d_{j+1} with probability min(1, p_j(d_{j+1}) / q_j(d_{j+1}));
- at the first rejection, emit a token drawn from the residual max(0, p_j - q_j), normalized,
  and stop;
- if all k are accepted, emit a *bonus* token drawn from p_k, the row after the last draft.

Every emitted token is then distributed exactly as p (proof sketch in the README), so sampling
with speculation is sampling from the target. Greedy is the case where p_j is one-hot at the
target's argmax: keep the longest prefix of drafts that equals the target's own choices, then the
target's choice at the first difference (or after the last draft).

p_j is the *processed* distribution, what the `Sampler` samples from at that position: penalties
(which depend on the tokens before it, drafts included) and min_tokens, then temperature, top-k,
top-p, min-p.
"""

from __future__ import annotations

import dataclasses

import torch

from tinyvllm.outputs import Logprob
from tinyvllm.sampler import Sampler, SamplingTensors, filter_probs
from tinyvllm.sequence import Sequence
from tinyvllm.step import ModelRunnerOutput, SamplerOutput


class SequenceAhead:
    """A sequence as it would be with `extra` tokens appended: what the sampler reads of it
    (params, generator, stop ids, tokens, min_tokens) when it scores a position inside a run."""

    __slots__ = ("seq", "extra", "params", "generator", "eos_token_ids")

    def __init__(self, seq: Sequence, extra: list[int]):
        self.seq, self.extra = seq, extra
        self.params, self.generator, self.eos_token_ids = seq.params, seq.generator, seq.eos_token_ids

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids + self.extra

    @property
    def output_token_ids(self) -> list[int]:
        return self.seq.output_token_ids + self.extra

    @property
    def min_tokens_pending(self) -> bool:
        return self.seq.num_output_tokens + len(self.extra) < self.params.min_tokens


def rejection_sample(target_probs: torch.Tensor, draft_token_ids: list[int],
                     draft_probs: torch.Tensor | None, generator: torch.Generator) -> list[int]:
    """The tokens to emit for one sequence: its accepted drafts, then one more token.

    Args:
        target_probs: (k+1, V) the target's processed probabilities at each position.
        draft_token_ids: the k proposed tokens.
        draft_probs: (k, V) the draft's probabilities they were drawn from; None for one-hot
            proposals (n-gram), where q_j(d_{j+1}) = 1.
        generator: the sequence's random stream (its seed).

    Returns:
        1 to k+1 tokens: the accepted prefix of the drafts, then the resampled or bonus token.
    """
    # >>> exercise rejection_sample (3 stars): Speculative sampling: accept draft d_j with probability min(1, p(d_j) / q(d_j)); at the first rejection draw from max(0, p - q), normalized; if all are accepted, draw a bonus token from the last row.
    # hint: one uniform u per draft from the sequence's generator (u * q < p accepts); q is one-hot at d for n-gram drafts (draft_probs None); Sampler.draw samples a row that needs no normalizing.
    # checked by: test_every_emitted_position_is_distributed_as_the_target, test_seeded_runs_repeat, test_sampling_distribution_is_the_target_s
    out: list[int] = []
    for j, d in enumerate(draft_token_ids):
        p = target_probs[j]                                                  # (V,)
        q_d = 1.0 if draft_probs is None else float(draft_probs[j, d])
        u = float(torch.rand(1, generator=generator, device=generator.device))
        if u * q_d < float(p[d]):  # u < p/q: accepted with probability min(1, p/q)
            out.append(d)
            continue
        if draft_probs is None:  # q one-hot at d: max(0, p - q) is p without d
            residual = p.clone()
            residual[d] = 0.0
        else:
            residual = (p - draft_probs[j].to(p.dtype)).clamp_(min=0.0)
        if float(residual.sum()) <= 0.0:  # p == q up to rounding: a rejection was a rounding edge
            residual = p
        out.append(Sampler.draw(residual[None], [generator])[0])
        return out
    out.append(Sampler.draw(target_probs[-1][None], [generator])[0])  # all accepted: the bonus
    return out
    # <<< exercise rejection_sample


class RejectionSampler:
    """Phase 6's sampler part: the target's rows of a step -> the tokens to emit.

    A sequence without drafts is sampled by the one `Sampler`, as in every phase; a sequence
    verifying k drafts gets its accepted drafts and one token of the target's (`verify`), 1 to
    k + 1 tokens. It also counts, with vLLM's names, how many drafts were proposed and accepted
    (`stats`).
    """

    def __init__(self, sampler: Sampler):
        self.sampler = sampler
        self.reset_stats()

    def sample(self, out: ModelRunnerOutput) -> SamplerOutput:
        if not out.spec_token_ids:
            return self.sampler.sample(out)
        plain, plain_rows, runs, r = [], [], {}, 0
        for seq in out.seqs:
            k = len(out.spec_token_ids.get(seq, ()))
            if k:
                runs[seq] = out.logits[r: r + k + 1]
            else:
                plain.append(seq)
                plain_rows.append(r)
            r += k + 1
        rest = self.sampler.sample(dataclasses.replace(out, logits=out.logits[plain_rows], seqs=plain))
        emitted = dict(zip(plain, zip(rest.token_ids, rest.logprobs)))
        for seq, rows in runs.items():
            drafts = out.spec_token_ids[seq]
            emitted[seq] = self.verify(rows, seq, drafts, out.spec_draft_probs.get(seq))
            self.record_verification(seq, drafts, emitted[seq][0])
        return SamplerOutput(out.seqs, [emitted[s][0] for s in out.seqs], [emitted[s][1] for s in out.seqs],
                             rest.prompt_logprobs)

    def target_probs(self, logits: torch.Tensor, views: list[SequenceAhead]) -> torch.Tensor:
        """(R, V) logits -> (R, V) the probabilities the Sampler would sample from, row by row."""
        logits = self.sampler.apply_penalties(logits, views)
        probs = torch.softmax(logits / views[0].params.temperature, dim=-1)
        t = SamplingTensors.from_seqs(views, logits.shape[-1])
        probs = filter_probs(probs, t.top_k.to(probs.device), t.top_p.to(probs.device), t.min_p.to(probs.device))
        return probs / probs.sum(dim=-1, keepdim=True)

    def verify(self, logits: torch.Tensor, seq: Sequence, draft_token_ids: list[int],
               draft_probs: torch.Tensor | None = None
               ) -> tuple[list[int], list[dict[int, Logprob] | None]]:
        """logits: (k+1, V) the target's rows for `seq` and its k drafts. Returns the emitted
        tokens (1..k+1) and a logprobs dict for each (None where logprobs were not asked for)."""
        views = [SequenceAhead(seq, draft_token_ids[:j]) for j in range(len(draft_token_ids) + 1)]
        if seq.grammar is not None:  # structured outputs: position j allows what follows drafts[:j]
            allowed = seq.grammar.allowed_ahead(draft_token_ids, logits.device)
            logits = logits.masked_fill(~allowed, float("-inf"))
        if seq.params.is_greedy:
            # the target's own choice at every position, exactly as the Sampler makes it
            choices, logprobs = self.sampler(logits, views)
            m = 0
            while m < len(draft_token_ids) and draft_token_ids[m] == choices[m]:
                m += 1
            return choices[: m + 1], logprobs[: m + 1]
        tokens = rejection_sample(self.target_probs(logits, views), draft_token_ids, draft_probs,
                                  seq.generator)
        k = seq.params.logprobs
        if k is None:
            return tokens, [None] * len(tokens)
        raw = torch.log_softmax(logits[: len(tokens)], dim=-1)  # reported as the Sampler does: raw
        return tokens, [self.sampler.token_logprobs(raw[j], t, k) for j, t in enumerate(tokens)]

    # -- numbers -------------------------------------------------------------------------------
    def record_verification(self, seq: Sequence, drafts: list[int], tokens: list[int]) -> None:
        s, accepted = self.counts, len(tokens) - 1
        s["spec_num_drafts"] += 1
        s["spec_num_draft_tokens"] += len(drafts)
        s["spec_num_accepted_tokens"] += accepted
        metrics = seq.group.metrics  # the same counts per request, in RequestOutput.metrics
        metrics.spec_num_draft_tokens += len(drafts)
        metrics.spec_num_accepted_tokens += accepted
        per_pos = s["spec_num_accepted_tokens_per_pos"]
        per_pos.extend([0] * (len(drafts) - len(per_pos)))
        for j in range(accepted):
            per_pos[j] += 1

    def reset_stats(self) -> None:
        self.counts = dict(spec_num_drafts=0, spec_num_draft_tokens=0, spec_num_accepted_tokens=0,
                           spec_num_accepted_tokens_per_pos=[])

    def stats(self) -> dict:
        """Speculation's counters (vLLM's names): spec_num_drafts (verified runs),
        spec_num_draft_tokens, spec_num_accepted_tokens, spec_num_accepted_tokens_per_pos,
        spec_acceptance_rate (accepted / proposed) and spec_mean_accepted_length (tokens emitted
        per verified run, the target's own token included: 1 + accepted / runs)."""
        s = self.counts
        return dict(s, spec_num_accepted_tokens_per_pos=list(s["spec_num_accepted_tokens_per_pos"]),
                    spec_acceptance_rate=(s["spec_num_accepted_tokens"] / s["spec_num_draft_tokens"]
                                          if s["spec_num_draft_tokens"] else 0.0),
                    spec_mean_accepted_length=(1 + s["spec_num_accepted_tokens"] / s["spec_num_drafts"]
                                               if s["spec_num_drafts"] else 1.0))
