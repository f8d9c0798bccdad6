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

- the layers with a C product of their own (`torch.ops.tinyvllm.opaque_linear(x, index,
  out_features)`): `make_opaque` wraps each of phase 5's `QuantizedLinear` and `LosslessLinear`
  layers (and float32 ones where cpu_gemv.c serves) so that, while compiling, it becomes this
  operator, which runs the model's layer number `index` as it runs eagerly (its C product);
- attention, `torch.ops.tinyvllm.unified_attention(layer_idx, q, k, v)`: it writes the step's
  K/V into the cache and attends through the recipe's attention part for this step (any phase's:
  paged, int8 KV, batch-invariant). Both find what they need in the *forward context* (`_STEP`,
  the thread's own) that the runner sets before the graph runs. The KV cache is not an input of
  the graph: a compiled graph that mutates a tensor it was given copies it back at every call.

Shapes: two graphs (`make_graph`), one for batch 1 (what latency runs) and one for every larger
bucket (the batch dimension marked dynamic). Each is compiled ahead of its use
(`torch.compile(...).aot_compile`) and saved whole, TorchDynamo's trace and guards with
inductor's code, under `$TINYVLLM_CACHE/compiled` (`save_compiled_function`; the key: the
model's shapes, this CPU, torch and the source), so an engine of the same model reads them back
in about a second instead of tracing (seconds) and compiling (a minute). The guards are checked
once when a graph is read; the runner calls each graph only with its own shape.

When: `compilation_mode=1` makes both graphs before the engine takes its first request, as vLLM
does. By default (`compilation_mode=None`) no request waits: once the engine has run
`COMPILE_AFTER_STEPS` decode steps (a run long enough to earn back what making the graphs costs
the serving thread), a thread reads the saved graphs while the engine serves, and where none are
saved yet it first has a worker process compile and save them (`compile_worker`: a compile in a
thread would hold the interpreter's lock and patch `nn.Module.__call__` under the serving loop).
Decode steps run eagerly until both graphs are ready, then compiled; the two give the same
tokens (the checkpoint's tests), so the switch shows only in the speed. A compile that fails
leaves the engine eager, warned once.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import itertools
import json
import os
import subprocess
import sys
import threading
import types
import warnings
import weakref
from pathlib import Path

import torch
from torch import nn

from phases.p04_triton_kernels.cpu_attention import attention_row
from phases.p05_quantization import QuantizedLinear
from phases.p05_quantization.lossless import LosslessLinear
from phases.workspace import REFERENCE
from tinyvllm.ckernel import torch_extension
from tinyvllm.download import cache_dir, private_dir
from phases.p04_triton_kernels.cpu_layers import CpuLinear, bfloat16_weights
from tinyvllm import platform
from tinyvllm.hardware import AVX2_FLAGS
from tinyvllm.secret_env import child_env

from .decode_runner import DecodeRunner, StaticDecodeBuffers
from .fused import decode_forward, fused_model, layer_row

# The step now running in this thread (vLLM's forward context): its attention and the model's
# opaque layers, found by the operators below while a compiled graph runs. A thread's own, so a
# background compile and the serving loop never see each other's.
_STEP = threading.local()
# In the background the graphs are made (compiled by a worker where none is saved, then read)
# only once the engine has run this many decode steps eagerly, or a waiter asks. Making them costs
# the serving thread: reading imports TorchDynamo and inductor (about 3 s of Python holding the
# interpreter's lock, on a 2-core CPU), and a compiling worker shares the cores for a minute or
# more; a compiled step saves 5 to 9 ms at batch 1 (lab note 7). So a run of a few hundred tokens would lose
# by it, and stays eager; a longer one starts paying here, having lost at most what the graphs
# cost (ski rental: rent until the rent adds up to the price, then buy).
COMPILE_AFTER_STEPS = 512


# The operators: a schema and a kernel each, registered with torch.library.Library (not
# torch.library.custom_op, whose Python wrapper cost about 58 us a call against Library's 16
# here: a decode step of the default model calls them 151 times).
_LIBRARY = torch.library.Library("tinyvllm", "FRAGMENT")


def _operator(schema: str, kernel, fake) -> None:
    for twin in ("", "_eager"):  # cpu_ops.cpp's C++ kernels call the *_eager twin for what they leave
        name, _, args = schema.partition("(")
        _LIBRARY.define(f"{name}{twin}({args}")
        _LIBRARY.impl(name + twin, kernel, "CompositeExplicitAutograd")
        torch.library.register_fake(f"tinyvllm::{name}{twin}", fake, lib=_LIBRARY)


def opaque_linear(x: torch.Tensor, index: int, out_features: int) -> torch.Tensor:
    """The model's opaque layer number `index`, run eagerly on x (N, I) -> (N, out_features)."""
    return _STEP.layers[index](x)


_operator("opaque_linear(Tensor x, int index, int out_features) -> Tensor", opaque_linear,
          lambda x, index, out_features: x.new_empty(x.shape[0], out_features))


class OpaqueLinear(nn.Module):
    """A layer the compiler does not look into: eagerly, the layer itself; while compiling, the
    operator `opaque_linear`, which calls it by its number in the model."""

    def __init__(self, layer: nn.Module, index: int):
        super().__init__()
        self.layer, self.index, self.out_features = layer, index, layer.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.tinyvllm.opaque_linear(x, self.index, self.out_features)
        return self.layer(x)


def make_opaque(model: nn.Module) -> int:
    """Wrap every `QuantizedLinear` and `LosslessLinear` of `model`, and each `CpuLinear` with a
    product of its own (cpu_gemv.c, bfloat16's `upcast_linear`), in an `OpaqueLinear`, in place,
    numbered in the model's order (`model.opaque_layers`: each one's product as a callable,
    `kernel_call` or the layer itself; the same numbers in every process); returns how many."""
    layers = []
    for name, m in list(model.named_modules()):
        if type(m) in (QuantizedLinear, LosslessLinear) or type(m) is CpuLinear and m.has_own_product():
            parent_name, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent_name), attr, OpaqueLinear(m, len(layers)))
            layers.append(m)
    model.opaque_layers = [m.kernel_call() if type(m) is QuantizedLinear else m for m in layers]
    model.native_layers = torch.tensor([layer_row(m) for m in layers], dtype=torch.int64).view(-1, 10)
    model.native_layers.packed = bfloat16_weights(layers)   # for cpu_ops.cpp's bfloat16 products
    return len(layers)


def unified_attention(layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Write k, v (N, KVH, d) into the cache and attend with q (N, H, d) -> (N, H, d), through
    the attention backend of the step running in this thread."""
    return _STEP.attention(layer_idx, q, k, v).contiguous()


_operator("unified_attention(int layer_idx, Tensor q, Tensor k, Tensor v) -> Tensor", unified_attention,
          lambda layer_idx, q, k, v: q.new_empty(q.shape))  # contiguous, as the real one returns


# The two operators' C++ kernels (cpu_ops.cpp, see its comment): registered for the CPU dispatch
# key, they run in place of the Python ones above, which they call for what they do not serve.
NATIVE = torch_extension(Path(__file__).with_name("cpu_ops.cpp"), AVX2_FLAGS,
                         {"use_step": [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]},
                         "the compiled step calls its operators through Python")


def use_step(layers: torch.Tensor | None, attention=None) -> None:
    """Hand cpu_ops.cpp this thread's step: the model's layer table (a `layer_row` per opaque
    layer, with the packed bfloat16 weights `make_opaque` keeps on it) and its `attention_row`;
    with None, take it back (before the tables can go)."""
    if NATIVE.lib is not None:
        _STEP.row = row = None if layers is None else attention_row(attention)   # alive while read
        NATIVE.lib.use_step(None if layers is None else layers.data_ptr(), 0 if layers is None else len(layers),
                            None if row is None else row.data_ptr())
        torch.ops.tinyvllm.use_packed(*(getattr(layers, "packed", None) or ([], [], [], 0, 0)))   # bfloat16 weights


def use_inductor_cache() -> None:
    """Keep inductor's compiled code under $TINYVLLM_CACHE (unless TORCHINDUCTOR_CACHE_DIR says
    otherwise), beside the model and the C kernels, in a folder that is this user's alone
    (`private_dir`: inductor loads the libraries it finds there)."""
    if not os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(private_dir(cache_dir() / "inductor"))


# tinyvllm and the phases; and, where this file is a learner's copy, the folder of their copies
SOURCES = tuple(dict.fromkeys((REFERENCE.parent / "tinyvllm", REFERENCE, Path(__file__).resolve().parents[1])))


def compile_key(model: nn.Module) -> str:
    """What a saved graph depends on: the model (its config, modules and the rows from which they
    multiply in bfloat16, parameters' and buffers' shapes and dtypes), this CPU's instruction sets
    (inductor's loops are compiled for them), torch and Python, and the source of tinyvllm and
    its phases (a changed line compiles again; their tests are not part of it)."""
    tensors = itertools.chain(model.named_parameters(), model.named_buffers())
    parts = [repr(getattr(model, "config", None)), platform.current().kind, sorted(platform.current().flags), torch.__version__,
             sys.version, [(n, type(m).__name__, getattr(m, "bf16_rows", 0)) for n, m in model.named_modules()],
             [(n, tuple(t.shape), str(t.dtype)) for n, t in tensors],
             [f.read_bytes() for root in SOURCES for f in sorted(root.rglob("*.py")) if not f.name.startswith("test_")]]
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:24]


def compiled_forward(model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """What is compiled: the decode forward and the LM head, (B,) ids -> (B, V) logits."""
    attn = torch.ops.tinyvllm.unified_attention   # (layer_idx, q, k, v), as eager attention is called
    if fused_model(model):
        return model.compute_logits(decode_forward(model, input_ids, positions, attn))
    return model.compute_logits(model(input_ids, positions, attn))


class CompiledDecodeRunner(DecodeRunner):
    """`DecodeRunner` with the forward and the LM head compiled by torch.compile (inductor's C++
    backend): one graph for batch 1, one for every larger bucket, each read from the cache of
    compiled graphs or compiled (and saved) by `warm_up` before the engine starts; or, with
    `background`, the request a compile worker process is started with (if the cache lacks a
    graph), by a thread that then reads the graphs while `run` serves eagerly, once the engine
    has run `COMPILE_AFTER_STEPS` decode steps."""

    def __init__(self, model, buffers: StaticDecodeBuffers, attention, buckets: list[int],
                 background: dict | None = None):
        super().__init__(model, buffers, attention)
        self.opaque_layers = getattr(model, "opaque_layers", [])
        self.native_layers = getattr(model, "native_layers", None)   # the same layers, for cpu_ops.cpp
        self.key = compile_key(model)
        self.graphs: dict[bool, object] = {}  # batch 1 (True), every larger bucket (False)
        self.num_loaded = self.num_compiled = 0
        self.shapes_seen: set[bool] = set()   # batch 1 (True), larger (False)
        # ready: set when every graph is made; due: after COMPILE_AFTER_STEPS eager decode steps
        # (counted in eager_steps), or by a waiter
        self.ready, self.due, self.eager_steps = threading.Event(), threading.Event(), 0
        self.compile_error: BaseException | None = None
        buckets = sorted({b == 1: b for b in reversed(buckets)}.values())  # 1, the smallest above 1
        b = self.buf
        # rows of the runner's own, padding (token 0 in the scratch block, no request's)
        self.warm_buf = StaticDecodeBuffers(buckets[-1], b.block_tables.shape[1], b.block_size,
                                            b.scratch_block, b.input_ids.device)
        self.warm_buf.fill(torch.zeros(1, 1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64),
                           torch.full((1, 1), b.scratch_block), torch.ones(1, dtype=torch.int64), buckets[-1])
        for bucket in buckets:
            # eagerly first, so what a first call makes (a C kernel built and loaded, a weight
            # packed) is made here, not traced, as a CUDA graph is captured after a warm-up run
            with torch.inference_mode():
                super().run(bucket, self.warm_buf)
        self.worker: subprocess.Popen | None = None
        self.thread = threading.Thread(target=self.warm_up, args=(buckets, background), daemon=True)
        self.thread.start() if background else self.warm_up(buckets)

    def warm_up(self, buckets: list[int], background: dict | None = None) -> None:
        """Make the graph of each bucket's shape, run it once on `warm_buf`'s rows, then mark the
        runner ready. In the background (`background`: the compile worker's request), once the
        graphs are due, those the cache lacks are compiled by the worker first, and only read
        here; a failure is warned and the engine stays eager. Before the start a failure is
        raised."""
        try:
            use_inductor_cache()   # here: a folder refused is then the background's warning, the start's error
            # in the background, once due (wait() returns True), the worker compiles what is not saved
            if background and self.due.wait() and not all(self.graph_path(b).is_file() for b in buckets):
                self.compile_in_worker(background)
            for bucket in buckets:
                self.make_graph(bucket, compile=not background)
                self.run(bucket, self.warm_buf)
            NATIVE.load()   # the operators' C++ kernels: built once per machine, loaded here
        except Exception as e:
            if not background:
                raise
            self.compile_error = e
            # a killed worker: the engine or the interpreter went away first, nothing to warn about
            if not (self.worker and self.worker.returncode < 0):
                warnings.warn(f"compiling the decode step failed ({type(e).__name__}: {e}); the engine "
                              f"goes on with the eager step", RuntimeWarning, stacklevel=1)
        else:
            self.ready.set()

    def compile_in_worker(self, request: dict) -> None:
        """Run `compile_worker` on `request` and wait for it (see its docstring for why a
        process); it is killed if this engine is collected or the interpreter exits first."""
        worker = str(Path(__file__).with_name("compile_worker.py"))
        self.worker = subprocess.Popen([sys.executable, worker, json.dumps(request)], stdout=subprocess.DEVNULL,
                                       stderr=subprocess.PIPE, text=True, env=child_env())
        weakref.finalize(self, self.worker.kill)
        _, err = self.worker.communicate()
        if self.worker.returncode != 0:
            last = (err or "").strip().splitlines()[-1:] or ["no message"]
            raise RuntimeError(f"the compile worker exited with {self.worker.returncode}: {last[0]}")

    def graph_path(self, bucket: int) -> Path:
        """Where `bucket`'s graph is saved: in a folder that is this user's alone (`private_dir`),
        as a saved graph is code this process runs."""
        return private_dir(cache_dir() / "compiled") / f"decode-{self.key}-{'b1' if bucket == 1 else 'dynamic'}.bin"

    @torch.inference_mode()
    def make_graph(self, bucket: int, compile: bool = True) -> None:
        """The graph for `bucket`'s shape: read from the cache (TorchDynamo's trace, its guards
        and inductor's code, saved by `save_compiled_function`: no tracing, a second or so), or
        (`compile`) traced, compiled and saved (a minute or more). A saved graph whose guards
        refuse this engine's inputs is compiled again."""
        ids, positions = self.warm_buf.input_ids[:bucket], self.warm_buf.positions[:bucket]
        path, graph = self.graph_path(bucket), None
        with contextlib.suppress(Exception):   # none saved, or another torch's, or damaged: compile
            with open(path, "rb") as f:
                graph = torch.compiler.load_compiled_function(f)
            graph = graph if graph.guard_check(self.model, ids, positions) else None
        if graph is not None:
            self.num_loaded += 1
        elif not compile:
            raise RuntimeError(f"no usable compiled graph at {path}")
        else:
            for t in (ids, positions) if bucket > 1 else ():   # one graph for every bucket above 1
                torch._dynamo.mark_dynamic(t, 0)
            # a code object of its own, floats as constants and no size made dynamic but the one
            # marked: TorchDynamo otherwise makes what changed since another engine's compile (its
            # shapes, its eps) symbolic, which aot_compile cannot restart from
            forward = types.FunctionType(compiled_forward.__code__.replace(), compiled_forward.__globals__)
            compiler = torch.compile(forward, fullgraph=True, options={"cpp_wrapper": True})
            with torch._dynamo.config.patch(specialize_float=True, automatic_dynamic_shapes=False):
                graph = compiler.aot_compile(((self.model, ids, positions), {}))
            self.num_compiled += 1
            with contextlib.suppress(OSError):   # unsaved, the next start compiles again
                graph.save_compiled_function(str(path))
        # checked once here; the runner calls each graph only with its own shape
        graph.disable_guard_check()
        self.graphs[bucket == 1] = graph

    def wait_until_compiled(self, timeout: float | None = None) -> bool:
        """Block until the background compile has finished (True) or failed (False)."""
        self.due.set()                      # compile or read them now
        if self.thread.ident is not None:   # started: compiling in the background
            self.thread.join(timeout)
        return self.ready.is_set()

    def run(self, bucket: int, buf: StaticDecodeBuffers | None = None) -> torch.Tensor:
        """The compiled decode on the first `bucket` rows of the buffers -> logits (bucket, V);
        the eager one while the graphs are still being made, and for one row where no bucket of 1
        was compiled (`cudagraph_capture_sizes` without 1); cpu_step.c's at the rows it serves
        (faster than a graph there: lab note 7). `buf`: the compile's own rows."""
        if buf is None and self.c_step and self.c_step.serves(bucket):
            return super().run(bucket)
        if buf is None and not self.ready.is_set():
            self.eager_steps += 1
            if self.eager_steps >= COMPILE_AFTER_STEPS:
                self.due.set()
            return super().run(bucket)
        if buf is None and (bucket == 1) not in self.graphs:   # one row, and no bucket of 1 was compiled
            return super().run(bucket)
        b = self.buf if buf is None else buf
        # >>> exercise compiled_run (2 stars): Run the graph made for this bucket's shape on the first `bucket` rows of b, with this step's attention and the model's opaque layers in the thread's forward context while it runs.
        # hint: self.graphs[bucket == 1] (batch 1 has a graph of its own, every larger bucket shares one whose batch dimension is dynamic); record bucket == 1 in shapes_seen; set _STEP.attention = self.attention(b.metadata(bucket)) and _STEP.layers = self.opaque_layers, and the same step to the C++ kernels with use_step(self.native_layers, _STEP.attention); both taken back in a finally (use_step(None)); call graph(self.model, ids, positions) under torch.inference_mode().
        # checked by: test_compiled_run_calls_the_graph_of_its_shape_in_the_step_s_context, test_compiled_step_gives_eager_tokens, test_compiled_logits_equal_eager_and_two_graphs_serve_every_bucket, test_every_engine_of_a_process_runs_its_own_graphs
        ids, positions = b.input_ids[:bucket], b.positions[:bucket]
        graph = self.graphs[bucket == 1]
        self.shapes_seen.add(bucket == 1)
        _STEP.attention, _STEP.layers = self.attention(b.metadata(bucket)), self.opaque_layers
        use_step(self.native_layers, _STEP.attention)   # the same step, for cpu_ops.cpp
        try:
            with torch.inference_mode():
                return graph(self.model, ids, positions)
        finally:
            use_step(None)
            del _STEP.attention
        # <<< exercise compiled_run
