"""The model families tinyvllm runs: config.json's `architectures` -> what that family changes.

Llama, Mistral, Qwen2 (Qwen2.5) and Qwen3 are one decoder (`tinyvllm.model.LlamaForCausalLM`:
RMSNorm, RoPE, grouped-query attention, SwiGLU) with a few switches apart:

    family    projection biases          per-head q/k RMSNorm   sliding window
    Llama     config's attention_bias    no                     no
    Mistral   none                       no                     `sliding_window` when set
    Qwen2     q, k and v (not o_proj)    no                     only with use_sliding_window
    Qwen3     config's attention_bias    yes, before RoPE       only with use_sliding_window

(Every family reads config.json's `head_dim`, else hidden / heads: Qwen3-0.6B sets 128 where
1024 / 16 would give 64.)

So each family here is an `Architecture`: the switches, and how to read them (and the family's
sliding window, if it has one) from config.json. vLLM keeps one model file per family and a
registry from the `architectures` name to its class (vllm/model_executor/models/registry.py);
families this close share most of a file there too (Qwen3's attention reuses Qwen2's pieces).
To add a family: write its `Architecture` below; if it needs more than these switches (Gemma's
`1 + weight` norms, a different activation, partial rotary), add a switch to the model and to
the phases that rewrite its layers (phase 7's fused decode forward, phase 8's sharding)
(docs/models.md walks through it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


def _no_window(cfg: dict[str, Any]) -> int | None:
    return None


def _mistral_window(cfg: dict[str, Any]) -> int | None:
    """Mistral attends to the last `sliding_window` tokens when it is set (Mistral 7B v0.1: 4096)."""
    return cfg.get("sliding_window")


def _qwen_window(cfg: dict[str, Any]) -> int | None:
    """Qwen2/Qwen3 carry a `sliding_window` that only counts with `use_sliding_window: true`
    (off in every published Qwen2.5 and Qwen3 checkpoint), or a layer typed "sliding_attention"."""
    layer_types = cfg.get("layer_types") or ()
    if cfg.get("use_sliding_window") or "sliding_attention" in layer_types:
        return cfg.get("sliding_window")
    return None


@dataclass(frozen=True)
class Architecture:
    """One family: how its config.json turns into the decoder's switches.

    `qkv_bias`, `o_bias`, `mlp_bias`: True or False for the family, or None to read config.json's
    `attention_bias` (`mlp_bias` for the MLP), as transformers' class for the family does."""

    name: str                       # config.json's `architectures` entry (transformers' class)
    model_type: str                 # config.json's `model_type`
    qkv_bias: bool | None = None
    o_bias: bool | None = None
    mlp_bias: bool | None = False
    qk_norm: bool = False
    sliding_window: Callable[[dict[str, Any]], int | None] = _no_window

    def switches(self, cfg: dict[str, Any]) -> dict[str, Any]:
        """The decoder's switches for this config.json (ModelConfig's fields of the same names)."""
        attention_bias = bool(cfg.get("attention_bias", False))
        pick = lambda fixed, default: default if fixed is None else fixed  # noqa: E731
        return {"architecture": self.name, "model_type": self.model_type,
                "qkv_bias": pick(self.qkv_bias, attention_bias),
                "o_bias": pick(self.o_bias, attention_bias),
                "mlp_bias": pick(self.mlp_bias, bool(cfg.get("mlp_bias", False))),
                "qk_norm": self.qk_norm, "sliding_window": self.sliding_window(cfg)}


ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (
    Architecture("LlamaForCausalLM", "llama", mlp_bias=None),
    Architecture("MistralForCausalLM", "mistral", qkv_bias=False, o_bias=False,
                 sliding_window=_mistral_window),
    Architecture("Qwen2ForCausalLM", "qwen2", qkv_bias=True, o_bias=False, sliding_window=_qwen_window),
    Architecture("Qwen3ForCausalLM", "qwen3", qk_norm=True, sliding_window=_qwen_window),
)}


def supported() -> str:
    return ", ".join(f"{a.name} ({a.model_type})" for a in ARCHITECTURES.values())


def find_architecture(cfg: dict[str, Any]) -> Architecture:
    """The family of a config.json: by its `architectures` name (as vLLM looks it up), else by its
    `model_type` (a config written without `architectures`). Unknown: a ValueError naming it and
    listing the supported ones."""
    names = cfg.get("architectures") or []
    if isinstance(names, str):
        names = [names]
    for name in names:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    if names:
        raise ValueError(f"config.json: architecture {', '.join(map(str, names))} is not supported "
                         f"(supported: {supported()})")
    model_type = cfg.get("model_type", "llama")
    for arch in ARCHITECTURES.values():
        if arch.model_type == model_type:
            return arch
    raise ValueError(f"config.json: model_type {model_type!r} is not supported (supported: {supported()})")
