"""The decode step compiled on a CPU: what a CUDA graph does for a GPU, done by a compiler.

An eager decode step is some 2,000 operator calls from Python; on a CPU each costs microseconds
of dispatch besides its arithmetic, a third or more of a batch-1 step of the default model.
A CPU has no graph to replay, but `torch.compile` can take the whole decode forward (embedding,
30 layers, final norm, LM head) as one graph: TorchDynamo traces it once, and inductor turns
everything between the matrix products into a few C++ loops (an RMSNorm, the residual add,
RoPE, SiLU-times-up each become one loop), compiled once and called from generated C++
(`cpp_wrapper`), with no Python between the operators.

Two kinds of call stay opaque inside the graph, each through an operator registered with
`torch.library`, as vLLM's are:

- phase 5's C products (`torch.ops.tinyvllm.int8_matmul` and the others, `cpu_int8.py`);
- attention, `torch.ops.tinyvllm.unified_attention(q, k, v, context, layer_idx)`: it writes the
  step's K/V into the cache and attends through the engine's own attention backend for this
  step (any phase's: paged, int8 KV, batch-invariant), found in a *forward context* set
  before the graph runs. The KV cache is not an input of the graph: a compiled graph that
  mutates a tensor it was given copies it back at every call (a cache of hundreds of MB).

Shapes: the graph is compiled twice, at engine start (`warm_up`): once for batch 1 (what
latency runs) and once for every larger bucket (the batch dimension marked dynamic). Inductor
keeps what it compiled under `$TINYVLLM_CACHE/inductor`, so a second start reads it back
instead of compiling for a minute; TorchDynamo's trace is redone at each start (seconds).
Before each call TorchDynamo checks the graph's *guards* (that the inputs still have the
shapes, dtypes and objects the graph was traced with), a fraction of a millisecond.
"""

from __future__ import annotations

import itertools
import os
import types

import torch

from tinyvllm.download import cache_dir

from .decode_runner import DecodeRunner, StaticDecodeBuffers

# context id -> the attention backend of the step now running (vLLM's forward context)
_FORWARD_CONTEXT: dict[int, object] = {}
_context_ids = itertools.count()


@torch.library.custom_op("tinyvllm::unified_attention", mutates_args=())
def unified_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context: int,
                      layer_idx: int) -> torch.Tensor:
    """Write k, v (N, KVH, d) into the cache and attend with q (N, H, d) -> (N, H, d), through
    the attention backend of the step that `context` names."""
    return _FORWARD_CONTEXT[context](layer_idx, q, k, v).contiguous()


@unified_attention.register_fake
def _(q, k, v, context, layer_idx):
    return q.new_empty(q.shape)  # contiguous, as the real one returns


def use_inductor_cache() -> None:
    """Keep inductor's compiled code under $TINYVLLM_CACHE (unless TORCHINDUCTOR_CACHE_DIR says
    otherwise), beside the model and the C kernels."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor"))


class CompiledDecodeRunner(DecodeRunner):
    """`DecodeRunner` with the forward and the LM head compiled by torch.compile (inductor's C++
    backend): one graph for batch 1, one for larger buckets, both compiled (or read from the
    cache) at start by running `warm_up` on the first two of `buckets`."""

    def __init__(self, model, buffers: StaticDecodeBuffers, make_attention, buckets: list[int]):
        super().__init__(model, buffers, make_attention)
        use_inductor_cache()
        self.context = next(_context_ids)
        # TorchDynamo keeps compiled graphs per code object, 8 at most: a copy of `forward`'s
        # code for each runner keeps every engine of a process within its own graphs
        forward = types.FunctionType(CompiledDecodeRunner.forward.__code__.replace(), globals())
        self.compiled = torch.compile(types.MethodType(forward, self), fullgraph=True,
                                      options={"cpp_wrapper": True})
        self.shapes_seen: set[bool] = set()   # batch 1 (True), larger (False)
        self.warm_up(buckets[:2])

    def warm_up(self, buckets: list[int]) -> None:
        """Compile (or load from the cache) the graphs of these buckets now, at engine start, as
        vLLM does, instead of at the first steps of a request. Each bucket runs on rows of
        padding (token 0 in the scratch block, which no request owns): first eagerly, so that
        what is made at a first call (a C kernel built and loaded, a weight packed) is not
        traced, as a CUDA graph is captured after a warm-up run; then compiled."""
        b = self.buf
        for bucket in buckets:
            b.fill(torch.zeros(1, 1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64),
                   torch.full((1, 1), b.scratch_block), torch.ones(1, dtype=torch.int64), bucket)
            with torch.inference_mode():
                super().run(bucket)
            self.run(bucket)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """What is compiled: the decode forward and the LM head, (B,) ids -> (B, V) logits."""
        context = self.context

        def attn(layer_idx, q, k, v):
            return torch.ops.tinyvllm.unified_attention(q, k, v, context, layer_idx)

        return self.model.compute_logits(self.model_forward(input_ids, positions, attn))

    def run(self, bucket: int) -> torch.Tensor:
        ids, positions = self.buf.input_ids[:bucket], self.buf.positions[:bucket]
        if bucket > 1:  # one graph for every bucket above 1
            torch._dynamo.mark_dynamic(ids, 0)
            torch._dynamo.mark_dynamic(positions, 0)
        self.shapes_seen.add(bucket == 1)
        _FORWARD_CONTEXT[self.context] = self.make_attention(self.metadata(bucket))
        try:
            with torch.inference_mode():
                return self.compiled(ids, positions)
        finally:
            del _FORWARD_CONTEXT[self.context]
