"""The llama.cpp peer: `tinyvllm bench latency --vs llamacpp` runs the same requests through
llama.cpp on the GGUF file the default model comes from.

llama.cpp is the engine a learner with a CPU most likely runs today, so it is the bar the CPU
path is measured against. It runs out of process, in its own virtual environment
(`.venv-llamacpp` in the current folder, made on first use: llama-cpp-python builds llama.cpp
from source for this CPU, a few minutes; never part of `make test`), or in any Python that has
llama-cpp-python (`--llamacpp-python PATH`). `llamacpp_worker.py` is what runs there.

What it compares: the same prompt token ids, greedy, each request run to its max_tokens, on the
model as the GGUF stores it (SmolLM2's: Q4_1 blocks of 32 weights for the layers, Q8_0 for the
embedding), with as many threads as PyTorch uses. One sequence at a time (llama-cpp-python's
`Llama` holds one), so it is a batch-1 peer: a throughput workload runs its requests one after
another, which llama.cpp's own server would batch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from .runners import OnTokens, RunResult, check_token_counts, tpot
from .workloads import Workload

# What a fresh clone installs for the peer: the version these reports were measured with.
LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
VENV_NAME = ".venv-llamacpp"
WORKER = Path(__file__).with_name("llamacpp_worker.py")


def peer_python(python: str | None = None, venv: Path | None = None, log=sys.stderr) -> str:
    """The Python that runs the worker: `python` if given, else `venv`'s (default
    ./.venv-llamacpp), made and filled with the pinned llama-cpp-python on first use."""
    if python is not None:
        if not Path(python).is_file():
            raise ValueError(f"--llamacpp-python: {python!r} is not a file")
        return python
    venv = Path(venv or VENV_NAME).resolve()
    exe = venv / "bin" / "python"
    if not (venv / ".complete").is_file():
        log.write(f"--vs llamacpp: making {venv} with {LLAMA_CPP_PYTHON} (it builds llama.cpp "
                  f"from source for this CPU: a few minutes, once)\n")
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(exe), "-m", "pip", "install", "--quiet", LLAMA_CPP_PYTHON], check=True)
        (venv / ".complete").touch()
    return str(exe)


def default_gguf(model: str | None) -> Path:
    """The GGUF to run: the default model's own file; another model needs --gguf."""
    from tinyvllm.download import DEFAULT_MODEL_ALIASES, ensure_gguf
    if model not in DEFAULT_MODEL_ALIASES:
        raise ValueError("--vs llamacpp: give --gguf PATH, the GGUF of the model you pass as --model "
                         "(only the default model's GGUF is known)")
    return ensure_gguf(quiet=True)


class LlamaCppRunner:
    """llama.cpp through llama-cpp-python, in a worker process that keeps the model loaded."""

    kind = "llamacpp"
    name = "llamacpp"
    max_concurrency = 1           # one sequence at a time
    kv_bytes_per_element = 2      # llama.cpp's KV cache is float16 by default

    def __init__(self, gguf: Path, python: str, max_len: int, num_threads: int | None = None):
        self.gguf = Path(gguf)
        if not self.gguf.is_file():
            raise ValueError(f"--gguf: {str(gguf)!r} is not a file")
        self.num_threads = num_threads or torch.get_num_threads()
        self.weight_bytes = self.gguf.stat().st_size   # what a decode step reads: the file, nearly
        self.proc = subprocess.Popen(
            [python, str(WORKER), str(self.gguf), str(self.num_threads), str(max_len)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=dict(os.environ))
        ready = self._read()
        if "ready" not in ready:
            raise RuntimeError(f"llama.cpp worker: expected 'ready', got {ready}")
        self.load_s = ready["ready"]["load_s"]
        self.version = ready["ready"]["version"]
        self.label = f"llama.cpp (llama-cpp-python {self.version}, {self.gguf.name})"

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            raise RuntimeError(f"the llama.cpp worker exited ({code}) without an answer; its error is above")
        return json.loads(line)

    def describe(self) -> dict:
        return dict(kind=self.kind, label=self.label, llama_cpp_python=self.version, gguf=self.gguf.name,
                    threads=self.num_threads, kv_cache_dtype="float16",
                    note="one sequence at a time; greedy; the prompt's prefix shared with the "
                         "previous prompt stays cached")

    def run(self, workload: Workload, on_tokens: OnTokens = lambda n: None) -> RunResult:
        reqs = workload.requests
        job = {"requests": [[list(r.prompt_token_ids), r.max_tokens] for r in reqs],
               "sequential": workload.sequential}
        wall_start = time.perf_counter()
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        while "result" not in (msg := self._read()):
            on_tokens(msg["tokens"])
        wall = time.perf_counter() - wall_start
        res = msg["result"]
        counts = [len(t) for t in res["times"]]
        check_token_counts(self.name, workload, counts)
        # a sequential workload's request arrives when it starts; otherwise all arrive at once
        arrivals = res["start"] if workload.sequential else [0.0] * len(reqs)
        ttfts = [t[0] - a for t, a in zip(res["times"], arrivals)]
        tpots = [x for t in res["times"] if (x := tpot(t[0], t[-1], len(t))) is not None]
        return RunResult(wall_s=wall, num_requests=len(reqs), prompt_tokens=workload.num_prompt_tokens,
                         output_tokens=sum(counts), ttft_s=ttfts, tpot_s=tpots,
                         peak_memory_bytes=res["max_rss_bytes"])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(30)

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
