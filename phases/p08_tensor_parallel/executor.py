"""The tensor-parallel executor: the driver's runner, run on its share of the cores, with the
worker ranks it started alive beside it.

With `tensor_parallel_size=N` this process is rank 0, the driver: it keeps the scheduler, the
block tables, the sampler and everything else of phase 7, and runs its share of the model. Ranks
1 .. N-1 are worker processes it starts itself (`worker.start_workers`), each building the same
parts from the same recipe with its rank, so its weights are cut, quantized and fused exactly as
the driver's are, and its KV cache has the driver's number of blocks (the block tables are the
driver's, shared by every rank).

Every forward the driver runs through phase 6's runner (a prefill or mixed step), and every
logits call, is first broadcast to the workers with its inputs (`TensorParallelLlama`). A decode
step through phase 7's decode runner is broadcast as the rows of its static buffers
(`broadcast_decode_runs`): each rank copies them into its own buffers and runs its own decode
runner, so on a GPU each rank replays its own CUDA graph, captured in step with the others' with
the collectives inside. All ranks meet at the same all-reduces; the logits come back to the
driver alone. vLLM's multiprocessing executor works the same way: one driver, workers started
beside it, the step's inputs broadcast (`vllm/v1/executor/multiproc_executor.py`).

Over several hosts (`nnodes > 1`) the driver serves the rendezvous on `master_addr:master_port`,
starts its own host's ranks, answers each other host's hello with its engine arguments (signed
for this run), and waits for their ranks (`worker.run_node` on each) to join (`Rendezvous`).
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
import weakref

import torch

from tinyvllm.config import EngineConfig
from tinyvllm.step import ModelRunnerOutput, SchedulerOutput

from .parallel import RUN_ID_BYTES, TensorParallelGroup, open_store, shared_token
from .rendezvous import Rendezvous
from .worker import bind_address, decode_rows, model_digest, start_workers, stop_workers, threads_per_rank


def broadcast_decode_runs(decode_runner, group: TensorParallelGroup) -> None:
    """Make the driver's decode runner send each decode step's rows to the workers, then run it
    with them, in lockstep (each rank on its own buffers, its own graph)."""
    run = decode_runner.run

    def driver_run(bucket: int):
        group.broadcast_object(("decode_run", bucket, decode_rows(decode_runner.buf, bucket)))
        with group.in_lockstep():
            return run(bucket)

    decode_runner.run = driver_run


def stop_group(workers, group: TensorParallelGroup, rendezvous_dir: str | None) -> None:
    """Stop the worker ranks and remove the rendezvous directory."""
    try:
        stop_workers(workers, group)
    finally:
        if rendezvous_dir:
            shutil.rmtree(rendezvous_dir, ignore_errors=True)


def late_hosts_hint(config: EngineConfig, model_path: str) -> str:
    """How to start the hosts whose ranks have not joined."""
    return (f": start each other host with `tinyvllm serve {model_path} --tensor-parallel-size "
            f"{config.tensor_parallel_size} --nnodes {config.nnodes} --node-rank K --master-addr "
            f"{config.master_addr} --master-port {config.master_port} --headless` (K = 1 .. "
            f"{config.nnodes - 1}) and the same TINYVLLM_TP_TOKEN")


class TensorParallelExecutor:
    """Runs the driver's runner (`inner`) with the worker ranks it starts; `close` stops them
    (also done when the executor is garbage-collected).

    On one host the ranks meet in a directory only this user can open (`tempfile.mkdtemp` makes it
    mode 0700), and the driver signs its messages with a random token of this engine's, which each
    worker gets in its environment. Over several hosts they meet at `master_addr:master_port`, and
    the token is the secret every host has in TINYVLLM_TP_TOKEN. Either way the driver draws a
    random run id, which every signed value of this engine carries.

    Args:
        inner: phase 7's runner, on the driver's share of the model.
        group: the driver's place in the group (rank 0 of world).
        model_path: the model the workers load their share of.
        engine_args: the engine arguments the workers build their parts from.
        num_blocks: the driver's pool: the workers' pools have as many blocks, of their own KV heads.
        device: the driver's device (the data plane's backend follows it).
    """

    def __init__(self, inner: object, group: TensorParallelGroup, model_path: str, engine_args: dict,
                 num_blocks: int, device: torch.device, phase: int = 8):
        self.inner, self.group = inner, group
        config = EngineConfig.from_kwargs(**engine_args)
        # the workers build the same engine with their rank and the driver's pool of blocks, and
        # no proposer (drafts are the driver's: a worker only runs the model)
        worker_args = dict(engine_args, num_kv_blocks=num_blocks, speculative_config=None)
        per_host = self.ranks_here = group.world // config.nnodes
        self.workers, self.rendezvous_dir = [], None
        run_id = secrets.token_bytes(RUN_ID_BYTES)
        try:
            if config.nnodes == 1:
                self.rendezvous_dir = tempfile.mkdtemp(prefix="tinyvllm-tp-")
                spec, token = "file:" + os.path.join(self.rendezvous_dir, "store"), secrets.token_bytes(32)
            else:
                spec, token = f"tcp:{config.master_addr}:{config.master_port}", shared_token()
            store = open_store(spec, group.world, is_master=True)
            engine = (worker_args, model_digest(model_path)) if config.nnodes > 1 else None
            self.rendezvous = Rendezvous(store, token, run_id, group.world, config.nnodes, engine,
                                         late_hosts_hint(config, model_path))
            address = bind_address(config)
            self.rendezvous.local = start_workers(range(1, per_host), group.world, spec, token, run_id,
                                                  model_path, worker_args, address, phase)
            self.workers = list(self.rendezvous.local.values())
            self.rendezvous.wait_ready()
            group.who_is_gone = self.rendezvous.who_is_gone
            group.exited_here = self.rendezvous.exited_here
            group.connect(store, token, run_id, address, device)
        except BaseException:
            stop_group(self.workers, None, self.rendezvous_dir)
            raise
        self._finalizer = weakref.finalize(self, stop_group, self.workers, group, self.rendezvous_dir)

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        """The inner runner's step, on the driver's share of the cores (the workers have theirs):
        PyTorch's threads on more cores than there are would wait on each other at every
        all-reduce."""
        threads = torch.get_num_threads()
        torch.set_num_threads(threads_per_rank(self.ranks_here))
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
