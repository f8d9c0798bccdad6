"""The KV cache: one tensor holding every block of every layer.

Layout (a kernel that reads the cache in place relies on it):

    kv:  (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
              |       |      |            |            |
              |       |      |            |            +-- one head's vector
              |       |      |            +-- KV heads side by side
              |       |      +-- a block: block_size consecutive tokens
              |       +-- the pool
              +-- 0 = K, 1 = V

Seen flat, `kv[layer, 0].view(num_blocks * block_size, num_kv_heads, head_dim)` has one row per
*slot*; slot = block_id * block_size + offset. Writing a token's K/V is one indexed copy into
the rows of its slots (`slot_mapping`).

How many blocks: `num_kv_blocks` if given (vLLM's num_gpu_blocks_override); otherwise a memory
budget (`kv_cache_memory` bytes; on a GPU `gpu_memory_utilization` of its memory less what is
already used; on a CPU 2 GiB) divided by the bytes of one block, and never more than the blocks
`max_num_seqs` sequences of `max_model_len` tokens could use.

On a CPU the pool is zeros the operating system maps in as it is first written (`zeros`): a
2 GiB pool costs no time and no memory until its blocks are used.
"""

from __future__ import annotations

import math
import mmap

import torch

from tinyvllm.config import EngineConfig, ModelConfig

from .block_allocator import cdiv

DEFAULT_CPU_KV_CACHE_BYTES = 2 * 1024**3


def bytes_per_block(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V, every layer, every KV head, for block_size tokens."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * model.num_hidden_layers * block_size * model.num_key_value_heads * model.head_dim * elem


def num_kv_blocks(config: EngineConfig, model: ModelConfig, max_model_len: int, dtype: torch.dtype,
                  device: torch.device, per_block: int | None = None) -> int:
    """How many blocks the pool gets (see the module docstring). `per_block`: the bytes of one
    block, if not `bytes_per_block`'s (a quantized cache)."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    per_block = per_block or bytes_per_block(model, config.block_size, dtype)
    if config.kv_cache_memory is not None:
        budget, source = config.kv_cache_memory, "kv_cache_memory"
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = int(total * config.gpu_memory_utilization) - (total - free)
        source = (f"gpu_memory_utilization ({config.gpu_memory_utilization} of the GPU, less the "
                  f"{(total - free) / 2**30:.1f} GiB already in use)")
    else:
        budget, source = DEFAULT_CPU_KV_CACHE_BYTES, "the CPU default KV budget"
    blocks = budget // per_block
    if blocks < 1:
        raise ValueError(f"{source}: {budget} bytes hold no KV block ({per_block} bytes each); "
                         f"set kv_cache_memory or num_kv_blocks")
    return min(blocks, config.max_num_seqs * cdiv(max_model_len, config.block_size))


def zeros(*shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros, but on a CPU from fresh anonymous memory: the OS maps each page in zeroed
    when it is first touched, so nothing is written now and the resident memory grows only with
    the blocks written (torch.zeros writes every byte of the default pool's 2 GiB at once).
    Private, so a forked process gets its own copy on write, as with malloc's memory."""
    if torch.device(device).type != "cpu":
        return torch.zeros(*shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    flags = {"flags": mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS} if hasattr(mmap, "MAP_PRIVATE") else {}
    buffer = mmap.mmap(-1, max(nbytes, 1), **flags)  # the tensor keeps it alive
    return torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)


class KVCache:
    """K and V for every slot of every layer. `checked`: each step's attention part checks the
    step's metadata against this pool before a kernel indexes it (`check_metadata`; the engine's
    `check_kernels`)."""

    checked = True
    windows: tuple[int | None, ...] = ()   # each layer's sliding window (ModelConfig.layer_windows); (): none

    def __init__(self, model: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device):
        self.num_blocks, self.block_size = num_blocks, block_size
        # zeros, not empty: attention reads the unused slots of a sequence's last block (and masks
        # them), and a masked NaN from uninitialized memory would still give 0 * NaN = NaN
        self.kv = zeros(model.num_hidden_layers, 2, num_blocks, block_size,
                        model.num_key_value_heads, model.head_dim, dtype=dtype, device=device)
        # each layer's (k_cache, v_cache) views, made once: indexing self.kv costs microseconds,
        # and a decode step asks for every layer's
        self.views = [tuple(layer.unbind(0)) for layer in self.kv]

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache) of one layer, each (num_blocks, block_size, KVH, d)."""
        return self.views[layer_idx]

    def write(self, layer_idx: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new tokens' K/V: k, v (N, KVH, d) into the rows `slot_mapping` (N,)."""
        # >>> exercise write_kv (1 star): Store a step's new K and V in the pool: token i's vectors go to slot slot_mapping[i] of this layer.
        # hint: self.layer(layer_idx) gives (num_blocks, block_size, KVH, d) views; .view(-1, KVH, d) makes one row per slot; index_copy_(0, slot_mapping, k) writes them in place.
        # checked by: test_kv_write_puts_each_token_in_its_slot, test_greedy_equals_phase1
        k_cache, v_cache = self.layer(layer_idx)
        k_cache.view(-1, *k.shape[1:]).index_copy_(0, slot_mapping, k)
        v_cache.view(-1, *v.shape[1:]).index_copy_(0, slot_mapping, v)
        # <<< exercise write_kv
