"""A quantized KV cache: K and V stored in 8 bits, with one float scale per token and KV head.

    kv:     (num_layers, 2, num_blocks, block_size, KVH, d)   int8 or float8_e4m3fn
    scales: (num_layers, 2, num_blocks, block_size, KVH)      float32

A token's K (or V) vector for one head, x (d,), is stored as q = x / s with s = max|x| / QMAX
(127 for int8, rounded; 448, float8 e4m3's largest value, for fp8, where the cast rounds), and
read back as q * s. One scale per (token, head) costs 4 bytes next to d = 64 one-byte values: the
pool holds 4 / (1 + 4/64) = 3.76x the float32 blocks in the same memory.

The cache keeps phase 2's interface: `write` quantizes; the attention backend reads through
`gather`, which dequantizes only the blocks a step uses (`QuantizedPagedAttention`), so a step
never touches the rest of the pool.
"""

from __future__ import annotations


import torch

from phases.p02_paged_kv.kv_cache import KVCache, zeros
from phases.p02_paged_kv.paged_attention import AttentionMetadata, PagedAttention, paged_attention
from tinyvllm.config import ModelConfig

KV_CACHE_DTYPES = {"int8": (torch.int8, 127.0), "fp8": (torch.float8_e4m3fn, 448.0),
                   "fp8_e4m3": (torch.float8_e4m3fn, 448.0)}
SCALE_DTYPE = torch.float32


def quantized_bytes_per_block(model: ModelConfig, block_size: int) -> int:
    """K and V, every layer and KV head, for block_size tokens: one byte per value, plus a float32
    scale per token and head."""
    per_token_head = model.head_dim * 1 + SCALE_DTYPE.itemsize
    return 2 * model.num_hidden_layers * block_size * model.num_key_value_heads * per_token_head


def quantize_kv(x: torch.Tensor, kv_cache_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x (N, KVH, d) float -> q (N, KVH, d) in the cache's dtype, scale (N, KVH) float32."""
    dtype, qmax = KV_CACHE_DTYPES[kv_cache_dtype]
    x = x.float()
    amax = x.abs().amax(-1).clamp(min=1e-8)                                # (N, KVH)
    # qmax as a tensor on x's device: a GPU divides by a Python number as a product with its
    # reciprocal (a bit apart at times), by a tensor as IEEE division, which the CPU and the
    # Triton write (div_rn) do: the same scales on every device
    scale = amax / amax.new_full((), qmax)
    y = x / scale[..., None]
    if dtype == torch.int8:
        y = torch.round(y).clamp(-qmax, qmax)
    return y.to(dtype), scale


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q (..., d), scale (...) -> (..., d) in `dtype`."""
    return (q.float() * scale[..., None]).to(dtype)


def _storage_dtype(kv_cache_dtype: str) -> torch.dtype:
    return torch.int8 if kv_cache_dtype == "int8" else torch.uint8


class QuantizedKVCache(KVCache):
    """Phase 2's KV cache, stored in 8 bits (see the module docstring).

    Args:
        model: the model's config (layers, KV heads, head size).
        num_blocks: blocks in the pool.
        block_size: tokens per block.
        dtype: the dtype attention computes in (what `gather` returns).
        device: where the pool lives.
        kv_cache_dtype: "int8", "fp8" or "fp8_e4m3".
    """

    def __init__(self, model: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, kv_cache_dtype: str):
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {['auto', *KV_CACHE_DTYPES]}, got {kv_cache_dtype!r}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.dtype, self.kv_cache_dtype = dtype, kv_cache_dtype
        shape = (model.num_hidden_layers, 2, num_blocks, block_size, model.num_key_value_heads)
        # zeros (see KVCache): unused slots read back as finite zeros
        # fp8 is stored as its bytes (uint8): PyTorch's CPU index_copy_/index_select lack float8
        self.kv = zeros(*shape, model.head_dim, dtype=_storage_dtype(kv_cache_dtype), device=device)
        self.scales = zeros(*shape, dtype=SCALE_DTYPE, device=device)

    def write(self, layer_idx: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Quantize and store new tokens' K/V: k, v (N, KVH, d) into the rows `slot_mapping` (N,)."""
        # >>> exercise write_quantized_kv (2 stars): Quantize a step's new K and V and store each token's 8-bit values and its scales in its slot.
        # hint: for K (0) and V (1): quantize_kv gives q (N, KVH, d) and scale (N, KVH); view q as self.kv's dtype (fp8 is kept as bytes); index_copy_ both into one-row-per-slot views of self.kv[layer_idx, i] and self.scales[layer_idx, i].
        # checked by: test_quantized_kv_write_stores_values_and_scales_in_their_slots, test_quantized_kv_cache_write_and_gather, test_engine_logits_match_float_with_the_rounded_weights
        for i, x in ((0, k), (1, v)):
            q, scale = quantize_kv(x, self.kv_cache_dtype)
            q = q.view(self.kv.dtype)
            self.kv[layer_idx, i].view(-1, *q.shape[1:]).index_copy_(0, slot_mapping, q)
            self.scales[layer_idx, i].view(-1, q.shape[1]).index_copy_(0, slot_mapping, scale)
        # <<< exercise write_quantized_kv

    def gather(self, layer_idx: int, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the blocks `block_ids` (U,), dequantized: each (U, block_size, KVH, d)."""
        dtype = KV_CACHE_DTYPES[self.kv_cache_dtype][0]
        k, v = (dequantize_kv(self.kv[layer_idx, i].index_select(0, block_ids).view(dtype),
                              self.scales[layer_idx, i].index_select(0, block_ids), self.dtype)
                for i in (0, 1))
        return k, v

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole layer dequantized (every block: slow; for tests and inspection)."""
        return self.gather(layer_idx, torch.arange(self.num_blocks, device=self.kv.device))


class QuantizedPagedAttention(PagedAttention):
    """Phase 2's backend over a `QuantizedKVCache`: write (quantizing), then dequantize only the
    blocks this step's sequences use, renumber the block tables into that compact copy, and run
    the same paged attention."""

    def __init__(self, cache: QuantizedKVCache, meta: AttentionMetadata, attend=None):
        super().__init__(cache, meta)
        # how to attend over the dequantized blocks: phase 4's CPU path
        # (q, k, v, k_cache, v_cache, meta) -> out, or None for phase 2's paged_attention
        self.attend = attend
        # once per step, shared by every layer: the blocks in use, and tables renumbered into them
        tables = meta.block_tables
        self.used = torch.unique(tables)                                         # (U,)
        renumber = torch.zeros(cache.num_blocks, dtype=torch.long, device=tables.device)
        renumber[self.used] = torch.arange(len(self.used), device=tables.device)
        self.compact_meta = meta.with_block_ids(renumber)

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.cache.write(layer_idx, self.meta.slot_mapping, k, v)
        k_cache, v_cache = self.cache.gather(layer_idx, self.used)
        window = self.cache.windows[layer_idx] if self.cache.windows else None
        if self.attend is None or window is not None:   # a windowed layer: phase 2's, in its window
            return paged_attention(q, k_cache, v_cache, self.compact_meta, window)
        # the CPU path attends a prompt with nothing cached over this step's K/V directly: hand it
        # what the cache holds (quantized and back), so every query sees the stored values
        k, v = (dequantize_kv(*quantize_kv(x, self.cache.kv_cache_dtype), q.dtype) for x in (k, v))
        return self.attend(q, k, v, k_cache, v_cache, self.compact_meta)
