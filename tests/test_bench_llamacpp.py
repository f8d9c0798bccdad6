"""`tinyvllm bench --vs llamacpp`: the llama.cpp peer's runner and worker, with a stand-in
`llama_cpp` module (the real one is built in its own virtual environment on first use, never in
the test suite). The stand-in makes one token per `generate` step and sleeps a little per token,
so the runner's counts, TTFT and TPOT are checked against what the worker did."""

from __future__ import annotations

import io
import json
import sys
import textwrap

import pytest

from tinyvllm.entrypoints.bench.harness import run_bench
from tinyvllm.entrypoints.bench.llamacpp import LLAMA_CPP_PYTHON, LlamaCppRunner, default_gguf, peer_python
from tinyvllm.entrypoints.bench.machine import MachineLimits
from tinyvllm.entrypoints.bench.runners import EngineRunner
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


def test_a_model_other_than_the_default_needs_its_gguf(tiny_model_dir, capsys):
    with pytest.raises(ValueError, match="--gguf"):
        default_gguf(str(tiny_model_dir))
    assert main(["bench", "latency", "--model", str(tiny_model_dir), "--vs", "llamacpp",
                 "--output-len", "4", "--no-progress"]) != 0
    assert "--gguf" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--llamacpp-python"):
        peer_python("/no/such/python")
    assert LLAMA_CPP_PYTHON.startswith("llama-cpp-python==")   # pinned, as a fresh clone installs it
