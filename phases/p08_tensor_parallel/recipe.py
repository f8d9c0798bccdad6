"""Phase 8's recipe: phase 7's, over `tensor_parallel_size` ranks (`torch.distributed`: gloo on a
CPU, NCCL between GPUs), on one host or on `nnodes`. With one rank (the default) every part is
phase 7's.

    model_loader    `ShardedLoader`: loads the checkpoint and keeps this rank's share of every
                    weight (`layers.shard_model`: heads, MLP columns, vocabulary), as a
                    `TensorParallelLlama` whose forward and logits the driver sends to the workers
                    first; phase 5 quantizes it and phase 7 fuses it as they do a whole model
    kv_cache        phase 7's pool, for this rank's KV heads only
    runner          on the driver, `TensorParallelExecutor`: phase 7's runner, with the worker
                    ranks it starts (`worker.py`), each decode forward broadcast to them first
"""

from __future__ import annotations

import dataclasses

import torch

from phases.p01_naive_attention import EngineSetup, Parts
from phases.p07_cuda_graphs import RECIPE as PHASE7
from tinyvllm.weights import load_model

from .executor import TensorParallelExecutor, broadcast_decode_runs
from .worker import check_hosts
from .layers import TensorParallelLlama, shard_model
from .parallel import TensorParallelGroup, available_cores, rank_device, shared_token


class ShardedLoader:
    """Loads the whole checkpoint, then keeps this rank's share of it (`shard_model`)."""

    def __init__(self, group: TensorParallelGroup):
        self.group = group
        self.shard_config = None  # the shard's shape (its heads, MLP columns, vocabulary), once loaded

    def __call__(self, setup: EngineSetup) -> TensorParallelLlama:
        model = load_model(setup.model_path, setup.dtype, setup.device, setup.max_model_len)
        self.shard_config = shard_model(model, self.group)
        return TensorParallelLlama(model, setup.model_config, self.group)


def check_ranks(setup: EngineSetup) -> None:
    c = setup.config
    world = c.tensor_parallel_size
    check_hosts(c)
    if c.nnodes > 1 and setup.tensor_parallel_rank == 0:
        if c.node_rank != 0:
            raise ValueError(f"node_rank={c.node_rank}: the engine runs on node 0; on this host start only "
                             f"its ranks: tinyvllm serve MODEL ... --node-rank {c.node_rank} --headless")
        shared_token()   # set on every host, or a clear error now rather than at the rendezvous
    if world == 1:
        return
    if c.compilation_mode:
        raise ValueError(f"compilation_mode=1 with tensor_parallel_size={world}: the compiled "
                         f"decode step runs on one rank; use compilation_mode=0 with several")
    here = world // c.nnodes
    if setup.device.type == "cuda":
        rank_device(setup.device, here - 1, torch.cuda.device_count())   # one GPU per rank of a host
        return
    if setup.device.type != "cpu":
        raise ValueError(f"tensor_parallel_size={world}: ranks run on CPUs (gloo) or CUDA GPUs (NCCL), "
                         f"not on {setup.device.type}")
    cores = available_cores()
    if here > cores:
        raise ValueError(f"tensor_parallel_size={world} puts {here} ranks on this host, more than its "
                         f"{cores} CPU cores")


def make_model_loader(setup: EngineSetup, parts: Parts):
    world = setup.config.tensor_parallel_size
    if world == 1:
        return PHASE7.model_loader(setup, parts)
    return ShardedLoader(TensorParallelGroup(setup.tensor_parallel_rank, world))


def rank_setup(setup: EngineSetup, parts: Parts) -> EngineSetup:
    """`setup` with the shape of this rank's share of the model (its KV pool is made from it)."""
    if setup.config.tensor_parallel_size == 1:
        return setup
    return dataclasses.replace(setup, model_config=parts.model_loader.shard_config)


def make_kv_cache(setup: EngineSetup, parts: Parts):
    """This rank's share of the KV cache: phase 7's pool (float or quantized), for its KV heads."""
    return PHASE7.kv_cache(rank_setup(setup, parts), parts)


def run_on_ranks(setup: EngineSetup, parts: Parts, inner, phase: int = 8):
    """`inner` (a phase's runner) on the driver, with worker ranks that build phase `phase`'s parts
    (`TensorParallelExecutor`); itself with one rank, or on a worker (which runs what it is sent)."""
    if setup.config.tensor_parallel_size == 1 or setup.tensor_parallel_rank != 0:
        return inner
    group = parts.model_loader.group
    decode_runner = getattr(inner, "decode_runner", None)
    if decode_runner is not None:
        broadcast_decode_runs(decode_runner, group)
    return TensorParallelExecutor(inner, group, str(setup.model_path), setup.engine_args, parts.kv_cache.num_blocks,
                                  setup.device, phase)


def make_runner(setup: EngineSetup, parts: Parts):
    return run_on_ranks(setup, parts, PHASE7.runner(setup, parts))


RECIPE = PHASE7.extend(
    phase=8, engine_args={"tensor_parallel_size", "nnodes", "node_rank", "master_addr", "master_port"},
    checks=(check_ranks,),
    model_loader=make_model_loader, kv_cache=make_kv_cache, runner=make_runner,
)
