"""The n-gram proposer (prompt lookup): guesses from the sequence's own tokens, no model.

When an answer copies its prompt (an edited piece of code, a reformatted table, a quoted name),
the tokens that follow the last few tokens *now* are likely the ones that followed them the first
time. So: take the sequence's last n tokens (n from `prompt_lookup_max` down to
`prompt_lookup_min`), find them earlier in the prompt or output, and propose the up to k tokens
that came after them there. The longest n that matches wins; among its matches, the earliest
(as vLLM's does). No match, no proposal: the sequence decodes one token as usual.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    """Prompt lookup: propose what followed the latest n-gram where it occurred before."""

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int):
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to `k` draft tokens to follow `token_ids` (an empty list when nothing matches)."""
        # >>> exercise ngram_propose (2 stars): Prompt lookup: find the latest n tokens earlier in the sequence (n from max_n down to min_n) and propose the up to k tokens that followed the earliest match.
        # hint: numpy's sliding_window_view(tokens[:-1], n) gives every earlier window; compare with tokens[-n:]; the first hit at i proposes tokens[i + n : i + n + k].
        # checked by: test_ngram_proposer_proposes_what_followed_the_earliest_longest_match, test_ngram_greedy_same_tokens_as_phase5
        if k < 1 or len(token_ids) < self.min_n + 1:
            return []
        tokens = np.asarray(token_ids)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            # windows[i] = tokens[i : i+n], for every i that still has a token after its window
            # and is not the suffix itself
            windows = sliding_window_view(tokens[:-1], n)                    # (L-n, n)
            hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[0]) + n
                return tokens[start: start + k].tolist()
        return []
        # <<< exercise ngram_propose
