"""Configuration: the model's shape (read from a Hugging Face config.json) and the engine's knobs.

`ModelConfig` covers the decoder families of `tinyvllm.registry` (Llama 2/3.x, SmolLM2,
TinyLlama, Mistral, Qwen2/Qwen2.5, Qwen3, Gemma 3): their shape, and the switches their family
sets (biases, per-head q/k norms, which layers attend in a sliding window, Gemma's norms). It reads RoPE settings both the way most published checkpoints
write them (`rope_theta` + `rope_scaling`) and the way transformers 5 writes them
(`rope_parameters`).

`EngineConfig` holds every engine argument any phase understands, with vLLM's names and
defaults, and validates each one with an error that names it. Each phase declares the arguments
it acts on (its recipe's `engine_args`); a value that asks a phase for a feature it does not have yet
(`quantization="int4"` on phase 3) is an error naming the argument and the first phase that has
it, never silently ignored (`unsupported_engine_args`).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from tinyvllm.quantized_checkpoint import check_quantization_config
from tinyvllm.registry import find_architecture

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(slots=True)
class ModelConfig:
    """The shape of a decoder of a registered family, as config.json describes it, and the
    family's switches (`tinyvllm.registry`)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "llama3", "factor": 8.0, ...} or None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False          # a bias on q_proj, k_proj and v_proj
    o_bias: bool = False            # a bias on o_proj
    mlp_bias: bool = False
    qk_norm: bool = False           # RMSNorm over each head's q and k, before RoPE (Qwen3)
    sliding_window: int | None = None  # a windowed layer attends to only the last this many tokens
    # each layer's attention, "full_attention" or "sliding_attention" (None: every layer full, or
    # every layer windowed where sliding_window is set)
    layer_types: tuple[str, ...] | None = None
    hidden_act: str = "silu"        # the MLP's gate: "silu" (SwiGLU) or "gelu_pytorch_tanh" (Gemma)
    # Gemma 3's switches (registry.gemma3_switches); the defaults are every other family's
    norm_weight_offset: float = 0.0  # its norms weigh by (offset + w)
    post_norms: bool = False        # a norm after attention's and the MLP's outputs too
    embedding_scale: float | None = None  # the embedding times this (sqrt(hidden))
    query_scale: float | None = None      # scores scaled by this, not 1/sqrt(head_dim)
    local_rope_theta: float | None = None  # the RoPE base of windowed layers (None: rope_theta)
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    torch_dtype: str | None = None
    model_type: str = "llama"
    architecture: str = "LlamaForCausalLM"
    quantization: dict | None = None  # an AWQ/GPTQ checkpoint's (quantized_checkpoint.py), or None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"config.json: {name} must be a positive integer, got {value!r}")
        if self.sliding_window is not None and (isinstance(self.sliding_window, bool)
                                                or not isinstance(self.sliding_window, int)
                                                or self.sliding_window < 1):
            raise ValueError(f"config.json: sliding_window must be a positive integer or null, "
                             f"got {self.sliding_window!r}")
        if self.layer_types is not None:
            self.layer_types = tuple(self.layer_types)
            if len(self.layer_types) != self.num_hidden_layers:
                raise ValueError(f"config.json: layer_types has {len(self.layer_types)} entries, but "
                                 f"num_hidden_layers is {self.num_hidden_layers}")
            if "sliding_attention" in self.layer_types and self.sliding_window is None:
                raise ValueError("config.json: layer_types has sliding_attention layers, but sliding_window is null")
        if self.sliding_window is not None and self.sliding_window > self.max_position_embeddings:
            raise ValueError(f"config.json: sliding_window={self.sliding_window} is larger than the context "
                             f"(max_position_embeddings={self.max_position_embeddings})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"config.json: num_attention_heads ({self.num_attention_heads}) must be a multiple "
                f"of num_key_value_heads ({self.num_key_value_heads})")
        if self.hidden_act not in ("silu", "gelu_pytorch_tanh"):
            raise ValueError(f"config.json: hidden_act {self.hidden_act!r} is not supported "
                             f"('silu', or Gemma's 'gelu_pytorch_tanh')")
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise ValueError(f"config.json: rope type {rope_type!r} is not supported "
                                 f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")

    def layer_windows(self, max_model_len: int) -> tuple[int | None, ...]:
        """Each layer's attention window in tokens (a query at position p sees keys p - W + 1 .. p),
        None for full attention. A window no shorter than `max_model_len` hides nothing: None."""
        types = self.layer_types or (("sliding_attention" if self.sliding_window else "full_attention"),
                                     ) * self.num_hidden_layers
        w = self.sliding_window
        return tuple(w if t == "sliding_attention" and w < max_model_len else None for t in types)

    def refuse_other_layers(self, part: str, instead: str) -> None:
        """For a part that runs Llama's layers itself (a fused forward): refuse a model whose layers
        are another family's (Gemma 3's norms after attention and the MLP, its scaled embedding and
        GELU gate), naming the part and what runs the model (`instead`)."""
        if self.post_norms:
            raise ValueError(f"{part} runs Llama's layers, not {self.architecture}'s (norms after attention "
                             f"and the MLP, a scaled embedding, a GELU gate): {instead}")

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        switches = find_architecture(cfg).switches(cfg)
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        rope_theta = cfg.get("rope_theta", 10000.0)
        rope_scaling = cfg.get("rope_scaling")
        # transformers 5 folds both into one dict: {"rope_type": ..., "rope_theta": ..., ...}
        # (Gemma 3: one such dict per layer type; its global layers' is the model's)
        params = cfg.get("rope_parameters")
        if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
            params = params["full_attention"]
        if isinstance(params, dict):
            rope_theta = params.get("rope_theta", rope_theta)
            rest = {k: v for k, v in params.items() if k != "rope_theta"}
            if rest.get("rope_type", rest.get("type", "default")) != "default":
                rope_scaling = rest
        if rope_scaling is not None and rope_scaling.get("rope_type", rope_scaling.get("type")) == "default":
            rope_scaling = None
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            hidden_act=switches.pop("hidden_act", cfg.get("hidden_act", "silu")),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos_ids,
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            quantization=check_quantization_config(cfg.get("quantization_config"), "config.json"),
            **switches,
        )

    @classmethod
    def from_pretrained(cls, folder: str | os.PathLike) -> "ModelConfig":
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"model: no config.json in {folder}")
        try:
            cfg = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"model: {path} is not valid JSON: {e}") from None
        try:
            return cls.from_dict(cfg)
        except KeyError as e:
            raise ValueError(f"model: {path} lacks the field {e.args[0]!r}") from None


DTYPES = ("auto", "float32", "float16", "bfloat16")
ATTENTION_BACKENDS = ("auto", "triton", "torch")
QUANTIZATIONS = (None, "int8", "int4")
QUANTIZATION_GROUP_SIZES = (32, 64, 128)
KV_CACHE_DTYPES = ("auto", "int8", "fp8", "fp8_e4m3")


@dataclass(slots=True)
class EngineConfig:
    """Every engine argument, with vLLM's names. Phases read the ones they use.

    Memory for the KV cache (phase 2 on): `num_kv_blocks` sets the pool exactly (vLLM's
    `num_gpu_blocks_override`); otherwise `kv_cache_memory` bytes, or on a GPU
    `gpu_memory_utilization` of its memory, divided by the bytes one block takes.
    """

    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    # a folder whose tokenizer.json (and tokenizer_config.json) replace the model's own, as vLLM's
    # `tokenizer`: a GGUF file whose vocabulary is not rebuilt here, a folder without one
    tokenizer: str | None = None
    # phase 2: paged KV cache
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    # phase 2 on: checked mode, each step's block ids, slots and rows checked against the KV pool
    # and the batch before a hand-written kernel indexes them (None: the platform's default, on a
    # CPU on; $TINYVLLM_CHECK_KERNELS=0 or 1, when set, stands for an unset check_kernels)
    check_kernels: bool | None = None
    # phase 3: continuous batching
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    # a request's tokens independent of its batch and of preemption (vLLM's VLLM_BATCH_INVARIANT)
    batch_invariant: bool = False
    # phase 4: attention kernels ("auto": Triton on CUDA, the fused CPU path on a CPU)
    attention_backend: str = "auto"
    # phase 5: quantization
    quantization: str | None = None
    quantization_group_size: int | None = None  # None: 128 where it fits every layer, else 32
    kv_cache_dtype: str = "auto"
    # phase 6: speculative decoding
    speculative_config: dict | None = None
    # phase 7: CUDA graphs (None: 1, 2, 4, 8, then every 8 up to max_num_seqs)
    enforce_eager: bool = False
    cudagraph_capture_sizes: list[int] | None = None
    # phase 7 on a CPU: 1 compiles the decode step with torch.compile before the first request
    # (vLLM's CompilationMode numbering: 0 NONE, 1 STOCK_TORCH_COMPILE); 0 runs it eagerly;
    # None (default): on a CPU, once the engine has run 512 decode steps, compiled in the
    # background while it serves eagerly, then switched to ($TINYVLLM_COMPILATION_MODE, when set,
    # replaces the default)
    compilation_mode: int | None = None
    # phase 8: tensor parallelism (ranks, each with its share of the weights and the KV cache)
    tensor_parallel_size: int = 1
    # phase 8 over several hosts (vLLM's names): host `node_rank` of `nnodes` runs
    # tensor_parallel_size / nnodes ranks; they meet at master_addr:master_port (node 0's address)
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29501
    # phase 9: the engine core schedules step N+1 while step N's model runs (vLLM's name; None:
    # the platform's default, `platform.async_scheduling_default`: on a GPU, not on a CPU)
    async_scheduling: bool | None = None
    # phase 10: a KV connector (vLLM's KVTransferConfig as a dict): {"kv_connector": name,
    # "kv_role": ..., "kv_connector_extra_config": {...}}; None: no connector
    kv_transfer_config: dict | None = None
    # front door
    disable_log_stats: bool = True

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if not isinstance(self.device, str) or not (self.device in ("auto", "cpu")
                                                     or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        _check_int("seed", self.seed, 0)
        if self.tokenizer is not None and not isinstance(self.tokenizer, (str, os.PathLike)):
            raise TypeError(f"tokenizer must be a path to a folder with a tokenizer.json, or None, got {self.tokenizer!r}")
        _check_int("max_model_len", self.max_model_len, 1, optional=True)
        _check_int("block_size", self.block_size, 1)
        _check_int("num_kv_blocks", self.num_kv_blocks, 1, optional=True)
        _check_int("kv_cache_memory", self.kv_cache_memory, 1, optional=True)
        if not isinstance(self.gpu_memory_utilization, (int, float)) or not (
                0 < self.gpu_memory_utilization <= 1):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        _check_int("tensor_parallel_size", self.tensor_parallel_size, 1)
        _check_int("nnodes", self.nnodes, 1)
        _check_int("node_rank", self.node_rank, 0)
        _check_int("master_port", self.master_port, 1)
        if self.master_port > 65535:
            raise ValueError(f"master_port must be a TCP port (1-65535), got {self.master_port}")
        if not isinstance(self.master_addr, str) or not self.master_addr.strip():
            raise ValueError(f"master_addr must be a host name or address, got {self.master_addr!r}")
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1, optional=True)
        for name in ("enable_chunked_prefill", "enable_prefix_caching", "batch_invariant", "enforce_eager",
                     "disable_log_stats"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("check_kernels", "async_scheduling"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool or None, got {getattr(self, name)!r}")
        _check_choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        _check_choice("quantization", self.quantization, QUANTIZATIONS)
        _check_choice("quantization_group_size", self.quantization_group_size, (None, *QUANTIZATION_GROUP_SIZES))
        _check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        if self.compilation_mode is not None and (type(self.compilation_mode) is not int
                                                  or self.compilation_mode not in (0, 1)):
            raise ValueError(f"compilation_mode must be 0 (eager), 1 (torch.compile of the decode "
                             f"step, before the first request) or None (compiled in the background), "
                             f"got {self.compilation_mode!r}")
        if self.speculative_config is not None and not isinstance(self.speculative_config, dict):
            raise TypeError(f"speculative_config must be a dict or None, got {self.speculative_config!r}")
        if self.kv_transfer_config is not None and not isinstance(self.kv_transfer_config, dict):
            raise TypeError(f"kv_transfer_config must be a dict or None, got {self.kv_transfer_config!r}")
        sizes = self.cudagraph_capture_sizes
        if sizes is not None:
            if not isinstance(sizes, (list, tuple)) or not sizes:
                raise ValueError(f"cudagraph_capture_sizes must be a non-empty list of ints, got {sizes!r}")
            for s in sizes:
                _check_int("cudagraph_capture_sizes", s, 1)
            if list(sizes) != sorted(set(sizes)):
                raise ValueError(f"cudagraph_capture_sizes must be strictly increasing, got {list(sizes)}")
            if sizes[-1] > self.max_num_seqs:
                raise ValueError(f"cudagraph_capture_sizes: {sizes[-1]} is above max_num_seqs "
                                 f"({self.max_num_seqs})")
            self.cudagraph_capture_sizes = list(sizes)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(unknown)} "
                            f"(known: {', '.join(sorted(known))})")
        return cls(**kwargs)


# Values that ask nothing of a phase that lacks the feature, beside each argument's default:
# an always-eager engine is eager, a phase without prefix caching or chunks does without them,
# and phases 1-3 attend in PyTorch.
NEUTRAL_ENGINE_ARG_VALUES: dict[str, tuple] = {
    "enforce_eager": (True,),
    "enable_prefix_caching": (False,),
    "enable_chunked_prefill": (False,),
    "attention_backend": ("torch",),
    "check_kernels": (True, False),   # phase 1 has no kernel that indexes a pool: checked either way
    "async_scheduling": (False,),     # a phase before 9 steps synchronously
}


def unsupported_engine_args(engine_args: dict[str, Any], honoured: frozenset[str]) -> list[str]:
    """The names in `engine_args` that an engine acting only on `honoured` would ignore: set to a
    value other than the default or a neutral one (`NEUTRAL_ENGINE_ARG_VALUES`)."""
    defaults = {f.name: f.default for f in fields(EngineConfig)}
    return [name for name, value in engine_args.items()
            if name in defaults and name not in honoured and value != defaults[name]
            and value not in NEUTRAL_ENGINE_ARG_VALUES.get(name, ())]


def _check_choice(name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(repr(c) for c in choices)}, got {value!r}")


def _check_int(name: str, value: Any, low: int, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")


def is_finite_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
