"""Structured outputs: the model's output constrained to a JSON schema, a regex, a list of choices
or a grammar, by masking the logits at every step.

    StructuredOutputsParams  --compile, once per request-->  a grammar
    each sequence: a matcher, the grammar's parser state after its output so far
    each step:     matcher --> which next tokens keep the output a prefix of some valid one
                   (a bitmask over the vocabulary) --> every other token's logit set to -inf
                   --> the sampler picks among the allowed, as it always does
    each token:    matcher.accept(token)

Nothing else changes: greedy, temperature, top-k/p, seeds and logprobs work as before, on the
masked logits. Once the output is complete (the JSON object closed, the regex matched to its
end), only the end-of-sequence token is allowed, so the request finishes with "stop". A request
cut by `max_tokens` first ends with "length" and an incomplete output, as on vLLM and OpenAI.

The grammar engine is llguidance (one of the two vLLM uses; the other is xgrammar): it compiles
JSON schemas, regexes and Lark grammars against the tokenizer's vocabulary, and computes a
step's mask by walking a trie of the vocabulary with the parser's lexer.
"""

from __future__ import annotations

import json

import numpy as np
import torch

from tinyvllm.sampling_params import StructuredOutputsParams


class StructuredOutputManager:
    """Compiles a request's `StructuredOutputsParams` into a grammar, and makes each sequence's
    matcher (vLLM's `StructuredOutputManager`). The grammar engine's view of the tokenizer takes a
    fraction of a second to build, so it is built on the first structured request."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._lltokenizer = None

    @property
    def lltokenizer(self):
        if self._lltokenizer is None:
            from llguidance import LLTokenizer
            self._lltokenizer = LLTokenizer(self.tokenizer.to_json(), n_vocab=self.vocab_size,
                                            eos_token=self.eos_token_ids or None)
        return self._lltokenizer

    def compile(self, params: StructuredOutputsParams) -> str:
        """The grammar for `params`; a ValueError naming structured_outputs if it is not valid."""
        from llguidance import LLMatcher
        if params.json is not None or params.json_object:
            schema = {"type": "object"} if params.json_object else params.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as e:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
            if not isinstance(schema, dict):
                raise ValueError(f"structured_outputs.json must be a JSON object (a schema), got {schema!r}")
            grammar = LLMatcher.grammar_from_json_schema(
                schema, overrides={"whitespace_flexible": not params.disable_any_whitespace})
        elif params.regex is not None:
            grammar = LLMatcher.grammar_from_regex(params.regex)
        elif params.choice is not None:  # one string literal of a Lark grammar per choice
            grammar = LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in params.choice))
        else:
            grammar = LLMatcher.grammar_from_lark(params.grammar)
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, self.lltokenizer)
        if is_error:
            raise ValueError(f"structured_outputs: {messages[0].strip()}")
        return grammar

    def matcher(self, grammar: str) -> GrammarMatcher:
        from llguidance import LLMatcher
        return GrammarMatcher(LLMatcher(self.lltokenizer, grammar, log_level=0), self.vocab_size,
                              self.eos_token_ids)


class GrammarMatcher:
    """One sequence's parser state: which tokens may come next, and the tokens it has taken."""

    def __init__(self, matcher, vocab_size: int, eos_token_ids: list[int]):
        self._matcher, self.vocab_size, self.eos_token_ids = matcher, vocab_size, eos_token_ids

    def allowed(self, device: torch.device | str = "cpu") -> torch.Tensor | None:
        """(V,) bool: the tokens that keep the output valid; None when the matcher has failed
        (a token it could not take, e.g. after ignore_eos): the sequence is then unconstrained."""
        return _allowed(self._matcher, self.vocab_size, self.eos_token_ids, device)

    def accept(self, token_id: int) -> None:
        """Advance past a token the sequence took (a failure is remembered, not raised)."""
        self._matcher.consume_token(token_id)

    def allowed_ahead(self, draft_token_ids: list[int], device: torch.device | str = "cpu") -> torch.Tensor:
        """(k+1, V) bool: the allowed tokens at each position of a run of k draft tokens, as if
        the drafts before it were taken (speculative decoding verifies such a run in one pass).
        After a draft the grammar refuses, the rows repeat its position's: that draft is
        rejected there, and the rows after it are never used."""
        m = self._matcher.deep_copy()
        rows = []
        for j in range(len(draft_token_ids) + 1):
            row = _allowed(m, self.vocab_size, self.eos_token_ids, device)
            rows.append(row if row is not None else torch.ones(self.vocab_size, dtype=torch.bool, device=device))
            if j < len(draft_token_ids) and not m.consume_token(draft_token_ids[j]):
                rows += [rows[-1]] * (len(draft_token_ids) - j)
                break
        return torch.stack(rows)


def _allowed(matcher, vocab_size: int, eos_token_ids: list[int], device) -> torch.Tensor | None:
    if matcher.is_error():
        return None
    bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
    mask = torch.from_numpy(np.unpackbits(bits, bitorder="little")[:vocab_size].astype(bool)).to(device)
    if not bool(mask.any()):  # nothing can follow: let the sequence end
        mask[eos_token_ids] = True
    return mask


def mask_logits(logits: torch.Tensor, rows: list[int], masks: list[torch.Tensor]) -> torch.Tensor:
    """A copy of logits (B, V) with each row in `rows` set to -inf outside its allowed mask."""
    logits = logits.clone()
    for i, mask in zip(rows, masks):
        logits[i].masked_fill_(~mask, float("-inf"))
    return logits
