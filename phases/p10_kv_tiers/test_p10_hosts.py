"""Prefill on one host, decode on another: a kv_producer and a kv_consumer in network namespaces of
their own (the conftest's `namespaces`: hosts A and B, each with its own address, joined by one
link, sharing no tier file: the producer's is private to it), the consumer reading each prompt's
blocks from the producer's socket (kv_remote.py). It gives phase 9's tokens, every full block of
each prompt fetched and loaded, none computed.

Making namespaces needs root and iproute2 (scripts/setup.sh installs it where it runs as root):
elsewhere the test is skipped, saying which is missing."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

from tinyvllm import LLM, SamplingParams
from tinyvllm.testing import NETNS_NODE0, lines_of, wait_for_line

ROOT = Path(__file__).resolve().parents[2]
PORT = 29571
PROMPTS = [list(range(20 + i, 61 + i)) for i in range(3)]   # 41 tokens: 10 full blocks of 4, one computed
ENGINE = {"num_kv_blocks": 64, "block_size": 4, "compilation_mode": 0}

# Either side: its engine, told its role; the producer prefills the prompts (one token each) and
# waits, the consumer generates them and prints its tokens and its counters
SIDE_SCRIPT = """
import json, sys
from tinyvllm import LLM, SamplingParams
llm = LLM(sys.argv[1], phase=10, **json.loads(sys.argv[2]))
prompts = [{"prompt_token_ids": p} for p in json.loads(sys.argv[3])]
if sys.argv[4] == "producer":
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    print(json.dumps({"prefilled": True}), flush=True)
    sys.stdin.readline()
else:
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    print(json.dumps({"tokens": [o.outputs[0].token_ids for o in outs], "stats": llm.llm_engine.get_stats()}),
          flush=True)
llm.llm_engine.shutdown()
"""


def _side(namespace: str, model, role: str, token: str) -> subprocess.Popen:
    config = {"kv_connector": "OffloadingConnector", "kv_role": f"kv_{role}", "kv_ip": NETNS_NODE0, "kv_port": PORT,
              "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 23}}
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TINYVLLM_KV_TOKEN": token}
    args = [sys.executable, "-c", SIDE_SCRIPT, str(model), json.dumps({**ENGINE, "kv_transfer_config": config}),
            json.dumps(PROMPTS), role]
    return subprocess.Popen(["ip", "netns", "exec", namespace, *args], env=env, cwd=ROOT, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_a_consumer_on_another_host_decodes_from_the_producer_s_blocks(namespaces, tiny_model_dir):
    a, b, _ = namespaces
    want = [o.outputs[0].token_ids for o in LLM(str(tiny_model_dir), phase=9, **ENGINE).generate(
        [{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
        use_tqdm=False)]
    token = secrets.token_hex(32)
    producer = _side(a, tiny_model_dir, "producer", token)
    consumer = None
    try:
        seen: list[str] = []
        errors = lines_of(producer.stderr)
        try:
            wait_for_line(lines_of(producer.stdout), seen, lambda line: "prefilled" in line, 120, "prefill on host A")
        except AssertionError:
            raise AssertionError("host A did not prefill: " + "".join(errors.queue)) from None
        consumer = _side(b, tiny_model_dir, "consumer", token)
        line = wait_for_line(lines_of(consumer.stdout), seen, lambda line: "tokens" in line, 120, "tokens on host B")
        got = json.loads(line)
        assert got["tokens"] == want, f"host B gave {got['tokens']}, phase 9 {want}"
        stats = got["stats"]
        assert stats["kv_remote_fetched_blocks"] == 3 * 10 and stats["kv_offload_loaded_blocks"] == 3 * 10, stats
    finally:
        for p in (producer, consumer):
            if p is not None:
                p.stdin.close()
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
