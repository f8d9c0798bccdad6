"""Phase 1's attention: the full score matrix with a causal mask, for one sequence.

For a sequence of T tokens, every query attends to every key at or before its own position:

    scores = q @ k^T / sqrt(d)            # (H, T, T): T^2 numbers per head
    scores[i, j] = -inf   where j > i     # the causal mask: no peeking at the future
    out = softmax(scores) @ v             # (T, H, d)

Grouped-query attention: the model has fewer K/V heads than query heads; each K/V head serves
`H // KVH` query heads, so we repeat it before the matmul.

A layer with a sliding window of W tokens (Mistral's, Gemma 3's local layers) masks the keys
before p - W + 1 as well: query p sees keys p - W + 1 .. p, W of them, itself included.
"""

from __future__ import annotations

import torch


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     num_past: int = 0, window: int | None = None) -> torch.Tensor:
    """q: (Tq, H, d); k, v: (Tk, KVH, d) with Tk = num_past + Tq -> (Tq, H, d).

    Query i sits at position p = num_past + i and sees keys 0 .. p, or with a `window` of W
    tokens only keys p - W + 1 .. p.
    """
    # >>> exercise causal_attention (2 stars): Attention of Tq queries over Tk keys: each query sees keys 0 .. num_past + i, KV heads shared by groups of query heads.
    # hint: repeat each KV head H // KVH times; scores = q k^T / sqrt(d); mask keys after each query's position with -inf; softmax in float32, then times v.
    # checked by: test_causal_attention_equals_sdpa, test_backend_is_causal_over_the_whole_sequence, test_logits_equal_transformers
    tq, h, d = q.shape
    tk, kvh, _ = k.shape
    k = k.repeat_interleave(h // kvh, dim=1)                     # (Tk, H, d)
    v = v.repeat_interleave(h // kvh, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * d ** -0.5      # (H, Tq, Tk)
    q_pos = torch.arange(tq, device=q.device)[:, None] + num_past
    k_pos = torch.arange(tk, device=q.device)[None, :]
    hidden = k_pos > q_pos                                       # causal mask
    if window is not None:
        hidden = hidden | (k_pos <= q_pos - window)              # and the window's
    scores = scores.masked_fill(hidden, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return torch.einsum("hqk,khd->qhd", probs, v)                # (Tq, H, d)
    # <<< exercise causal_attention


class NaiveAttention:
    """The attention backend for one sequence whose every token is in the step. `windows`: each
    layer's sliding window (`ModelConfig.layer_windows`; empty: every layer attends to all)."""

    def __init__(self, windows: tuple[int | None, ...] = ()):
        self.windows = windows

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return causal_attention(q, k, v, window=self.windows[layer_idx] if self.windows else None)
