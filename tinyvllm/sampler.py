"""The one sampler every phase uses, vectorized over the batch.

    logits (B, V) --penalties, min_tokens--> --grammar masks--> --temperature, top-k, top-p, min-p--> token per row

- The sampling parameters of the batch are (B,) tensors (`SamplingTensors`): read from each
  sequence's `SamplingParams` in one pass, or handed over ready by a runner that keeps them so
  (phase 7's persistent batch). Rows are grouped by masks, and each group is one batched op.
- Greedy fast path: when every row is greedy, one argmax, no softmax.
- Top-k-only fast path: rows that use only top-k sample among their k best tokens, without
  sorting or normalizing the whole vocabulary.
- Penalties, min_tokens and structured outputs need each row's history: they change the logits
  of the rows that use them, one row at a time, before the batched part.
- Per-row randomness: each sequence owns a `torch.Generator`. A row draws one uniform number u
  from it and takes the first token whose cumulative probability passes u * (total): inverse
  transform sampling, an exact sample from p. The draw depends only on the row's own generator and
  logits, so a seeded request gives the same tokens whatever else is in the batch, and in any run.
  (vLLM draws exponential noise E for every vocabulary entry and picks argmax(p / E); that costs
  a random number per token of the vocabulary, 49,152 per row here, and on a CPU at batch 64 it
  took longer than the model's attention. One number per row is enough.)
- Any values in, a valid token out: a penalty or a temperature can push logits to inf, whose
  softmax is NaN. `finite` turns NaN into -inf and +inf into the largest float before any
  softmax, and `draw` falls back to a row's most likely token where there is nothing to draw
  from, so the id is always one of the vocabulary's (one bad request must not feed an
  out-of-range id to the next step, for every request in the engine).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from tinyvllm.ckernel import CKernel
from tinyvllm.hardware import AVX2_FLAGS
from tinyvllm.outputs import Logprob
from tinyvllm.sampling_params import SAMPLING_EPS
from tinyvllm.step import ModelRunnerOutput, SamplerOutput
from tinyvllm.structured_output import mask_logits


def finite(logits: torch.Tensor) -> torch.Tensor:
    """NaN -> -inf (never chosen), +inf -> the largest finite value (ties at the top)."""
    return torch.nan_to_num(logits, nan=float("-inf"), posinf=torch.finfo(logits.dtype).max)


ARGMAX = CKernel(Path(__file__).with_name("cpu_argmax.c"), ["-O3", "-mavx2", "-fopenmp", "-shared", "-fPIC"],
                 AVX2_FLAGS, {"argmax_rows": [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2},
                 fallback="greedy tokens come from PyTorch's max")


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The index of each row's largest logit, the first on ties (NaN counting as largest), as
    `argmax(dim=-1)` gives it: `max(dim=-1).indices` is the same answer, and on a CPU the faster
    of the two for a batch of vocabulary-wide rows; float32 rows in a CPU's memory take
    cpu_argmax.c (the same answer, 8 values at a time)."""
    if (logits.dtype == torch.float32 and logits.is_cpu and logits.dim() == 2 and logits.is_contiguous()
            and logits.shape[1] > 0 and (ARGMAX.lib if ARGMAX.tried else ARGMAX.load()) is not None):
        out = torch.empty(logits.shape[0], dtype=torch.int64)
        ARGMAX.lib.argmax_rows(logits.data_ptr(), out.data_ptr(), *logits.shape)
        return out
    return logits.max(dim=-1).indices


@dataclass
class SamplingTensors:
    """A batch's sampling parameters as (B,) tensors, row i for sequence i, and each row's random
    stream (None for a greedy row). top_k is 0 where off, and never above the vocabulary."""

    temperature: torch.Tensor   # (B,) float32; 0 = greedy
    top_k: torch.Tensor         # (B,) int64
    top_p: torch.Tensor         # (B,) float32
    min_p: torch.Tensor         # (B,) float32
    generators: list[torch.Generator | None]

    @classmethod
    def from_seqs(cls, seqs: list, vocab_size: int) -> "SamplingTensors":
        """Read each sequence's `SamplingParams` once."""
        params = [s.params for s in seqs]
        return cls(torch.tensor([p.temperature for p in params], dtype=torch.float32),
                   torch.tensor([min(max(p.top_k, 0), vocab_size) for p in params], dtype=torch.int64),
                   torch.tensor([p.top_p for p in params], dtype=torch.float32),
                   torch.tensor([p.min_p for p in params], dtype=torch.float32),
                   [s.generator for s in seqs])

    def to(self, device: torch.device) -> "SamplingTensors":
        return SamplingTensors(self.temperature.to(device), self.top_k.to(device), self.top_p.to(device),
                               self.min_p.to(device), self.generators)


class Sampler:
    """Picks the next token of each sequence from its logits row (see the module docstring)."""

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer  # for Logprob.decoded_token

    def sample(self, out: ModelRunnerOutput) -> SamplerOutput:
        """The sampler's part of a step: one token for each sequence of `out`, from its row, and
        the prompt logprobs the step computed."""
        tokens, logprobs = self(out.logits, out.seqs, out.sampling)
        prompt = [(group, self.prompt_logprobs(logits, targets, group.params.prompt_logprobs))
                  for group, logits, targets in out.prompt_logits]
        return SamplerOutput(out.seqs, [[t] for t in tokens], [[lp] for lp in logprobs], prompt)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, seqs: list, tensors: SamplingTensors | None = None
                 ) -> tuple[list[int], list[dict[int, Logprob] | None]]:
        """logits: (B, V) float32, one row per sequence -> (token ids, logprobs per row).
        `tensors`: the batch's parameters when the caller has them as tensors already."""
        raw_logprobs = (torch.log_softmax(logits, dim=-1)
                        if any(s.params.logprobs is not None for s in seqs) else None)
        logits = self.apply_penalties(logits, seqs)
        logits = self.apply_grammars(logits, seqs)
        if all(s.params.is_greedy for s in seqs):
            tokens = greedy_tokens(logits).tolist()
        else:
            if tensors is None:
                tensors = SamplingTensors.from_seqs(seqs, logits.shape[-1])
            tokens = sample(logits, tensors.to(logits.device)).tolist()
        logprobs = [self.token_logprobs(raw_logprobs[i], tokens[i], s.params.logprobs)
                    if raw_logprobs is not None and s.params.logprobs is not None else None
                    for i, s in enumerate(seqs)]
        return tokens, logprobs

    # -- logits processing ---------------------------------------------------------------------
    def apply_penalties(self, logits: torch.Tensor, seqs: list) -> torch.Tensor:
        """Each row's repetition, frequency and presence penalties, and min_tokens' ban on its stop
        tokens: a processed copy of logits (B, V), or logits itself when no row has any."""
        rows = [i for i, s in enumerate(seqs) if s.params.has_penalties or s.min_tokens_pending]
        if not rows:
            return logits
        logits = logits.clone()
        vocab = logits.shape[-1]
        for i in rows:
            s, p, row = seqs[i], seqs[i].params, logits[i]
            if p.has_penalties:
                out = torch.tensor(s.output_token_ids, dtype=torch.long, device=logits.device)
                counts = torch.bincount(out, minlength=vocab)[:vocab].to(row.dtype)
                if p.repetition_penalty != 1.0:  # over prompt and output, as vLLM does
                    seen = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
                    seen[torch.tensor(s.token_ids, device=logits.device)] = True
                    penalized = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
                    row.copy_(torch.where(seen, penalized, row))
                row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
            if s.min_tokens_pending:
                banned = [t for t in (*s.eos_token_ids, *p.all_stop_token_ids) if t < vocab]
                row[banned] = float("-inf")
            row.copy_(finite(row))   # a penalty of 1e-300 divides logits into inf
        return logits

    @staticmethod
    def apply_grammars(logits: torch.Tensor, seqs: list) -> torch.Tensor:
        """Structured outputs: each constrained row's logits outside the tokens its grammar allows
        next set to -inf (a copy; logits itself when no row is constrained). The rows' masks are
        computed together, into one bitmask, and applied in one op."""
        rows = [i for i, s in enumerate(seqs) if getattr(s, "grammar", None) is not None]
        return mask_logits(logits, rows, [seqs[i].grammar for i in rows]) if rows else logits

    @staticmethod
    def draw(probs: torch.Tensor, generators: list[torch.Generator]) -> list[int]:
        """One exact sample per row of probs (R, V), not necessarily normalized, each row from its
        own generator: the first token whose cumulative probability is above u * total. A row
        with nothing to draw from (all zero, or NaN) gets its most likely token: always an id
        below V."""
        # >>> exercise draw (2 stars): One token per row by inverse transform sampling: one uniform number u from the row's own generator, then the first token whose cumulative probability passes u times the row's total.
        # hint: torch.rand(1, generator=g, device=g.device) per row; cdf = probs.cumsum(-1); torch.searchsorted(cdf, u * total, right=True), with u * total kept strictly below the total; a row whose total is 0 or not finite takes greedy_tokens(probs).
        # checked by: test_draw_is_inverse_transform_sampling_from_each_rows_generator, test_sampler_never_draws_a_zero_probability_token, test_sampler_matches_distribution
        u = torch.cat([torch.rand(1, generator=g, device=g.device) for g in generators]).to(probs.device)
        probs = torch.nan_to_num(probs, nan=0.0)
        cdf = probs.cumsum(dim=-1)                                         # (R, V)
        total = cdf[:, -1:]
        # strictly below the total, so the token found always has probability > 0
        x = torch.minimum(u[:, None].to(cdf.dtype) * total, torch.nextafter(total, torch.zeros_like(total)))
        idx = torch.searchsorted(cdf, x, right=True)[:, 0]                 # (R,)
        empty = ~(total[:, 0] > 0) | ~torch.isfinite(total[:, 0])
        if bool(empty.any()):
            idx = torch.where(empty, greedy_tokens(probs), idx)
        return idx.clamp_(max=probs.shape[-1] - 1).tolist()
        # <<< exercise draw

    # -- logprobs ------------------------------------------------------------------------------
    def prompt_logprobs(self, logits: torch.Tensor, tokens: list[int], k: int) -> list[dict[int, Logprob]]:
        """logits (P, V) at P prompt positions, tokens: the P prompt tokens that follow them ->
        each token's logprob and rank, plus the k most likely tokens' (no sampling rules apply:
        the model's own distribution, as vLLM returns)."""
        rows = torch.log_softmax(logits.float(), dim=-1)
        return [self.token_logprobs(row, t, k) for row, t in zip(rows, tokens)]

    def token_logprobs(self, row: torch.Tensor, token: int, k: int) -> dict[int, Logprob]:
        """The chosen token's logprob and rank, plus the k most likely tokens'."""
        chosen = float(row[token])
        out: dict[int, Logprob] = {}
        if k > 0:
            vals, idx = row.topk(k)
            for rank, (v, t) in enumerate(zip(vals.tolist(), idx.tolist()), start=1):
                out[t] = Logprob(v, rank, self._decode(t))
        if token not in out:
            rank = int((row > chosen).sum()) + 1
            out[token] = Logprob(chosen, rank, self._decode(token))
        return out

    def _decode(self, token: int) -> str | None:
        return self.tokenizer.decode([token], skip_special_tokens=False) if self.tokenizer else None


def sample(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """One token per row. logits (B, V) float32; `t` on the logits' device -> (B,) int64."""
    tokens = greedy_tokens(logits)                               # greedy rows keep this
    greedy = t.temperature < SAMPLING_EPS
    if bool(greedy.all()):
        return tokens
    vocab = logits.shape[-1]
    rand = ~greedy
    topk_only = rand & (t.top_k > 0) & (t.top_p >= 1.0) & (t.min_p == 0.0)
    full = rand & ~topk_only
    if bool(topk_only.any()):  # sample among each row's k best: no full-vocabulary sort
        r = topk_only.nonzero()[:, 0]
        k = t.top_k[r].clamp(max=vocab)                                                  # (R,)
        vals, idx = finite(logits[r] / t.temperature[r, None]).topk(int(k.max()))       # (R, kmax)
        vals = vals.masked_fill(torch.arange(vals.shape[1], device=vals.device)[None, :] >= k[:, None],
                                float("-inf"))
        pick = Sampler.draw(torch.softmax(vals, dim=-1), [t.generators[i] for i in r.tolist()])
        tokens[r] = idx.gather(1, torch.tensor(pick, device=idx.device)[:, None])[:, 0]
    if bool(full.any()):
        r = full.nonzero()[:, 0]
        probs = torch.softmax(finite(logits[r] / t.temperature[r, None]), dim=-1)      # (R, V)
        probs = filter_probs(probs, t.top_k[r], t.top_p[r], t.min_p[r])
        pick = Sampler.draw(probs, [t.generators[i] for i in r.tolist()])
        tokens[r] = torch.tensor(pick, device=tokens.device)
    return tokens


def filter_probs(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 min_p: torch.Tensor) -> torch.Tensor:
    """Zero out the tokens that top-k, top-p and min-p exclude. probs: (R, V); top_k, top_p,
    min_p: (R,) (top_k 0: off)."""
    # >>> exercise filter_probs (2 stars): Zero, row by row, the tokens min-p, top-k and top-p exclude: below min_p times the row's largest probability, past the k most likely, or after the most likely tokens already reach top_p of the row's mass.
    # hint: min-p first (masked_fill); then sort each row descending: drop rank >= k (k = 0: keep all) and every token whose mass before it (cumsum minus itself) is above top_p times the row's sum; scatter the kept values back through the sort order. The kept values stay as they are (no renormalizing).
    # checked by: test_filter_probs_keeps_what_each_rule_allows, test_sampler_top_p_and_min_p_filter, test_vectorized_sampling_equals_row_by_row
    if bool((min_p > 0).any()):
        thresh = min_p.to(probs.dtype)[:, None]
        probs = probs.masked_fill(probs < thresh * probs.max(dim=-1, keepdim=True).values, 0.0)
    if bool((top_k > 0).any()) or bool((top_p < 1.0).any()):
        sorted_p, order = probs.sort(dim=-1, descending=True)
        rank = torch.arange(probs.shape[-1], device=probs.device)[None, :]
        k = torch.where(top_k > 0, top_k, probs.shape[-1])
        drop = rank >= k[:, None]
        # top-p: drop a token if the tokens ranked above it already reach top_p
        mass_before = sorted_p.cumsum(dim=-1) - sorted_p
        drop |= mass_before > top_p.to(probs.dtype)[:, None] * sorted_p.sum(dim=-1, keepdim=True)
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return probs
    # <<< exercise filter_probs
