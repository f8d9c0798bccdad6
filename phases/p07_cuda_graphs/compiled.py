"""The decode step compiled on a CPU: what a CUDA graph does for a GPU, done by a compiler.

An eager decode step is some 2,000 operator calls from Python; on a CPU each costs microseconds
of dispatch besides its arithmetic, a third or more of a batch-1 step of the default model.
A CPU has no graph to replay, but `torch.compile` can take the whole decode forward (embedding,
30 layers, final norm, LM head) as one graph: TorchDynamo traces it once, and inductor turns
everything between the matrix products into a few C++ loops (an RMSNorm, the residual add,
RoPE, SiLU-times-up each become one loop), compiled once and called from generated C++
(`cpp_wrapper`), with no Python between the operators.

Two kinds of call stay opaque inside the graph, each through an operator registered with
`torch.library`, as vLLM's are (TorchDynamo cannot trace into a ctypes call: it would cut the
graph in two; an operator is called by the compiled graph as PyTorch's own are, and its *fake*
version tells the compiler the output's shape without running it):

- phase 5's quantized layers (`torch.ops.tinyvllm.opaque_linear(x, handle, out_features)`):
  `make_opaque` wraps each `QuantizedLinear` so that, while compiling, it becomes this operator,
  which runs the layer as it runs eagerly (its C product) on the rows it is given;
- attention, `torch.ops.tinyvllm.unified_attention(q, k, v, context, layer_idx)`: it writes the
  step's K/V into the cache and attends through the recipe's attention part for this step (any
  phase's: paged, int8 KV, batch-invariant), found in a *forward context* set before the graph
  runs. The KV cache is not an input of the graph: a compiled graph that mutates a tensor it
  was given copies it back at every call (a cache of hundreds of MB).

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
import weakref

import torch
from torch import nn

from phases.p05_quantization import QuantizedLinear
from tinyvllm.download import cache_dir

from .decode_runner import DecodeRunner, StaticDecodeBuffers

# context id -> the attention of the step now running (vLLM's forward context)
_FORWARD_CONTEXT: dict[int, object] = {}
_context_ids = itertools.count()
# handle -> a layer that a compiled graph runs as one operator (registries, not state)
_OPAQUE_LAYERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_layer_ids = itertools.count()


@torch.library.custom_op("tinyvllm::opaque_linear", mutates_args=())
def opaque_linear(x: torch.Tensor, handle: int, out_features: int) -> torch.Tensor:
    """The layer `handle` names, run eagerly on x (N, I) -> (N, out_features)."""
    return _OPAQUE_LAYERS[handle](x)


@opaque_linear.register_fake
def _(x, handle, out_features):
    return x.new_empty(x.shape[0], out_features)


class OpaqueLinear(nn.Module):
    """A layer the compiler does not look into: eagerly, the layer itself; while compiling, the
    operator `opaque_linear`, which calls it."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer, self.handle = layer, next(_layer_ids)
        self.out_features = layer.out_features
        _OPAQUE_LAYERS[self.handle] = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.tinyvllm.opaque_linear(x, self.handle, self.out_features)
        return self.layer(x)


def make_opaque(model: nn.Module) -> int:
    """Wrap every `QuantizedLinear` of `model` in an `OpaqueLinear`, in place; returns how many."""
    count = 0
    for name, m in list(model.named_modules()):
        if type(m) is QuantizedLinear:
            parent_name, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent_name), attr, OpaqueLinear(m))
            count += 1
    return count


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

    def __init__(self, model, buffers: StaticDecodeBuffers, attention, buckets: list[int]):
        super().__init__(model, buffers, attention)
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
        """The compiled decode on the first `bucket` rows of the buffers -> logits (bucket, V)."""
        # >>> exercise compiled_run (2 stars): Run the compiled graph on the first `bucket` rows: batch 1 with every shape fixed, any larger bucket through one graph whose batch dimension is dynamic, and this step's attention in the forward context while it runs.
        # hint: torch._dynamo.mark_dynamic(t, 0) on the ids and positions views when bucket > 1 (so the first graph compiled for a larger bucket is already dynamic, not static and recompiled); record bucket == 1 in shapes_seen; _FORWARD_CONTEXT[self.context] = self.attention(self.buf.metadata(bucket)), removed in a finally; call self.compiled under torch.inference_mode().
        # checked by: test_compiled_step_gives_eager_tokens, test_compiled_logits_equal_eager_and_two_graphs_serve_every_bucket, test_buckets_above_one_share_a_graph_dynamic_from_its_first_compile, test_every_engine_of_a_process_runs_its_own_graphs
        ids, positions = self.buf.input_ids[:bucket], self.buf.positions[:bucket]
        if bucket > 1:  # one graph for every bucket above 1
            torch._dynamo.mark_dynamic(ids, 0)
            torch._dynamo.mark_dynamic(positions, 0)
        self.shapes_seen.add(bucket == 1)
        _FORWARD_CONTEXT[self.context] = self.attention(self.buf.metadata(bucket))
        try:
            with torch.inference_mode():
                return self.compiled(ids, positions)
        finally:
            del _FORWARD_CONTEXT[self.context]
        # <<< exercise compiled_run
