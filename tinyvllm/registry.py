"""The model families tinyvllm runs: config.json's `architectures` -> what that family changes.

Llama, Mistral, Qwen2 (Qwen2.5), Qwen3 and Gemma 3 are one decoder
(`tinyvllm.model.LlamaForCausalLM`: RMSNorm, RoPE, grouped-query attention, a gated MLP) with a
few switches apart:

    family    projection biases          per-head q/k RMSNorm   sliding-window layers
    Llama     config's attention_bias    no                     none
    Mistral   none                       no                     every layer, when `sliding_window` is set
    Qwen2     q, k and v (not o_proj)    no                     with use_sliding_window: from max_window_layers on
    Qwen3     config's attention_bias    yes, before RoPE       as Qwen2
    Gemma 3   config's attention_bias    yes, before RoPE       five of every six (`sliding_window_pattern`)

Gemma 3 sets more switches (`gemma3_switches`): norms that weigh by (1 + w), a norm after
attention and after the MLP besides the ones before, the embedding scaled by sqrt(hidden), a
GELU (tanh) gate, a query scale of 1/sqrt(query_pre_attn_scalar), and a second RoPE base for its
windowed layers. Which layers attend in a window is config.json's `layer_types` where it is
written (transformers writes it), else the family's rule above.

(Every family reads config.json's `head_dim`, else hidden / heads: Qwen3-0.6B sets 128 where
1024 / 16 would give 64.)

So each family here is an `Architecture`: the switches, and how to read them (and which of the
family's layers attend in a sliding window) from config.json. vLLM keeps one model file per family and a
registry from the `architectures` name to its class (vllm/model_executor/models/registry.py);
families this close share most of a file there too (Qwen3's attention reuses Qwen2's pieces).
To add a family: write its `Architecture` below; if it needs more than these switches (partial
rotary, say), add a switch to the model and to the phases that rewrite its layers (phase 7's fused decode forward, phase 8's sharding)
(docs/models.md walks through it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


FULL, SLIDING = "full_attention", "sliding_attention"   # transformers' (and vLLM's) layer types
LayerTypes = tuple[str, ...] | None   # one per layer; None: every layer full attention


def _no_window(cfg: dict[str, Any], n: int) -> LayerTypes:
    return None


def _mistral_layers(cfg: dict[str, Any], n: int) -> LayerTypes:
    """Mistral: every layer attends to the last `sliding_window` tokens when it is set (Mistral 7B
    v0.1: 4096; later versions write null)."""
    return (SLIDING,) * n if cfg.get("sliding_window") is not None else None


def _qwen_layers(cfg: dict[str, Any], n: int) -> LayerTypes:
    """Qwen2/Qwen3: `sliding_window` counts only with `use_sliding_window: true` (off in every
    published Qwen2.5 and Qwen3 checkpoint), and then only in layers from `max_window_layers` on."""
    if not cfg.get("use_sliding_window") or cfg.get("sliding_window") is None:
        return None
    first = cfg.get("max_window_layers", 28)
    return tuple(SLIDING if i >= first else FULL for i in range(n))


def _gemma3_layers(cfg: dict[str, Any], n: int) -> LayerTypes:
    """Gemma 3: every `sliding_window_pattern`-th layer (6: layers 5, 11, ...) is global, the
    others attend to the last `sliding_window` tokens."""
    pattern = cfg.get("sliding_window_pattern", 6)
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
        raise ValueError(f"config.json: sliding_window_pattern must be a positive integer, got {pattern!r}")
    return tuple(FULL if (i + 1) % pattern == 0 else SLIDING for i in range(n))


def layer_types(cfg: dict[str, Any], family_rule: Callable[[dict[str, Any], int], LayerTypes]) -> LayerTypes:
    """Each layer's attention: config.json's `layer_types` where written (checked against the
    family's rule where the config also gives that rule's fields), else the family's rule."""
    n = cfg["num_hidden_layers"]
    written = cfg.get("layer_types")
    if written is None:
        return family_rule(cfg, n)
    if not isinstance(written, list) or len(written) != n or any(t not in (FULL, SLIDING) for t in written):
        raise ValueError(f"config.json: layer_types must list {n} entries (num_hidden_layers), each "
                         f"{FULL!r} or {SLIDING!r}, got {written!r}")
    if "sliding_window_pattern" in cfg and family_rule is _gemma3_layers and tuple(written) != family_rule(cfg, n):
        raise ValueError(f"config.json: layer_types {written} disagrees with sliding_window_pattern="
                         f"{cfg['sliding_window_pattern']} (every {cfg['sliding_window_pattern']}th layer full)")
    return tuple(written) if SLIDING in written else None


def gemma3_switches(cfg: dict[str, Any]) -> dict[str, Any]:
    """The decoder's Gemma 3 switches, from its config.json (transformers' names and defaults)."""
    for name in ("final_logit_softcapping", "attn_logit_softcapping"):
        if cfg.get(name) is not None:   # Gemma 2's; Gemma 3 writes null
            raise ValueError(f"config.json: {name}={cfg[name]} is not supported (Gemma 3 sets it to null)")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("config.json: use_bidirectional_attention=true is not supported (a decoder attends causally)")
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and SLIDING in params:   # transformers 5: one dict per layer type
        local = params[SLIDING].get("rope_theta", 10_000.0)
    else:
        local = cfg.get("rope_local_base_freq", 10_000.0)
    return {"norm_weight_offset": 1.0, "post_norms": True, "embedding_scale": cfg["hidden_size"] ** 0.5,
            "query_scale": float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5,
            "local_rope_theta": float(local), "hidden_act": cfg.get("hidden_activation", "gelu_pytorch_tanh")}


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
    layer_types: Callable[[dict[str, Any], int], LayerTypes] = _no_window   # the family's rule
    more: Callable[[dict[str, Any]], dict[str, Any]] | None = None           # a family's own switches

    def switches(self, cfg: dict[str, Any]) -> dict[str, Any]:
        """The decoder's switches for this config.json (ModelConfig's fields of the same names)."""
        attention_bias = bool(cfg.get("attention_bias", False))
        pick = lambda fixed, default: default if fixed is None else fixed  # noqa: E731
        types = layer_types(cfg, self.layer_types)
        return {"architecture": self.name, "model_type": self.model_type,
                "qkv_bias": pick(self.qkv_bias, attention_bias),
                "o_bias": pick(self.o_bias, attention_bias),
                "mlp_bias": pick(self.mlp_bias, bool(cfg.get("mlp_bias", False))),
                "qk_norm": self.qk_norm, "layer_types": types,
                "sliding_window": cfg.get("sliding_window") if types else None,
                **(self.more(cfg) if self.more else {})}


ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (
    Architecture("LlamaForCausalLM", "llama", mlp_bias=None),
    Architecture("MistralForCausalLM", "mistral", qkv_bias=False, o_bias=False,
                 layer_types=_mistral_layers),
    Architecture("Qwen2ForCausalLM", "qwen2", qkv_bias=True, o_bias=False, layer_types=_qwen_layers),
    Architecture("Qwen3ForCausalLM", "qwen3", qk_norm=True, layer_types=_qwen_layers),
    Architecture("Gemma3ForCausalLM", "gemma3_text", qk_norm=True, layer_types=_gemma3_layers,
                 more=gemma3_switches),
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
