"""The decode roofline: how fast decoding could go on this machine, at best.

A decode step makes one token for each of B running sequences. Whatever the engine, it must
- read every weight once (the B tokens share that read: this is why batching pays), and the
  cached K and V of every context token of the B sequences;
- do about 2 FLOPs per weight per token (a multiply and an add), plus attention: for each head,
  a dot product with every cached key and a weighted sum of every cached value.

So a step takes at least the bytes over the memory bandwidth, and at least the FLOPs over the
matmul rate:

    t_step >= max(bytes / bandwidth, flops / matmul_rate)        tokens/s <= B / t_step

At small B reading the weights sets the bound (memory-bound); at large B the arithmetic does
(compute-bound). An engine's *fraction of roofline* is its measured tokens/s over this bound.
Prefill is left out of the bound (it only makes the bound higher), so the fraction is, if
anything, an underestimate.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from tinyvllm.config import ModelConfig

from .machine import MachineLimits


def kv_bytes_per_token(config: ModelConfig, element_size: int) -> int:
    """Bytes of K and V one token keeps in the cache: every layer, every KV head."""
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * element_size


def element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def flops_per_token(config: ModelConfig, context_len: float) -> float:
    """FLOPs to decode one token whose context (itself included) is `context_len` tokens."""
    h, d = config.hidden_size, config.head_dim
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    projections = h * q + 2 * h * kv + q * h + 3 * h * config.intermediate_size  # q,k,v,o + MLP
    attention = 2 * q * context_len                                               # q.k and p.v
    return config.num_hidden_layers * 2 * (projections + attention) + 2 * h * config.vocab_size


@dataclass(slots=True)
class Roofline:
    """The bound on decode speed for one engine on one workload."""

    batch: int                 # sequences decoded together in a step
    mean_context: float        # their average context length over the decode
    weight_bytes: int          # weights read per step
    kv_bytes_per_token: int    # cache bytes read per context token
    bytes_per_step: float
    flops_per_step: float
    memory_seconds: float      # bytes / bandwidth
    compute_seconds: float     # flops / matmul rate
    bound: str                 # "memory" or "compute": the larger of the two
    tok_per_s: float           # batch / max(memory_seconds, compute_seconds)

    def to_dict(self) -> dict:
        return asdict(self)


def decode_roofline(limits: MachineLimits, config: ModelConfig, weight_bytes: int,
                    kv_bytes_per_token: int, batch: int, mean_context: float) -> Roofline:
    """The roofline of decode steps of `batch` sequences with `mean_context` tokens each."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    nbytes = weight_bytes + batch * mean_context * kv_bytes_per_token
    flops = batch * flops_per_token(config, mean_context)
    t_mem, t_compute = nbytes / limits.memory_bandwidth, flops / limits.matmul_flops
    return Roofline(batch=batch, mean_context=mean_context, weight_bytes=weight_bytes,
                    kv_bytes_per_token=kv_bytes_per_token, bytes_per_step=nbytes,
                    flops_per_step=flops, memory_seconds=t_mem, compute_seconds=t_compute,
                    bound="memory" if t_mem >= t_compute else "compute",
                    tok_per_s=batch / max(t_mem, t_compute))
