"""The sampler vectorized over the batch: sampling parameters as tensors, no per-row Python.

`tinyvllm.sampler.Sampler` reads each row's `SamplingParams` in a Python loop and samples
top-k-only rows one at a time. Here the parameters come as (B,) tensors (the persistent batch
keeps them so), rows are grouped by masks, and each group is one batched op. The one loop left
is the draw: one uniform number from each row's own `torch.Generator` (the same contract as
`Sampler.draw`: inverse transform sampling, so a seeded request gives the same tokens in any
batch, and the same tokens as `Sampler`).

Penalties, min_tokens, logprobs and structured outputs need each row's history: a batch with any
of them goes to `Sampler` unchanged.
"""

from __future__ import annotations

import torch

from tinyvllm.sampler import Sampler, finite, greedy_tokens
from tinyvllm.sampling_params import SAMPLING_EPS


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           min_p: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row. logits (B, V) float32; temperature, top_k, top_p, min_p (B,) on the
    logits' device; generators: B entries (None for greedy rows) -> (B,) int64."""
    tokens = greedy_tokens(logits)                               # greedy rows keep this
    greedy = temperature < SAMPLING_EPS
    if bool(greedy.all()):
        return tokens
    vocab = logits.shape[-1]
    rand = ~greedy
    topk_only = rand & (top_k > 0) & (top_p >= 1.0) & (min_p == 0.0)
    full = rand & ~topk_only
    if bool(topk_only.any()):  # sample among each row's k best: no full-vocabulary sort
        r = topk_only.nonzero()[:, 0]
        k = top_k[r].clamp(max=vocab)                            # (R,)
        vals, idx = finite(logits[r] / temperature[r, None]).topk(int(k.max()))   # (R, kmax)
        vals = vals.masked_fill(torch.arange(vals.shape[1], device=vals.device)[None, :] >= k[:, None],
                                float("-inf"))
        pick = Sampler.draw(torch.softmax(vals, dim=-1), [generators[i] for i in r.tolist()])
        tokens[r] = idx.gather(1, torch.tensor(pick, device=idx.device)[:, None])[:, 0]
    if bool(full.any()):
        r = full.nonzero()[:, 0]
        probs = torch.softmax(finite(logits[r] / temperature[r, None]), dim=-1)     # (R, V)
        probs = filter_probs(probs, top_k[r], top_p[r], min_p[r])
        pick = Sampler.draw(probs, [generators[i] for i in r.tolist()])
        tokens[r] = torch.tensor(pick, device=tokens.device)
    return tokens


def filter_probs(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 min_p: torch.Tensor) -> torch.Tensor:
    """`Sampler.filter_probs` with the parameters as (R,) tensors: zero out what top-k, top-p and
    min-p exclude. probs: (R, V)."""
    if bool((min_p > 0).any()):
        thresh = min_p.to(probs.dtype)[:, None]
        probs = probs.masked_fill(probs < thresh * probs.max(dim=-1, keepdim=True).values, 0.0)
    if bool((top_k > 0).any()) or bool((top_p < 1.0).any()):
        sorted_p, order = probs.sort(dim=-1, descending=True)
        rank = torch.arange(probs.shape[-1], device=probs.device)[None, :]
        k = torch.where(top_k > 0, top_k, probs.shape[-1])
        drop = rank >= k[:, None]
        mass_before = sorted_p.cumsum(dim=-1) - sorted_p
        drop |= mass_before > top_p.to(probs.dtype)[:, None] * sorted_p.sum(dim=-1, keepdim=True)
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return probs


class BatchSampler(Sampler):
    """`Sampler` with the vectorized path: given `params`, this step's parameters as tensors
    (temperature, top_k, top_p, min_p, generators: the persistent batch's rows, in the step's
    order), and when no row needs penalties, min_tokens, logprobs or a grammar, `sample` does the work;
    otherwise `Sampler` does, unchanged."""

    def __init__(self, tokenizer=None):
        super().__init__(tokenizer)
        self.num_vectorized = 0            # steps sampled by `sample` (for tests)

    @torch.inference_mode()
    def __call__(self, logits, seqs, params: tuple | None = None):
        if params is None or any(s.params.has_penalties or s.min_tokens_pending or s.grammar is not None
                                 or s.params.logprobs is not None for s in seqs):
            return super().__call__(logits, seqs)
        self.num_vectorized += 1
        temperature, top_k, top_p, min_p, generators = params
        dev = logits.device
        tokens = sample(logits, temperature.to(dev), top_k.to(dev), top_p.to(dev), min_p.to(dev), generators)
        return tokens.tolist(), [None] * len(seqs)
