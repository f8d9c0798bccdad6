"""The one batched sampler every phase uses.

    logits (B, V) --penalties, min_tokens--> --grammar masks--> --temperature, top-k, top-p, min-p--> token per row

- Greedy fast path: when every row is greedy, one argmax, no softmax.
- Top-k-only fast path: a row that uses only top-k samples among its k best tokens, without
  sorting or normalizing the whole vocabulary.
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

import torch

from tinyvllm.outputs import Logprob
from tinyvllm.sequence import Sequence
from tinyvllm.structured_output import mask_logits


def finite(logits: torch.Tensor) -> torch.Tensor:
    """NaN -> -inf (never chosen), +inf -> the largest finite value (ties at the top)."""
    return torch.nan_to_num(logits, nan=float("-inf"), posinf=torch.finfo(logits.dtype).max)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The index of each row's largest logit, the first on ties (NaN counting as largest), as
    `argmax(dim=-1)` gives it: `max(dim=-1).indices` is the same answer, and on a CPU the faster
    of the two for a batch of vocabulary-wide rows."""
    return logits.max(dim=-1).indices


class Sampler:
    """Picks the next token of each sequence from its logits row."""

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer  # for Logprob.decoded_token

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]
                 ) -> tuple[list[int], list[dict[int, Logprob] | None]]:
        """logits: (B, V) float32, one row per sequence -> (token ids, logprobs per row)."""
        raw_logprobs = (torch.log_softmax(logits, dim=-1)
                        if any(s.params.logprobs is not None for s in seqs) else None)
        logits = self.apply_penalties(logits, seqs)
        logits = self.apply_grammars(logits, seqs)
        if all(s.params.is_greedy for s in seqs):
            tokens = greedy_tokens(logits).tolist()
        else:
            tokens = self._sample(logits, seqs)
        logprobs = [self.token_logprobs(raw_logprobs[i], tokens[i], s.params.logprobs)
                    if raw_logprobs is not None and s.params.logprobs is not None else None
                    for i, s in enumerate(seqs)]
        return tokens, logprobs

    # -- logits processing ---------------------------------------------------------------------
    def apply_penalties(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
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
    def apply_grammars(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Structured outputs: each constrained row's logits outside the tokens its grammar allows
        next set to -inf (a copy; logits itself when no row is constrained)."""
        rows, masks = [], []
        for i, s in enumerate(seqs):
            grammar = getattr(s, "grammar", None)
            mask = grammar.allowed(logits.device) if grammar is not None else None
            if mask is not None:
                rows.append(i)
                masks.append(mask)
        return mask_logits(logits, rows, masks) if rows else logits

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        tokens = greedy_tokens(logits).tolist()  # greedy rows keep this
        full_rows: list[int] = []
        for i, s in enumerate(seqs):
            p = s.params
            if p.is_greedy:
                continue
            if p.top_k > 0 and p.top_p >= 1.0 and p.min_p == 0.0:
                # top-k only: sample among the k best, no full-vocabulary sort
                vals, idx = finite(logits[i] / p.temperature).topk(min(p.top_k, logits.shape[-1]))
                probs = torch.softmax(vals, dim=-1)
                tokens[i] = int(idx[self.draw(probs[None], [s.generator])[0]])
            else:
                full_rows.append(i)
        if full_rows:
            sub = logits[full_rows]
            temps = torch.tensor([seqs[i].params.temperature for i in full_rows],
                                 dtype=sub.dtype, device=sub.device)
            probs = torch.softmax(finite(sub / temps[:, None]), dim=-1)
            probs = self.filter_probs(probs, [seqs[i] for i in full_rows])
            for r, tok in zip(full_rows, self.draw(probs, [seqs[i].generator for i in full_rows])):
                tokens[r] = tok
        return tokens

    @staticmethod
    def draw(probs: torch.Tensor, generators: list[torch.Generator]) -> list[int]:
        """One exact sample per row of probs (R, V), not necessarily normalized, each row from its
        own generator: the first token whose cumulative probability is above u * total. A row
        with nothing to draw from (all zero, or NaN) gets its most likely token: always an id
        below V."""
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

    @staticmethod
    def filter_probs(probs: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Zero out tokens that top-k, top-p or min-p exclude. probs: (R, V)."""
        top_k = [s.params.top_k for s in seqs]
        top_p = [s.params.top_p for s in seqs]
        min_p = [s.params.min_p for s in seqs]
        if any(p > 0 for p in min_p):
            thresh = torch.tensor(min_p, dtype=probs.dtype, device=probs.device)[:, None]
            probs = probs.masked_fill(probs < thresh * probs.max(dim=-1, keepdim=True).values, 0.0)
        if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
            sorted_p, order = probs.sort(dim=-1, descending=True)
            rank = torch.arange(probs.shape[-1], device=probs.device)[None, :]
            k = torch.tensor([k if k > 0 else probs.shape[-1] for k in top_k], device=probs.device)
            drop = rank >= k[:, None]
            # top-p: drop a token if the tokens ranked above it already reach top_p
            p = torch.tensor(top_p, dtype=probs.dtype, device=probs.device)[:, None]
            mass_before = sorted_p.cumsum(dim=-1) - sorted_p
            drop |= mass_before > p * sorted_p.sum(dim=-1, keepdim=True)
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        return probs

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
