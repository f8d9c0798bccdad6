"""Phase 8 where tensor parallelism is used: NCCL between GPUs, ranks on several hosts.

On a CPU: the backend follows the device, each rank of a host gets its own GPU (a fake count),
and two "hosts" started as separate processes that share only node 0's address (loopback) give
one rank's tokens; a host that dies fails the step with an error that names it, and leaves no
rank hanging; values written into node 0's store by a process without the token, or recorded from
another run, are refused. (test_p08_netns.py runs the hosts at addresses of their own.) On two or
more GPUs (`pytest -m multi_gpu`): NCCL carries the all-reduces, with phase
7's CUDA graphs captured around them.
"""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from phases.p08_tensor_parallel.parallel import (TOKEN_ENV, Stamp, backend_for, load_timeout, open_store, rank_device,
                                                 rendezvous_timeout, shared_token, sign_bytes)
from phases.p08_tensor_parallel.rendezvous import HOST_GONE_AFTER_S, join, write_ready
from phases.p08_tensor_parallel.worker import run_node
from tinyvllm import LLM, SamplingParams

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": list(range(20, 57))}]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
TOKEN = "ab" * 32


def tokens(llm, prompts=PROMPTS):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_backend_follows_the_device_and_each_rank_has_its_gpu():
    assert backend_for(torch.device("cpu")) == "gloo"
    assert backend_for(torch.device("cuda", 1)) == "nccl"
    assert rank_device(torch.device("cpu"), 3, 0) == torch.device("cpu")       # ranks share the CPU
    assert [rank_device(torch.device("cuda"), r, 4) for r in range(4)] == [torch.device("cuda", r) for r in range(4)]
    with pytest.raises(ValueError, match="rank 2 of this host needs a GPU of its own, and this host shows 2"):
        rank_device(torch.device("cuda"), 2, 2)


def test_host_arguments_are_checked_by_name(tiny_model_dir, monkeypatch):
    for args, match in [({"nnodes": 0}, "nnodes must be >= 1"),
                        ({"nnodes": 2, "node_rank": 2, "tensor_parallel_size": 2}, "node_rank must be below nnodes"),
                        ({"nnodes": 2, "tensor_parallel_size": 3}, "multiple of nnodes"),
                        ({"master_port": 70000}, "master_port must be a TCP port"),
                        ({"master_addr": " "}, "master_addr")]:
        with pytest.raises(ValueError, match=match):
            LLM(str(tiny_model_dir), phase=8, **args)
    with pytest.raises(ValueError, match="master_port=1234: phase 7 does not have"):
        LLM(str(tiny_model_dir), phase=7, master_port=1234)
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    with pytest.raises(ValueError, match=f"set {TOKEN_ENV} to the same secret on every host"):
        LLM(str(tiny_model_dir), phase=8, tensor_parallel_size=2, nnodes=2)
    monkeypatch.setenv(TOKEN_ENV, "abcd")                              # 2 bytes: too short
    with pytest.raises(ValueError, match="at least 16 bytes"):
        shared_token()
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    with pytest.raises(ValueError, match="node_rank=1: the engine runs on node 0.*--node-rank 1 --headless"):
        LLM(str(tiny_model_dir), phase=8, tensor_parallel_size=2, nnodes=2, node_rank=1)
    with pytest.raises(ValueError, match="'file:PATH' or 'tcp:HOST:PORT'"):
        open_store("udp:x:1", 2, is_master=True)
    for name, value in (("TINYVLLM_RENDEZVOUS_TIMEOUT_S", "soon"), ("TINYVLLM_LOAD_TIMEOUT_S", "-1")):
        monkeypatch.setenv(name, value)
        with pytest.raises(ValueError, match=f"{name} must be a number of seconds above 0, got '{value}'"):
            rendezvous_timeout() if "RENDEZVOUS" in name else load_timeout()
        monkeypatch.delenv(name)


def test_a_late_host_is_named_and_forged_values_change_nothing(tiny_model_dir, monkeypatch, caplog):
    """Node 0 waits for the other hosts for the rendezvous timeout, then says which is missing and
    how to start it. Meanwhile a process without the token, which reaches node 0's store, writes a
    forged error as rank 1's "ready", then a "ready" signed with the token but recorded from
    another run: node 0 refuses both unread, logs who signed them, and waits on."""
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    monkeypatch.setenv("TINYVLLM_RENDEZVOUS_TIMEOUT_S", "3")
    port = free_port()
    key = "tinyvllm/rank1/ready"
    recorded = sign_bytes(pickle.dumps({"address": "127.0.0.1"}), bytes.fromhex(TOKEN), Stamp(key, bytes(16), 1))

    def intruder():   # no token: it can only write what it made or what it read before
        store = dist.TCPStore("127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=30))
        store.set(key, "error boom")
        time.sleep(1)
        store.set(key, recorded)

    thread = threading.Thread(target=intruder, daemon=True)
    thread.start()
    with pytest.raises(TimeoutError, match=r"host 1 \(rank 1\) did not join within 3 s .*: start each other host "
                                           r"with `tinyvllm serve .* --node-rank K .*--headless`") as e:
        LLM(str(tiny_model_dir), phase=8, tensor_parallel_size=2, nnodes=2, master_port=port,
            kv_cache_memory=1 << 22)
    thread.join(5)
    assert "boom" not in str(e.value)
    refused = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and key in r.getMessage()]
    assert any("from a process without this engine's token" in m for m in refused), refused
    assert any("signed by host 1 (rank 1)" in m and "another run" in m for m in refused), refused
    assert TOKEN_ENV not in os.environ             # taken out before any process was started


@pytest.mark.timing
def test_a_host_that_never_connects_is_named_within_the_bound(tiny_model_dir, monkeypatch):
    """A host that goes through the rendezvous (its hello answered, a signed "ready" for its rank)
    and then never connects, as one that dies there: node 0's connect gives up after the
    rendezvous timeout and names the host, instead of waiting a collective's seven days."""
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    monkeypatch.setenv("TINYVLLM_RENDEZVOUS_TIMEOUT_S", "3")
    port, token = free_port(), bytes.fromhex(TOKEN)

    def half_a_host():
        store = dist.TCPStore("127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=30))
        run_id, _ = join(store, token, 1, 1, "127.0.0.1", os.urandom(16))
        write_ready(store, token, run_id, 1, "127.0.0.1")

    thread = threading.Thread(target=half_a_host, daemon=True)
    thread.start()
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"rank 0 could not connect to every other rank within 3 s "
                                           r"\(TINYVLLM_RENDEZVOUS_TIMEOUT_S; host 1 \(127.0.0.1, rank 1\) is gone"):
        LLM(str(tiny_model_dir), phase=8, tensor_parallel_size=2, nnodes=2, master_port=port,
            kv_cache_memory=1 << 22)
    assert time.monotonic() - start < 3 + HOST_GONE_AFTER_S + 10
    thread.join(5)


def test_a_host_with_another_model_is_named_at_once(tiny_model_dir, tiny_model_dir_llama3, monkeypatch):
    """Host 1 given another checkpoint refuses to build; node 0 fails at once with host 1's reason,
    not after the load timeout."""
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    port = free_port()
    args = {"tensor_parallel_size": 2, "nnodes": 2, "node_rank": 1, "master_port": port}
    failed = []

    def host1():
        with pytest.raises(ValueError, match="is not node 0's model") as e:
            run_node(str(tiny_model_dir_llama3), args)
        failed.append(e.value)

    thread = threading.Thread(target=host1, daemon=True)
    thread.start()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 1 \(host 1 \(127.0.0.1, rank 1\)\) failed to start:\nmodel: .* on "
                                           r"host 1 is not node 0's model"):
        LLM(str(tiny_model_dir), phase=8, tensor_parallel_size=2, nnodes=2, master_port=port, kv_cache_memory=1 << 22)
    assert time.monotonic() - start < 30
    thread.join(10)
    assert failed


def _node_processes(parent: int) -> list[int]:
    out = subprocess.run(["ps", "-eo", "pid,ppid,args"], capture_output=True, text=True).stdout
    return [int(line.split()[0]) for line in out.splitlines()
            if "-m phases.p08_tensor_parallel" in line and int(line.split()[1]) == parent]


@pytest.mark.timing
def test_two_hosts_give_one_rank_tokens_and_a_dead_host_fails_the_step(tiny_model_dir, monkeypatch):
    """Two "hosts" on one machine, two ranks each: node 1 is `tinyvllm serve ... --node-rank 1
    --headless` in a process of its own, sharing nothing with node 0 but the master address and
    the token. Their four ranks give one rank's tokens. Then node 1 dies: the next step fails with
    an error that names it, and node 0's own worker rank does not hang."""
    one_rank = tokens(LLM(str(tiny_model_dir), phase=8, kv_cache_memory=1 << 22))
    port = free_port()
    hosts = ["--tensor-parallel-size", "4", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    env = {**os.environ, TOKEN_ENV: TOKEN, "PYTHONPATH": str(ROOT)}
    node1 = subprocess.Popen([sys.executable, "-m", "tinyvllm.entrypoints.cli", "serve", str(tiny_model_dir),
                              *hosts, "--node-rank", "1", "--headless", "--kv-cache-memory", str(1 << 22)],
                             env=env, cwd=ROOT, start_new_session=True)
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    llm = None
    try:
        llm = LLM(str(tiny_model_dir), phase=8, tensor_parallel_size=4, nnodes=2, master_addr="127.0.0.1",
                  master_port=port, kv_cache_memory=1 << 22)
        runner = llm.llm_engine.runner
        assert len(runner.workers) == 1 and len(_node_processes(node1.pid)) == 2   # ranks 1 | 2, 3
        assert tokens(llm) == one_rank
        os.killpg(node1.pid, signal.SIGKILL)                           # host 1 is gone, all of it
        node1.wait()
        start = time.monotonic()
        with pytest.raises(Exception, match=r"another rank of this engine is gone \(.*host 1 \(127.0.0.1, ranks "
                                            r"2-3\) is gone"):
            tokens(llm)
        assert time.monotonic() - start < 60
        local = runner.workers[0]
        llm.llm_engine.shutdown()
        assert local.wait(timeout=30) is not None
    finally:
        if node1.poll() is None:
            os.killpg(node1.pid, signal.SIGKILL)
        if llm is not None:
            llm.llm_engine.shutdown()


needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2,
                                    reason=f"needs two CUDA GPUs, this machine has {torch.cuda.device_count()}")


@pytest.mark.multi_gpu
@pytest.mark.gpu
@needs_two_gpus
@pytest.mark.parametrize("enforce_eager", [True, False])
def test_two_gpus_over_nccl_give_one_gpu_tokens(tiny_model_dir, enforce_eager):
    """Two ranks on cuda:0 and cuda:1: the all-reduces over NCCL, the driver's step over gloo; with
    CUDA graphs each rank captures and replays its own, the collectives inside."""
    one = tokens(LLM(str(tiny_model_dir), phase=8, device="cuda", enforce_eager=enforce_eager))
    llm = LLM(str(tiny_model_dir), phase=8, device="cuda", tensor_parallel_size=2, enforce_eager=enforce_eager)
    try:
        group = llm.llm_engine.runner.group
        assert type(group.data_pg).__name__ == "ProcessGroupNCCL" and type(group.pg).__name__ == "ProcessGroupGloo"
        assert tokens(llm) == one
        if not enforce_eager:
            assert llm.llm_engine.runner.inner.decode_runner.num_captures > 0
    finally:
        llm.llm_engine.shutdown()
