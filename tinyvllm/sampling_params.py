"""`SamplingParams`: how to pick each next token, and when to stop. Names and defaults are vLLM's,
so code written against tinyvllm runs on vLLM unchanged.

Every field is checked in `__post_init__`; a bad value raises `ValueError` (or `TypeError` for a
wrong type) with a message that names the field and its allowed range.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Below this temperature we decode greedily (vLLM's _SAMPLING_EPS): with the raise below, only 0.
SAMPLING_EPS = 1e-5
# A positive temperature below this is raised to it, as vLLM does (its _MAX_TEMP): dividing the
# logits by less overflows float32 to inf.
MIN_TEMPERATURE = 1e-2
MAX_LOGPROBS = 20
SEED_RANGE = (-(2**63), 2**63 - 1)   # a 64-bit integer, as vLLM's server takes it
MAX_N = 4096  # completions per request: each is a sequence the engine builds at once
# Every number a request carries becomes a float32 (or int64) tensor in the sampler: a larger one
# would overflow there, in the middle of a step shared with other requests.
FLOAT32_MAX = 3.4028234663852886e38
# Caps where vLLM has none: each stop id and stop string is looked for at every token.
MAX_STOP_TOKEN_IDS = 1024
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024


@dataclass(slots=True)
class StructuredOutputsParams:
    """Constrain a request's output to a format (vLLM's `StructuredOutputsParams`): exactly one of

    Args:
        json: a JSON schema (a dict, or its JSON text): the output is one JSON value that fits it.
        regex: a regular expression the whole output matches.
        choice: a list of strings: the output is one of them.
        grammar: a context-free grammar in Lark syntax (llguidance's dialect).
        json_object: True: the output is one JSON object, of any shape.
        disable_any_whitespace: JSON without whitespace between tokens (compact, fewer tokens).

    At each step the allowed next tokens become a mask over the vocabulary; the sampler never
    draws outside it (tinyvllm/structured_output.py).
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs: give exactly one of json, regex, choice, grammar "
                             f"or json_object, got {given or 'none'}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise TypeError(f"structured_outputs.json must be a JSON schema (a dict or its JSON text), "
                            f"got {type(self.json).__name__}")
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise TypeError(f"structured_outputs.{name} must be a string, got {_brief(getattr(self, name))}")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise TypeError(f"structured_outputs.choice must be a non-empty list of non-empty strings, "
                            f"got {_brief(self.choice)}")
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise TypeError(f"structured_outputs.json_object must be a bool, got {_brief(self.json_object)}")


@dataclass(slots=True)
class SamplingParams:
    """Sampling and stopping rules for one request.

    Args:
        n: number of completions to return for the prompt, 1 to 4096.
        temperature: 0 means greedy; higher flattens the distribution. A value in (0, 0.01) is
            raised to 0.01 (as vLLM does): smaller ones overflow the scaled logits. Every float
            field is finite and at most the largest float32 (about 3.4e38) in size.
        top_p: keep the smallest set of tokens whose probability adds up to top_p, in (0, 1].
        top_k: keep the k most likely tokens; 0 or -1 keeps all; at most the vocabulary size
            (the engine checks it, as it knows the vocabulary).
        min_p: drop tokens less likely than min_p times the most likely one, in [0, 1].
        seed: a per-request seed: the same seed gives the same tokens in any batch and any run;
            a 64-bit integer.
        max_tokens: the most tokens to generate (None: up to the model's context length).
        min_tokens: generate at least this many before EOS or a stop token/string may end it.
        stop: string(s) that end generation; they are not included in the text. At most 64,
            each at most 1024 characters.
        stop_token_ids: token ids that end generation (kept in token_ids, not in text). At most
            1024, each below the vocabulary size (the engine checks it).
        ignore_eos: keep generating after the end-of-sequence token.
        presence_penalty: in [-2, 2], subtracted once from the logits of every token already
            generated.
        frequency_penalty: in [-2, 2], subtracted from the logits of every token already
            generated, once per occurrence.
        repetition_penalty: > 0; above 1 discourages tokens seen in the prompt or output.
        logprobs: also return the log-probabilities of this many most likely tokens (0 to 20),
            plus the chosen one.
        prompt_logprobs: also return, for every prompt token after the first, its
            log-probability given the tokens before it, its rank, and this many most likely
            tokens (0 to 20) (perplexity through the public API, as lm-eval does with vLLM).
        skip_special_tokens: leave special tokens out of the text.
        include_stop_str_in_output: keep the matched stop string at the end of the text.
        structured_outputs: constrain the output to a JSON schema, a regex, a list of choices or
            a grammar (`StructuredOutputsParams`, or a dict of its fields).
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None
    # normalized copies, filled in __post_init__
    _stop_strings: list[str] = field(default_factory=list, repr=False)
    _stop_token_ids: list[int] = field(default_factory=list, repr=False)
    _stop_token_set: frozenset[int] = field(default_factory=frozenset, repr=False)

    def __post_init__(self) -> None:
        _int("n", self.n, low=1)
        if self.n > MAX_N:
            raise ValueError(f"n must be in [1, {MAX_N}], got {_shown(self.n)}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = _num(name, getattr(self, name))
            if not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {v}")
        if not _num("repetition_penalty", self.repetition_penalty) > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if _num("temperature", self.temperature) < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = MIN_TEMPERATURE
        if not 0 < _num("top_p", self.top_p) <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _int("top_k", self.top_k, low=-1)
        if not 0 <= _num("min_p", self.min_p) <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            _int("seed", self.seed)
            if not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
                raise ValueError(f"seed must be a 64-bit integer, in [{SEED_RANGE[0]}, {SEED_RANGE[1]}], "
                                 f"got {_shown(self.seed)}")
        if self.max_tokens is not None:
            _int("max_tokens", self.max_tokens, low=1)
        _int("min_tokens", self.min_tokens, low=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({_shown(self.min_tokens)}) must be <= max_tokens ({_shown(self.max_tokens)})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _int(name, value, low=0)
                if value > MAX_LOGPROBS:
                    raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {_shown(value)}")
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise TypeError(f"stop must be a string or a list of strings, got {_brief(self.stop)}")
        if any(s == "" for s in stop):
            raise ValueError("stop must not contain an empty string")
        if len(stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_STRING_CHARS for s in stop):
            raise ValueError(f"stop takes at most {MAX_STOP_STRINGS} strings of at most "
                             f"{MAX_STOP_STRING_CHARS} characters each")
        self._stop_strings = list(stop)
        ids = self.stop_token_ids or []
        if not isinstance(ids, (list, tuple)):
            raise TypeError(f"stop_token_ids must be a list of non-negative ints, got {type(ids).__name__}")
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}")
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise TypeError(f"stop_token_ids must be a list of non-negative ints, got {_brief(self.stop_token_ids)}")
        self._stop_token_ids = list(ids)
        self._stop_token_set = frozenset(ids)
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {_brief(getattr(self, name))}")
        if isinstance(self.structured_outputs, dict):
            fields = set(StructuredOutputsParams.__dataclass_fields__)
            unknown = set(self.structured_outputs) - fields
            if unknown:
                raise ValueError(f"structured_outputs: unknown field(s) {sorted(unknown)}; "
                                 f"it takes {sorted(fields)}")
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        elif self.structured_outputs is not None and not isinstance(self.structured_outputs,
                                                                    StructuredOutputsParams):
            raise TypeError(f"structured_outputs must be a StructuredOutputsParams, got "
                            f"{type(self.structured_outputs).__name__}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def stop_strings(self) -> list[str]:
        return self._stop_strings

    @property
    def all_stop_token_ids(self) -> list[int]:
        return self._stop_token_ids

    def check_vocab(self, vocab_size: int) -> None:
        """The checks that need the model: top_k and every stop id within its vocabulary (the
        engine calls it when the request is made)."""
        if self.top_k > vocab_size:
            raise ValueError(f"top_k must be at most the vocabulary size ({vocab_size}), or 0 or -1 "
                             f"to keep every token; got {_shown(self.top_k)}")
        bad = [i for i in self._stop_token_ids if i >= vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids: token id {_shown(bad[0])} is outside the vocabulary [0, {vocab_size})")

    def is_stop_token(self, token_id: int) -> bool:
        """Is `token_id` one of stop_token_ids (a set lookup, at every token)?"""
        return token_id in self._stop_token_set

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1.0)


def _num(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {_brief(value)}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")
    if abs(value) > FLOAT32_MAX:  # an int may be larger than any float: compare before converting
        raise ValueError(f"{name} must be at most {FLOAT32_MAX:.4g} in size (a float32), got {_shown(value)}")
    return float(value)


def _brief(value) -> str:
    """repr(value) cut short: an error message never echoes a whole huge list back."""
    text = _shown(value) if isinstance(value, int) and not isinstance(value, bool) else repr(value)
    return text if len(text) <= 120 else text[:100] + f"... ({len(text)} characters)"


def _shown(value) -> str:
    """A number for an error message: a huge int by its size, not its thousands of digits."""
    if isinstance(value, int) and value.bit_length() > 64:
        return f"an int of {value.bit_length()} bits"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _int(name: str, value, low: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {_brief(value)}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {_shown(value)}")
    return value
