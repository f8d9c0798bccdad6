"""Two hosts at addresses of their own. Node 0 and node 1 of one engine each run in a network
namespace of its own (`ip netns`), joined by a veth pair, so each has its own address and reaches
the other only over that link; a third namespace reaches node 0 over a link of its own, holds no
token, and tries what the issue's attacker tried: it reads the rendezvous, writes a forged error
as rank 1's "ready", and writes values signed with the token but recorded from another run (a
"ready", and node 0's answer to another host's hello). The engine starts all the same and gives
one host's tokens, every such value refused; killing node 1 fails the next step, naming it within
the bound; nothing is left running.

Making namespaces needs root and iproute2 (scripts/setup.sh installs it where it runs as root):
elsewhere the test is skipped, saying which is missing.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from phases.p08_tensor_parallel.parallel import TOKEN_ENV, Stamp, sign_bytes
from phases.p08_tensor_parallel.rendezvous import HOST_GONE_AFTER_S, engine_key, ready_key
from tinyvllm import LLM, SamplingParams
from tinyvllm.testing import NETNS_NODE0, NETNS_NODE1, NETNS_OUTSIDER, ip_command, lines_of, wait_for_line

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "5e" * 32
PORT = 29555
NODE0, NODE1, OUTSIDER = NETNS_NODE0, NETNS_NODE1, NETNS_OUTSIDER
PROMPTS = [[5, 6, 7, 8], list(range(20, 57))]
ARGS = {"tensor_parallel_size": 2, "nnodes": 2, "master_addr": NODE0, "master_port": PORT, "kv_cache_memory": 1 << 22}

# Node 0: the engine; prints its tokens, then (once told) steps again and prints what that raised
NODE0_SCRIPT = """
import json, sys, time
from tinyvllm import LLM, SamplingParams
llm = LLM(sys.argv[1], phase=8, **json.loads(sys.argv[2]))
greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
prompts = [{"prompt_token_ids": p} for p in json.loads(sys.argv[3])]
print(json.dumps({"tokens": [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]}),
      flush=True)
sys.stdin.readline()
start = time.monotonic()
try:
    llm.generate(prompts, greedy, use_tqdm=False)
    print(json.dumps({"error": None}), flush=True)
except Exception as e:
    print(json.dumps({"error": str(e), "seconds": time.monotonic() - start}), flush=True)
llm.llm_engine.shutdown()
"""

# The outsider: no token; it writes what it was given (forged, or recorded elsewhere), one value
# each time it is told to, then reads every key of the rendezvous it can, and prints them
OUTSIDER_SCRIPT = """
import datetime, json, sys
import torch.distributed as dist
store = dist.TCPStore(sys.argv[1], int(sys.argv[2]), None, False, timeout=datetime.timedelta(seconds=60))
for i, (key, value) in enumerate(json.loads(sys.argv[3])):
    sys.stdin.readline()
    store.set(key, bytes.fromhex(value))
    print("written", i, flush=True)
sys.stdin.readline()
keys = json.loads(sys.argv[4])
print(json.dumps({k: store.get(k).hex() for k in keys if store.check([k])}), flush=True)
"""


def _in(namespace: str, args: list[str], **kwargs) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), TOKEN_ENV: TOKEN, "TINYVLLM_RENDEZVOUS_TIMEOUT_S": "30",
           **kwargs.pop("env", {})}
    return subprocess.Popen(["ip", "netns", "exec", namespace, *args], env=env, cwd=ROOT, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kwargs)


@pytest.mark.timing
def test_two_namespaced_hosts_refuse_an_outsider_and_name_a_dead_host(namespaces, tiny_model_dir):
    a, b, c = namespaces
    one_host = [o.outputs[0].token_ids for o in LLM(str(tiny_model_dir), phase=8, kv_cache_memory=1 << 22).generate(
        [{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        use_tqdm=False)]
    token, other_run = bytes.fromhex(TOKEN), bytes([9]) * 16
    # what the outsider writes: a forged error, and values signed with the token for another run
    recorded_ready = sign_bytes(pickle.dumps({"address": NODE1}), token, Stamp(ready_key(1), other_run, 1))
    recorded_answer = sign_bytes(bytes(16) + pickle.dumps(({}, "0" * 64)), token, Stamp(engine_key(1), other_run, 0))
    writes = [(ready_key(1), b"error boom".hex()), (ready_key(1), recorded_ready.hex()),
              (engine_key(1), recorded_answer.hex())]
    keys = [ready_key(1), engine_key(1), "tinyvllm/node1/hello", "tinyvllm/node1/alive"]
    procs = []
    try:
        node0 = _in(a, [sys.executable, "-c", NODE0_SCRIPT, str(tiny_model_dir), json.dumps(ARGS), json.dumps(PROMPTS)])
        procs.append(node0)
        out0, err0, seen0, seen0_err = lines_of(node0.stdout), lines_of(node0.stderr), [], []
        outsider = _in(c, [sys.executable, "-c", OUTSIDER_SCRIPT, NODE0, str(PORT), json.dumps(writes),
                           json.dumps(keys)], env={TOKEN_ENV: ""})
        procs.append(outsider)
        out_c, seen_c = lines_of(outsider.stdout), []

        def write(i: int) -> None:
            outsider.stdin.write("next\n")
            outsider.stdin.flush()
            wait_for_line(out_c, seen_c, lambda line: line == f"written {i}\n", 60, f"outsider's write {i}")

        # node 0 refuses each value written at rank 1's "ready", before node 1 starts
        for i, who in enumerate(("from a process without this engine's token", "signed by host 1 (rank 1)")):
            write(i)
            wait_for_line(err0, seen0_err, lambda line, who=who: "refused a value" in line and who in line, 30,
                      f"refusal ({who}) in node 0's log")
        write(2)                       # a recorded answer, waiting for node 1's hello
        started = time.monotonic()
        node1 = _in(b, [sys.executable, "-m", "tinyvllm.entrypoints.cli", "serve", str(tiny_model_dir),
                        "--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", "1", "--master-addr", NODE0,
                        "--master-port", str(PORT), "--headless", "--kv-cache-memory", str(1 << 22)],
                    start_new_session=True)
        procs.append(node1)
        err1, seen1_err = lines_of(node1.stderr), []
        line = wait_for_line(out0, seen0, lambda line: line.startswith("{"), 120, "tokens from node 0")
        assert json.loads(line)["tokens"] == one_host
        assert time.monotonic() - started < 60
        wait_for_line(err1, seen1_err, lambda line: "refused a value: tinyvllm/node1/engine: node 0's answer to another hello" in line, 10,
                  "node 1 refusing the recorded answer")
        # the outsider reads every key of the run: signed values, no token in any of them
        outsider.stdin.write("read\n")
        outsider.stdin.flush()
        read = json.loads(wait_for_line(out_c, seen_c, lambda line: line.startswith("{"), 30, "outsider's reading"))
        assert set(read) == set(keys)
        assert not any(TOKEN in v or token.hex() in v for v in read.values())
        # host 1 dies, all of it: the next step fails, naming it
        os.killpg(node1.pid, signal.SIGKILL)
        node1.wait()
        node0.stdin.write("go\n")
        node0.stdin.flush()
        failure = json.loads(wait_for_line(out0, seen0, lambda line: line.startswith("{"), 60, "node 0's failed step"))
        assert f"host 1 ({NODE1}, rank 1) is gone" in failure["error"], failure
        assert failure["seconds"] < HOST_GONE_AFTER_S + 5
        assert node0.wait(timeout=30) == 0
        outsider.wait(timeout=10)
        # every value the outsider wrote was refused: none made node 0 fail or node 1 build another engine
        assert "boom" not in "".join(seen0_err) + "".join(err0.queue)
        deadline = time.monotonic() + 10
        while any(ip_command("netns", "pids", ns).stdout.split() for ns in namespaces) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(ip_command("netns", "pids", ns).stdout.split() for ns in namespaces), "a process was left running"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
