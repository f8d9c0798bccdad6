"""Phase 8 engine: tensor parallelism, one model over several ranks.

With `tensor_parallel_size=N` (vLLM's name), the engine runs as N ranks over `torch.distributed`
(gloo on a CPU). This process is rank 0, the driver: it keeps the scheduler, the block tables,
the sampler and everything else of phase 7, and runs its share of the model. Ranks 1 .. N-1 are
worker processes it starts itself (`worker.py`), each with its own share of every weight
(`layers.shard_model`: heads, MLP columns, vocabulary) and of the KV cache (its heads; the blocks
and their tables are the driver's, shared by all).

A step is the driver's step. Every forward the driver runs (a prefill or mixed step through
phase 6's runner, a decode step through phase 7's `DecodeRunner`), and every logits call, is
first broadcast to the workers with its inputs, so all ranks run it together and meet at the
same all-reduces (`TensorParallelLlama`, `make_decode_runner`). The logits come back to the
driver alone.

Parts: `make_model` loads the model and keeps this rank's share; `make_kv_cache` sizes the
pool for this rank's KV heads; `make_decode_runner` sends each static decode step to the workers
before running it. `tensor_parallel_size=1` is phase 7 exactly.
"""

from __future__ import annotations

import weakref

import torch

from phases.p07_cuda_graphs import Engine as Phase7Engine
from phases.p07_cuda_graphs.decode_runner import DecodeRunner

from .layers import TensorParallelLlama, shard_model
from .parallel import TensorParallelGroup, available_cores, rendezvous_port
from .worker import start_workers, stop_workers, threads_per_rank


class Engine(Phase7Engine):
    """The phase 8 engine: phase 7 over `tensor_parallel_size` ranks."""

    phase = 8
    ENGINE_ARGS = Phase7Engine.ENGINE_ARGS | {"tensor_parallel_size"}

    def __init__(self, model=None, *, _tensor_parallel_rank: int = 0, **engine_args):
        self.group = TensorParallelGroup(_tensor_parallel_rank, 1)
        self.workers: list = []
        super().__init__(model, **engine_args)
        if self.group.world == 1 or not self.group.is_driver:
            return
        # the workers build the same engine with their rank, the driver's pool of blocks, and
        # no proposer (drafts are the driver's: a worker only runs the model)
        worker_args = dict(engine_args, num_kv_blocks=self.kv_cache.num_blocks, speculative_config=None)
        port = rendezvous_port()
        store = self.group.store(port)
        self.workers = start_workers(store, self.group.world, port, str(self.model_path), worker_args)
        try:
            self.group.connect(store)
        except BaseException:
            stop_workers(self.workers)
            raise
        self._finalizer = weakref.finalize(self, stop_workers, self.workers, self.group)

    def make_model(self):
        """The model, of which this rank keeps its share (`shard_model`) when there are several."""
        world = self.config.tensor_parallel_size
        if world > 1:
            if self.device.type != "cpu":
                raise ValueError(f"tensor_parallel_size={world}: more than one rank runs on a CPU "
                                 f"(gloo); on {self.device.type} use tensor_parallel_size=1")
            if self.config.compilation_mode:
                raise ValueError(f"compilation_mode=1 with tensor_parallel_size={world}: the compiled "
                                 f"decode step runs on one rank; use compilation_mode=0 with several")
            cores = available_cores()
            if world > cores:
                raise ValueError(f"tensor_parallel_size={world} is more ranks than this machine's "
                                 f"{cores} CPU cores")
        model = super().make_model()
        self.group.world = world
        if world == 1:
            return model
        self.shard_config = shard_model(model, self.group)
        return TensorParallelLlama(model, self.model_config, self.group)

    def make_kv_cache(self):
        """This rank's share of the KV cache: the pool of phase 7 (float or quantized), for this
        rank's KV heads only."""
        if self.group.world == 1:
            return super().make_kv_cache()
        full, self.model_config = self.model_config, self.shard_config
        try:
            return super().make_kv_cache()
        finally:
            self.model_config = full

    def make_decode_runner(self) -> DecodeRunner:
        """Phase 7's decode runner; on the driver of several ranks, each decode forward is first
        sent to the workers."""
        runner = super().make_decode_runner()
        if self.group.world > 1 and self.group.is_driver and runner.model_forward is not self.model:
            forward, group = runner.model_forward, self.group

            def driver_forward(input_ids, positions, attn):
                group.broadcast_object(("decode_forward", input_ids, positions, attn.meta))
                return forward(input_ids, positions, attn)

            runner.model_forward = driver_forward
        return runner

    def step(self):
        """Phase 7's step, with the driver on its share of the cores (the workers have theirs):
        PyTorch's threads on more cores than there are would wait on each other at every
        all-reduce."""
        if self.group.world == 1:
            return super().step()
        threads = torch.get_num_threads()
        torch.set_num_threads(threads_per_rank(self.group.world))
        try:
            return super().step()
        finally:
            torch.set_num_threads(threads)

    def shutdown(self) -> None:
        """Stop the worker ranks (also done when the engine is garbage-collected)."""
        if self.workers:
            self._finalizer()
