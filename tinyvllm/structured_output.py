"""Structured outputs: the model's output constrained to a JSON schema, a regex, a list of choices
or a grammar, by masking the logits at every step.

    StructuredOutputsParams  --compile, once per distinct constraint (cached)-->  a grammar
    each sequence: a matcher, the grammar's parser state after its output so far
    each step:     every constrained row's matcher --> which next tokens keep its output a prefix
                   of some valid one, all rows in one bitmask (B, V/32) --> every other token's
                   logit set to -inf, in one op --> the sampler picks among the allowed, as always
    each token:    matcher.accept(token); a token the grammar cannot take ends the sequence

Nothing else changes: greedy, temperature, top-k/p, seeds and logprobs work as before, on the
masked logits. Once the output is complete (the JSON object closed, the regex matched to its
end), only the end-of-sequence token is allowed, so the request finishes with "stop". A request
cut by `max_tokens` first ends with "length" and an incomplete output, as on vLLM and OpenAI.

The grammar engine is llguidance (one of the two vLLM uses; the other is xgrammar): it compiles
JSON schemas, regexes and Lark grammars against the tokenizer's vocabulary, and computes a
step's mask by walking a trie of the vocabulary with the parser's lexer. Its work is bounded by
`GRAMMAR_LIMITS`: a constraint over them is refused when it is compiled (a ValueError naming
structured_outputs), or, if it only goes over later, ends its sequence with finish_reason
"abort" and the error as stop_reason; a sequence never goes on unconstrained.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

import numpy as np
import torch

from tinyvllm.sampling_params import StructuredOutputsParams

# How many compiled constraints a `StructuredOutputManager` keeps (least recently used out).
GRAMMAR_CACHE_SIZE = 64

# llguidance's resource limits (its `LLParserLimits`), for every grammar. llguidance's defaults,
# except: initial_lexer_fuel 200,000 (not 1,000,000), the work of building the lexer and the
# first mask: the regex (a{1000}){1000} took 1.39 s and 190 MB of memory for its first mask at
# 1,000,000 and 0.25 s and 29 MB at 200,000 (AMD EPYC, 2 cores; docs/structured-outputs.md has
# what still fits); max_lexer_states 50,000 (not 250,000), at 1-2 kB each; and verbose_errors
# off (an error is one line, without the parser's state).
GRAMMAR_LIMITS = {
    "initial_lexer_fuel": 200_000,  # lexer and first mask; about 50,000 a millisecond
    "step_lexer_fuel": 200_000,     # one mask's lexer work; about 14,000 a millisecond
    "step_max_items": 50_000,       # one mask's Earley items; about 20,000 a millisecond
    "max_items_in_row": 2_000,      # the branching of one grammar rule
    "max_lexer_states": 50_000,     # lexer states (memory)
    "max_grammar_size": 500_000,    # symbols in the grammar's rules
    "precompute_large_lexemes": True,
    "verbose_errors": False,
}


def grammar_limits():
    from llguidance import LLParserLimits
    return LLParserLimits(**GRAMMAR_LIMITS)


def constraint_key(params: StructuredOutputsParams) -> str:
    """The cache key of a constraint: its fields as JSON. A schema's keys keep their order, as
    the output's do (its properties come in the schema's order): the same schema with its keys
    in another order is another constraint."""
    fields = [params.json, params.regex, params.grammar,
              list(params.choice) if params.choice is not None else None,
              params.json_object, params.disable_any_whitespace]
    return json.dumps(fields, default=repr)


class CompiledGrammar:
    """A constraint compiled by llguidance: a matcher at the start of the output, whose first
    mask is computed already. Each sequence's matcher is a copy of it (`deep_copy`, well under
    a millisecond), which keeps the compiled grammar and lexer instead of building them again."""

    def __init__(self, template):
        self._template = template
        self._lock = threading.Lock()   # requests are made in worker threads

    def copy(self):
        with self._lock:
            return self._template.deep_copy()


class _Entry:
    """A cache entry: filled once by the thread that compiles it; others wait for it."""

    def __init__(self):
        self.done = threading.Event()
        self.grammar: CompiledGrammar | None = None
        self.error: str | None = None


class StructuredOutputManager:
    """Compiles a request's `StructuredOutputsParams` into a grammar, and makes each sequence's
    matcher (vLLM's `StructuredOutputManager`). A constraint is compiled once: the last
    `cache_size` constraints, and their refusals, are kept by `constraint_key`, shared by the
    sequences of a request and by identical requests. The grammar engine's view of the
    tokenizer takes a fraction of a second to build, so it is built on the first structured
    request."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids, cache_size: int = GRAMMAR_CACHE_SIZE):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.cache_size = cache_size
        self.num_compiled = 0            # constraints compiled (cache misses), for tests and stats
        self._lltokenizer = None
        self._lltokenizer_lock = threading.Lock()   # held while it is built: not the cache's
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, _Entry] = OrderedDict()

    @property
    def lltokenizer(self):
        with self._lltokenizer_lock:
            if self._lltokenizer is None:
                from llguidance import LLTokenizer
                self._lltokenizer = LLTokenizer(self.tokenizer.to_json(), n_vocab=self.vocab_size,
                                                eos_token=self.eos_token_ids or None)
            return self._lltokenizer

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The grammar for `params`, from the cache or compiled now; a ValueError naming
        structured_outputs if it is not valid or goes over `GRAMMAR_LIMITS`."""
        key = constraint_key(params)
        with self._lock:
            entry = self._cache.get(key)
            mine = entry is None
            if mine:
                entry = self._cache[key] = _Entry()
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(key)
        if mine:
            try:
                entry.grammar = self._compile(params)
            except ValueError as e:
                entry.error = str(e)
            except BaseException:
                with self._lock:   # not a verdict on the constraint: the next request tries again
                    if self._cache.get(key) is entry:
                        del self._cache[key]
                entry.error = "structured_outputs: the constraint could not be compiled"
                raise
            finally:
                entry.done.set()
        entry.done.wait()
        if entry.error is not None:
            raise ValueError(entry.error)
        return entry.grammar

    def matcher(self, grammar: CompiledGrammar) -> GrammarMatcher:
        """A sequence's own matcher, at the start of its output."""
        return GrammarMatcher(grammar.copy(), self.vocab_size)

    def _compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        from llguidance import LLMatcher
        with self._lock:
            self.num_compiled += 1
        if params.json is not None or params.json_object:
            schema = {"type": "object"} if params.json_object else params.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as e:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
            if not isinstance(schema, dict):
                raise ValueError(f"structured_outputs.json must be a JSON object (a schema), got {schema!r}")
            try:
                grammar = LLMatcher.grammar_from_json_schema(
                    schema, overrides={"whitespace_flexible": not params.disable_any_whitespace})
            except (ValueError, TypeError) as e:
                raise ValueError(f"structured_outputs.json: {e}") from None
        elif params.regex is not None:
            grammar = LLMatcher.grammar_from_regex(params.regex)
        elif params.choice is not None:  # one string literal of a Lark grammar per choice
            grammar = LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in params.choice))
        else:
            grammar = LLMatcher.grammar_from_lark(params.grammar)
        template = LLMatcher(self.lltokenizer, grammar, log_level=0, limits=grammar_limits())
        if template.is_error():   # a bad schema, regex or grammar, or one over the size limits
            raise ValueError(f"structured_outputs: {_first_line(template.get_error())}")
        # The first step here, off the engine's thread: the first mask, and the mask after the
        # lowest allowed token. A constraint whose lexer spends its fuel on them (a regex such as
        # (a{1000}){1000}) is refused now, not after the request's first token.
        bitmask = torch.zeros((2, bitmask_width(self.vocab_size)), dtype=torch.int32)
        _fill_row(template, bitmask, 0)
        _check_first_step(template)
        first = [t for t in _allowed_ids(bitmask[0], self.vocab_size) if t not in self.eos_token_ids][:1]
        if first:
            probe = template.deep_copy()
            probe.consume_token(first[0])
            if not probe.is_error():
                _fill_row(probe, bitmask, 1)
            _check_first_step(probe)
        return CompiledGrammar(template)


class GrammarMatcher:
    """One sequence's parser state: which tokens may come next, and the tokens it has taken.
    `error` is set once the grammar could not take a token (a token it refuses, or a limit of
    `GRAMMAR_LIMITS` reached): the sequence then ends."""

    def __init__(self, matcher, vocab_size: int):
        self._matcher, self.vocab_size = matcher, vocab_size
        self.error: str | None = None

    def accept(self, token_id: int) -> bool:
        """Advance past a token the sequence took; False, with `error` saying why, if the grammar
        could not take it (then and after). After a complete output the grammar takes only
        end-of-sequence tokens (a request with ignore_eos goes on with them)."""
        # is_error too: a matcher that failed computing a mask allows only EOS, and takes it
        if self.error is None and (not self._matcher.consume_token(token_id) or self._matcher.is_error()):
            reason = _first_line(self._matcher.get_error()) or f"token {token_id} does not fit the grammar"
            self.error = f"structured_outputs: {reason}"
        return self.error is None

    def allowed_ahead(self, draft_token_ids: list[int], device: torch.device | str = "cpu") -> torch.Tensor:
        """(k+1, V) bool: the allowed tokens at each position of a run of k draft tokens, as if
        the drafts before it were taken (speculative decoding verifies such a run in one pass).
        After a draft the grammar refuses, the rows repeat its position's: that draft is
        rejected there, and the rows after it are never used. (Each token the sequence then
        keeps goes through `accept`, so a grammar error here still ends the sequence.)"""
        m = self._matcher.deep_copy()
        k = len(draft_token_ids)
        bitmask = torch.zeros((k + 1, bitmask_width(self.vocab_size)), dtype=torch.int32)
        for j in range(k + 1):
            _fill_row(m, bitmask, j)
            if j < k and not m.consume_token(draft_token_ids[j]):
                bitmask[j + 1:] = bitmask[j]
                break
        return unpack_bitmask(bitmask, self.vocab_size, device)


# -- the batch's masks -------------------------------------------------------------------------
def bitmask_width(vocab_size: int) -> int:
    """int32 words per row of a bitmask: bit t % 32 of word t // 32 is token t."""
    return (vocab_size + 31) // 32


_executor_lock = threading.Lock()
_executors: list = []


def _executor():
    """llguidance's thread pool for a batch's masks (one per process)."""
    with _executor_lock:
        if not _executors:
            from llguidance import LLExecutor
            _executors.append(LLExecutor())
        return _executors[0]


def fill_bitmask(grammars: list[GrammarMatcher], vocab_size: int) -> torch.Tensor:
    """(R, W) int32 on the CPU: row i, the tokens grammars[i] allows next, all rows computed in
    one call into llguidance (its threads, without the GIL). A matcher in error allows only
    end-of-sequence (llguidance's rule); its sequence ends when it takes a token."""
    bitmask = torch.zeros((len(grammars), bitmask_width(vocab_size)), dtype=torch.int32)
    if grammars:
        _executor().unsafe_compute_mask_ptr([(g._matcher, i) for i, g in enumerate(grammars)],
                                            bitmask.data_ptr(), bitmask.shape[1] * 4, len(grammars))
    return bitmask


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """(R, W) int32 bitmask -> (R, vocab_size) bool, the whole batch at once."""
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")  # (R, 32 W)
    return torch.from_numpy(bits[:, :vocab_size].view(np.bool_)).to(device)


def mask_logits(logits: torch.Tensor, rows: list[int], grammars: list[GrammarMatcher]) -> torch.Tensor:
    """A copy of logits (B, V) with each row in `rows` set to -inf outside what grammars[i]
    allows: one bitmask for the rows, unpacked once, applied in one op."""
    vocab_size = grammars[0].vocab_size
    allowed = unpack_bitmask(fill_bitmask(grammars, vocab_size), vocab_size, logits.device)
    if len(rows) == logits.shape[0]:
        return torch.where(allowed, logits, float("-inf"))
    logits = logits.clone()
    idx = torch.tensor(rows, device=logits.device)
    logits[idx] = torch.where(allowed, logits[idx], float("-inf"))
    return logits


def _fill_row(matcher, bitmask: torch.Tensor, row: int) -> None:
    matcher.unsafe_compute_mask_ptr(bitmask[row].data_ptr(), bitmask.shape[1] * 4)


def _allowed_ids(row: torch.Tensor, vocab_size: int) -> list[int]:
    bits = np.unpackbits(row.numpy().view(np.uint8), bitorder="little")[:vocab_size]
    return np.flatnonzero(bits).tolist()


def _check_first_step(matcher) -> None:
    if matcher.is_error():
        raise ValueError("structured_outputs: the constraint goes over the grammar engine's limits "
                         f"on its first step: {_first_line(matcher.get_error())}")


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else ""
