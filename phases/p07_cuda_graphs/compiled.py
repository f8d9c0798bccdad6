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

Shapes: the graph is compiled twice (`warm_up`): once for batch 1 (what latency runs) and once
for every larger bucket (the batch dimension marked dynamic). Inductor keeps what it compiled
under `$TINYVLLM_CACHE/inductor`, so a second start reads it back instead of compiling for a
minute; TorchDynamo's trace is redone at each start (seconds). Before each call TorchDynamo
checks the graph's *guards* (that the inputs still have the shapes, dtypes and objects the
graph was traced with), a fraction of a millisecond.

When: `compilation_mode=1` compiles both graphs before the engine takes its first request, as
vLLM does. By default (`compilation_mode=None`) a thread compiles them in the *background*
while the engine serves: every decode step runs eagerly until both graphs are ready, then
compiled; the first request never waits for the compiler. The thread compiles on rows of
its own (`warm_buf`, padding in the scratch block), never on the buffers the serving loop
fills, and the eager step and the compiled one give the same tokens (the checkpoint's tests),
so the switch shows only in the speed. A compile that fails leaves the engine eager, warned once.
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
import types
import warnings
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
# background compiles now running, and the interpreter's switch interval before the first began
_compiling = {"count": 0, "interval": None}
_compiling_lock = threading.Lock()
# While a thread compiles, the serving thread gives up the GIL at every PyTorch operator and
# then waits for the compiling thread to hand it back: at most the switch interval (5 ms by
# default), for each of a step's thousands of operators. A short interval keeps those waits
# short (measured on a 2-core AVX2 EPYC: a 16-token request beside the compile took 21 s with
# 5 ms, 4-7 s with 20 us, 2 s with no compile).
COMPILING_SWITCH_INTERVAL = 2e-5


def _switch_interval_while_compiling(start: bool) -> None:
    with _compiling_lock:
        if start:
            if _compiling["count"] == 0:
                _compiling["interval"] = sys.getswitchinterval()
                sys.setswitchinterval(COMPILING_SWITCH_INTERVAL)
            _compiling["count"] += 1
        else:
            _compiling["count"] -= 1
            if _compiling["count"] == 0:
                sys.setswitchinterval(_compiling["interval"])


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
    cache) by `warm_up` on the first two of `buckets`: before the engine starts, or with
    `background=True` in a thread while `run` serves eagerly."""

    def __init__(self, model, buffers: StaticDecodeBuffers, attention, buckets: list[int],
                 background: bool = False):
        super().__init__(model, buffers, attention)
        use_inductor_cache()
        self.context = next(_context_ids)
        self.compiled = None                  # made by warm_up (importing the compiler takes seconds)
        self.shapes_seen: set[bool] = set()   # batch 1 (True), larger (False)
        self.ready = threading.Event()        # set when both graphs are compiled
        self.compile_error: BaseException | None = None
        b, buckets = self.buf, buckets[:2]
        self.warm_buf = StaticDecodeBuffers(buckets[-1], b.block_tables.shape[1], b.block_size,
                                            b.scratch_block, b.input_ids.device)
        for bucket in buckets:
            # eagerly first, so what a first call makes (a C kernel built and loaded, a weight
            # packed) is made here, not traced, as a CUDA graph is captured after a warm-up run
            self.pad_warm_rows(bucket)
            with torch.inference_mode():
                super().run(bucket, self.warm_buf)
        if background:
            self.thread = threading.Thread(target=self.warm_up, args=(buckets, True),
                                           name="tinyvllm-compile", daemon=True)
            _switch_interval_while_compiling(True)
            self.thread.start()
        else:
            self.warm_up(buckets)

    def pad_warm_rows(self, bucket: int) -> None:
        """`warm_buf`'s first `bucket` rows: padding (token 0 in the scratch block, no request's)."""
        self.warm_buf.fill(torch.zeros(1, 1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64),
                           torch.full((1, 1), self.buf.scratch_block), torch.ones(1, dtype=torch.int64), bucket)

    def warm_up(self, buckets: list[int], background: bool = False) -> None:
        """Compile (or load from the cache) the graphs of these buckets, on `warm_buf`'s rows,
        then mark the runner ready. In the background a failure is warned and the engine stays
        eager; before the start it is raised."""
        try:
            self.compile(buckets)
        except Exception as e:
            if not background:
                raise
            self.compile_error = e
            warnings.warn(f"compiling the decode step failed ({type(e).__name__}: {e}); the engine "
                          f"goes on with the eager step", RuntimeWarning, stacklevel=1)
        else:
            self.ready.set()
        finally:
            if background:
                _switch_interval_while_compiling(False)

    def compile(self, buckets: list[int]) -> None:
        """Make the compiled function and compile a graph for each bucket."""
        # TorchDynamo keeps compiled graphs per code object, 8 at most: a copy of `forward`'s
        # code for each runner keeps every engine of a process within its own graphs
        forward = types.FunctionType(CompiledDecodeRunner.forward.__code__.replace(), globals())
        self.compiled = torch.compile(types.MethodType(forward, self), fullgraph=True,
                                      options={"cpp_wrapper": True})
        for bucket in buckets:
            self.pad_warm_rows(bucket)
            self.run(bucket, self.warm_buf)

    def wait_until_compiled(self, timeout: float | None = None) -> bool:
        """Block until the background compile has finished (True) or failed (False)."""
        thread = getattr(self, "thread", None)
        if thread is not None:
            thread.join(timeout)
        return self.ready.is_set()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """What is compiled: the decode forward and the LM head, (B,) ids -> (B, V) logits."""
        context = self.context

        def attn(layer_idx, q, k, v):
            return torch.ops.tinyvllm.unified_attention(q, k, v, context, layer_idx)

        return self.model.compute_logits(self.model_forward(input_ids, positions, attn))

    def run(self, bucket: int, buf: StaticDecodeBuffers | None = None) -> torch.Tensor:
        """The compiled decode on the first `bucket` rows of the buffers -> logits (bucket, V);
        the eager one while the graphs are still compiling. `buf`: the compile's own rows."""
        if buf is None and not self.ready.is_set():
            return super().run(bucket)
        b = self.buf if buf is None else buf
        # >>> exercise compiled_run (2 stars): Run the compiled graph on the first `bucket` rows of b: batch 1 with every shape fixed, any larger bucket through one graph whose batch dimension is dynamic, and this step's attention in the forward context while it runs.
        # hint: torch._dynamo.mark_dynamic(t, 0) on the ids and positions views when bucket > 1 (so the first graph compiled for a larger bucket is already dynamic, not static and recompiled); record bucket == 1 in shapes_seen; _FORWARD_CONTEXT[self.context] = self.attention(b.metadata(bucket)), removed in a finally; call self.compiled under torch.inference_mode().
        # checked by: test_compiled_step_gives_eager_tokens, test_compiled_logits_equal_eager_and_two_graphs_serve_every_bucket, test_buckets_above_one_share_a_graph_dynamic_from_its_first_compile, test_every_engine_of_a_process_runs_its_own_graphs
        ids, positions = b.input_ids[:bucket], b.positions[:bucket]
        if bucket > 1:  # one graph for every bucket above 1
            torch._dynamo.mark_dynamic(ids, 0)
            torch._dynamo.mark_dynamic(positions, 0)
        self.shapes_seen.add(bucket == 1)
        _FORWARD_CONTEXT[self.context] = self.attention(b.metadata(bucket))
        try:
            with torch.inference_mode():
                return self.compiled(ids, positions)
        finally:
            del _FORWARD_CONTEXT[self.context]
        # <<< exercise compiled_run
