"""Phase 7 engine: a persistent batch, static buffers, buckets, and captured decode steps.

What changes from phase 6, for decode-only steps (every scheduled request computes exactly its
one newest token; no prefill chunk, no speculative tokens):

- The step's requests live in an `InputBatch` that persists between steps and is updated with
  what changed (one token, sometimes one block), instead of lists rebuilt from every sequence.
- Its inputs are copied into `StaticDecodeBuffers` (fixed addresses, the largest size) and the
  batch is padded up to the next bucket of `cudagraph_capture_sizes`; padded rows write to a
  scratch KV block that the allocator never hands out.
- `DecodeRunner.run(bucket)` runs the forward: on CUDA a graph per bucket, captured once and
  replayed (`CudaGraphDecodeRunner`); on a CPU the same buffers eagerly, or with
  `compilation_mode=1` compiled by torch.compile, both graphs at start (`CompiledDecodeRunner`).
- The batch's sampling parameters are tensors, and the sampler is vectorized (`BatchSampler`,
  handed them by `sample`).
- At start, each layer's q/k/v and gate/up projections are fused into one product each, float or
  phase 5's int8/int4 (`fuse_projections`; the same outputs bit for bit, fewer operator calls;
  every step), and decode steps run `decode_forward`: the model's numbers with fewer operators
  around the products (the residual add fused with RMSNorm, one RoPE for q and k).

Parts: `make_model_runner` wraps phase 6's runner in a `StaticModelRunner`, which runs the
decode-only steps this way and hands every other step (prefill chunks, speculative verification,
more requests than the largest bucket) to phase 6's unchanged; `make_allocator` leaves out one
block (the scratch block); `sample` gives the vectorized sampler the static step's parameters.
`enforce_eager=True` is phase 6 exactly.
"""

from __future__ import annotations

import torch

from phases.p02_paged_kv import BlockAllocator
from phases.p02_paged_kv.block_allocator import cdiv
from phases.p06_speculative_decoding import Engine as Phase6Engine
from tinyvllm.sequence import Sequence

from .batch_sampler import BatchSampler
from .compiled import CompiledDecodeRunner
from .decode_runner import CudaGraphDecodeRunner, DecodeRunner, StaticDecodeBuffers, default_capture_sizes
from .fused import fuse_projections
from .input_batch import InputBatch
from .model_runner import StaticModelRunner


class Engine(Phase6Engine):
    """The phase 7 engine: phase 6, with decode-only steps on a persistent batch and static,
    bucketed buffers (CUDA graphs on a GPU)."""

    phase = 7
    ENGINE_ARGS = Phase6Engine.ENGINE_ARGS | {"enforce_eager", "cudagraph_capture_sizes", "compilation_mode"}

    def __init__(self, model=None, **engine_args):
        super().__init__(model, **engine_args)
        c = self.config
        self.capture_sizes = c.cudagraph_capture_sizes or default_capture_sizes(c.max_num_seqs)
        if c.enforce_eager:
            return
        if c.compilation_mode and self.device.type != "cpu":
            raise ValueError("compilation_mode=1 compiles the decode step on a CPU; on a GPU phase 7 "
                             "captures CUDA graphs (leave compilation_mode at 0)")
        # q/k/v and gate/up as one product each: bit-identical outputs, fewer operator calls
        self.num_fused_modules = fuse_projections(self.model)
        max_blocks = cdiv(self.max_model_len, self.block_size)
        self.input_batch = InputBatch(c.max_num_seqs, self.max_model_len, max_blocks)
        self.scratch_block = self.kv_cache.num_blocks - 1   # the block make_allocator left out
        self.buffers = StaticDecodeBuffers(self.capture_sizes[-1], max_blocks, self.block_size,
                                           self.scratch_block, self.device)
        self.runner = self.make_decode_runner()

    def make_decode_runner(self) -> DecodeRunner:
        """What runs a decode step on the static buffers: a CUDA graph per bucket on a GPU; on a
        CPU the same forward compiled by torch.compile (`compilation_mode=1`) or eagerly."""
        if self.device.type == "cuda":
            return CudaGraphDecodeRunner(self.model, self.buffers, self.kv_cache)
        if self.config.compilation_mode:
            return CompiledDecodeRunner(self.model, self.buffers, self.make_attention, self.capture_sizes)
        return DecodeRunner(self.model, self.buffers, self.make_attention)

    def make_sampler(self):
        """The sampler with a vectorized path for the static steps (`BatchSampler`)."""
        return super().make_sampler() if self.config.enforce_eager else BatchSampler(self.tokenizer)

    def make_allocator(self, num_blocks: int) -> BlockAllocator:
        # the pool's last block is the padded rows' scratch block: never handed out
        if self.config.enforce_eager:
            return super().make_allocator(num_blocks)
        if num_blocks < 2:
            raise ValueError(f"num_kv_blocks must be >= 2 when enforce_eager is False (one block is "
                             f"the scratch block of padded decode rows), got {num_blocks}")
        return super().make_allocator(num_blocks - 1)

    def make_model_runner(self):
        """Phase 6's runner, wrapped: decode-only steps run on the persistent batch and the static
        buffers (`StaticModelRunner`), every other step as before."""
        inner = super().make_model_runner()
        if self.config.enforce_eager:
            return inner
        return StaticModelRunner(inner, self.input_batch, self.buffers, self.runner, self.capture_sizes)

    @property
    def num_static_steps(self) -> int:
        """Decode steps run on the static buffers (for tests)."""
        return getattr(self.model_runner, "num_static_steps", 0)

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list]:
        """After a static step, the vectorized sampler with the persistent batch's parameters."""
        params = self.model_runner.take_batch_params() if not self.config.enforce_eager else None
        if params is None:
            return super().sample(logits, seqs)
        return self.sampler(logits, seqs, params)
