"""The tensor-parallel executor: the driver's runner, run on its share of the cores, with the
worker ranks it started alive beside it.

With `tensor_parallel_size=N` this process is rank 0, the driver: it keeps the scheduler, the
block tables, the sampler and everything else of phase 7, and runs its share of the model. Ranks
1 .. N-1 are worker processes it starts itself (`worker.start_workers`), each building the same
parts from the same recipe with its rank, so its weights are cut, quantized and fused exactly as
the driver's are, and its KV cache has the driver's number of blocks (the block tables are the
driver's, shared by every rank).

Every forward the driver runs (a prefill or mixed step through phase 6's runner, a decode step
through phase 7's decode runner), and every logits call, is first broadcast to the workers with
its inputs (`TensorParallelLlama`, and the decode forward `broadcast_decode_forward` wraps), so
all ranks run it together and meet at the same all-reduces; the logits come back to the driver
alone. vLLM's multiprocessing executor works the same way: one driver, workers started beside
it, the step's inputs broadcast (`vllm/v1/executor/multiproc_executor.py`).
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
import weakref

import torch

from tinyvllm.step import ModelRunnerOutput, SchedulerOutput

from .parallel import TensorParallelGroup
from .worker import start_workers, stop_workers, threads_per_rank


def broadcast_decode_forward(decode_runner, group: TensorParallelGroup) -> None:
    """Make the driver's decode runner send each decode forward to the workers before running it."""
    forward = decode_runner.model_forward

    def driver_forward(input_ids, positions, attn):
        group.broadcast_object(("decode_forward", input_ids, positions, attn.meta))
        return forward(input_ids, positions, attn)

    decode_runner.model_forward = driver_forward


def stop_group(workers, group: TensorParallelGroup, rendezvous_dir: str) -> None:
    """Stop the worker ranks and remove the rendezvous directory."""
    try:
        stop_workers(workers, group)
    finally:
        shutil.rmtree(rendezvous_dir, ignore_errors=True)


class TensorParallelExecutor:
    """Runs the driver's runner (`inner`) with the worker ranks it starts; `close` stops them
    (also done when the executor is garbage-collected).

    The ranks meet in a directory only this user can open (`tempfile.mkdtemp` makes it mode 0700),
    and the driver signs its messages with a random token of this engine's, which each worker
    gets in its environment.

    Args:
        inner: phase 7's runner, on the driver's share of the model.
        group: the driver's place in the group (rank 0 of world).
        model_path: the model the workers load their share of.
        engine_args: the engine arguments the workers build their parts from.
        num_blocks: the driver's pool: the workers' pools have as many blocks, of their own KV heads.
    """

    def __init__(self, inner: object, group: TensorParallelGroup, model_path: str, engine_args: dict,
                 num_blocks: int):
        self.inner, self.group = inner, group
        # the workers build the same engine with their rank and the driver's pool of blocks, and
        # no proposer (drafts are the driver's: a worker only runs the model)
        worker_args = dict(engine_args, num_kv_blocks=num_blocks, speculative_config=None)
        self.rendezvous_dir = tempfile.mkdtemp(prefix="tinyvllm-tp-")
        store_path = os.path.join(self.rendezvous_dir, "store")
        token = secrets.token_bytes(32)
        self.workers = []
        try:
            store = group.store(store_path)
            self.workers = start_workers(store, group.world, store_path, token, model_path, worker_args)
            group.connect(store, token)
        except BaseException:
            stop_group(self.workers, None, self.rendezvous_dir)
            raise
        self._finalizer = weakref.finalize(self, stop_group, self.workers, group, self.rendezvous_dir)

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        """The inner runner's step, on the driver's share of the cores (the workers have theirs):
        PyTorch's threads on more cores than there are would wait on each other at every
        all-reduce."""
        threads = torch.get_num_threads()
        torch.set_num_threads(threads_per_rank(self.group.world))
        try:
            return self.inner.execute(plan)
        finally:
            torch.set_num_threads(threads)

    @property
    def num_static_steps(self) -> int:
        return getattr(self.inner, "num_static_steps", 0)

    def close(self) -> None:
        """Stop the worker ranks and remove the rendezvous directory."""
        self._finalizer()
