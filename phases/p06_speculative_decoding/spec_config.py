"""`speculative_config`: which proposer guesses tokens, and how many, with vLLM's names.

    None                                                   speculation off (the default)
    {"method": "ngram", "num_speculative_tokens": k,
     "prompt_lookup_min": a, "prompt_lookup_max": b}       prompt lookup, no second model
    {"method": "draft_model", "model": PATH,
     "num_speculative_tokens": k, "quantization": None}    a smaller model with the same tokenizer
    any of them + "disable_by_batch_size": n               no speculation while more than n run

The keys are vLLM's; `disable_by_batch_size` is the name vLLM's V0 engine gave that switch
(V1 sizes its drafts by batch size with `num_speculative_tokens_per_batch_size` instead). As in
vLLM, an n-gram config with only one of the lookup bounds uses it for both, and one with
neither looks for 5-grams.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

METHODS = ("ngram", "draft_model")
_KEYS = {"ngram": {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
                   "disable_by_batch_size"},
         "draft_model": {"method", "model", "num_speculative_tokens", "quantization",
                         "disable_by_batch_size"}}
_DEFAULT_LOOKUP = 5  # vLLM's n-gram size when neither bound is given


def _int(name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"speculative_config[{name!r}] must be an int, got {value!r}")
    if value < low:
        raise ValueError(f"speculative_config[{name!r}] must be >= {low}, got {value}")
    return value


@dataclass(frozen=True)
class SpeculativeConfig:
    """A validated `speculative_config` dict (build it with `from_dict`)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: Path | None = None
    quantization: str | None = None
    disable_by_batch_size: int | None = None

    @classmethod
    def from_dict(cls, config: dict | None) -> "SpeculativeConfig | None":
        """Check every key; errors name the key and what it may be."""
        if config is None:
            return None
        if not isinstance(config, dict):
            raise TypeError(f"speculative_config must be a dict or None, got {config!r}")
        method = config.get("method")
        if method not in METHODS:
            raise ValueError(f"speculative_config['method'] must be one of {METHODS}, got {method!r}")
        unknown = sorted(set(config) - _KEYS[method])
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {unknown} for method {method!r}; "
                             f"allowed: {sorted(_KEYS[method])}")
        if "num_speculative_tokens" not in config:
            raise ValueError("speculative_config['num_speculative_tokens'] is required (an int >= 1)")
        k = _int("num_speculative_tokens", config["num_speculative_tokens"], 1)
        disable = config.get("disable_by_batch_size")
        if disable is not None:
            disable = _int("disable_by_batch_size", disable, 1)
        if method == "ngram":
            lo, hi = config.get("prompt_lookup_min"), config.get("prompt_lookup_max")
            if lo is None and hi is None:
                lo = hi = _DEFAULT_LOOKUP
            lo = _int("prompt_lookup_min", hi if lo is None else lo, 1)
            hi = _int("prompt_lookup_max", lo if hi is None else hi, 1)
            if lo > hi:
                raise ValueError(f"speculative_config: prompt_lookup_min ({lo}) must be <= "
                                 f"prompt_lookup_max ({hi})")
            return cls(method, k, prompt_lookup_min=lo, prompt_lookup_max=hi,
                       disable_by_batch_size=disable)
        path = config.get("model")
        if not isinstance(path, (str, Path)) or not path:
            raise ValueError(f"speculative_config['model'] must be the path of a model folder, got {path!r}")
        if not (Path(path) / "config.json").is_file():
            raise ValueError(f"speculative_config['model']: {str(path)!r} is not a model folder "
                             f"(no config.json there)")
        quant = config.get("quantization")
        if quant not in (None, "int8", "int4"):
            raise ValueError(f"speculative_config['quantization'] must be None, 'int8' or 'int4', "
                             f"got {quant!r}")
        return cls(method, k, model=Path(path), quantization=quant, disable_by_batch_size=disable)
