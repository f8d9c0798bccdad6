"""The machine a benchmark ran on: what it is, what it can do at best, and how much memory a run held.

- `machine_info`: CPU model, vendor, generation ("Zen 4"), kind and flags (`tinyvllm.hardware`), cores, torch version,
  device, so a number is never without its machine.
- `load_average`, `load_warning`: how busy the machine was as a run started, and a warning when
  other work ran beside it.
- `measure_limits`: the two numbers a roofline needs, measured at the start of each run rather
  than read from a spec sheet: memory bandwidth (time a large copy) and matmul rate (time a
  large matmul in the engines' dtype). A busy machine measures lower, and so do the engines on
  it: measuring both in the same run keeps their ratio honest.
- `PeakMemory`: the most memory held during one engine's run (on a GPU, the allocator's peak; on
  a CPU, the process's peak resident set, reset before each run through /proc/self/clear_refs).
"""

from __future__ import annotations

import os
import platform
import re
import resource
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from tinyvllm import platform as tinyvllm_platform
from tinyvllm.hardware import cpu_family_model, cpu_microarchitecture, cpu_vendor, cpuinfo, reported_flags

from .timing import best, times

# Sizes of the limit measurements: large enough to leave the caches behind (a copy that fits in
# cache measures the cache, not memory), small enough to take about a second in all.
COPY_BYTES = {"cpu": 256 * 2**20, "cuda": 2 * 2**30}
MATMUL_SIZE = {"cpu": 1536, "cuda": 8192}


def cpu_model() -> str:
    """The CPU's marketing name, from /proc/cpuinfo where there is one."""
    return cpuinfo().get("model name") or platform.processor() or platform.machine()


def machine_info(device: torch.device) -> dict:
    """What the JSON report says about the machine: the CPU kind tinyvllm acts as, with the flags
    that kind may use (`tinyvllm.platform`; $TINYVLLM_CPU_KIND, where set, decides both)."""
    acting = tinyvllm_platform.current()
    info = dict(cpu=cpu_model(), cpu_capability=torch.backends.cpu.get_cpu_capability(),
                cpu_vendor=cpu_vendor(), cpu_family_model=cpu_family_model(),
                cpu_microarchitecture=cpu_microarchitecture(), cpu_kind=acting.kind,
                cpu_flags=reported_flags(acting.flags),
                cores=os.cpu_count(), torch_threads=torch.get_num_threads(),
                torch=torch.__version__, python=platform.python_version(),
                platform=platform.platform(), device=str(device))
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["gpu_memory_bytes"] = torch.cuda.get_device_properties(device).total_memory
        info["cuda"] = torch.version.cuda
    return info


def load_average() -> float | None:
    """The 1-minute load average: other work on the machine slows every engine, and this says
    whether there was any (the benchmark itself adds one or two)."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


# How far the 1-minute load average may exceed the cores before a timing is not trusted. The
# benchmark's own threads count in it (the engines have just loaded, one thread per core): quiet
# 2-core machines read 2.0 to 2.3 in the committed reports (docs/assets/bench/), and one other
# busy process adds about 1 (a loaded 2-core machine read 3.3).
LOAD_LIMIT_PER_CORE = 1.25


def load_warning(load: float | None, cores: int | None = None, was: bool = False) -> str:
    """A warning when the load average exceeds the cores (`LOAD_LIMIT_PER_CORE` times them):
    other work is running, and a timing taken now says more about it than about the engines.
    '' when the machine is not loaded or the load is unknown. One round cannot show a loaded
    machine by its spread, and several rounds may all be slowed alike: this says so from the
    first. `was`: the past tense, for a report read after the run."""
    cores = cores or os.cpu_count() or 1
    if load is None or load <= LOAD_LIMIT_PER_CORE * cores:
        return ""
    return (f"WARNING: the load average {'was' if was else 'is'} {load:.2f} on {cores} cores: other work "
            f"{'ran' if was else 'is running'} beside the benchmark, and numbers measured "
            f"{'then' if was else 'now'} are not reliable; measure again on an idle machine")


@dataclass(slots=True)
class MachineLimits:
    """The best this machine did at the two things decoding needs: moving bytes, and multiplying."""

    memory_bandwidth: float   # bytes/s, (read + write) / time of a large copy
    matmul_flops: float       # FLOP/s, 2 n^3 / time of an n x n matmul
    matmul_dtype: str
    copy_bytes: int
    matmul_size: int

    def to_dict(self) -> dict:
        return asdict(self)


def _best_time(fn, device: torch.device, repeats: int) -> float:
    """The fastest of `repeats` calls (after one untimed call): noise only ever adds time."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None
    return best(times(fn, repeats, sync=sync))


def _copy_seconds(copy_bytes: int, device: torch.device, repeats: int) -> float:
    src = torch.ones(copy_bytes // 4, dtype=torch.float32, device=device)
    dst = torch.zeros_like(src)  # both touched before timing, so no page faults are timed
    return _best_time(lambda: dst.copy_(src), device, repeats)


@torch.inference_mode()
def measure_limits(device: torch.device, dtype: torch.dtype, copy_bytes: int | None = None,
                   matmul_size: int | None = None, repeats: int = 5) -> MachineLimits:
    """Measure memory bandwidth and matmul rate on `device`; matmuls in `dtype` (what the engines
    run in: float32 on a CPU, bfloat16 on a GPU)."""
    kind = "cuda" if device.type == "cuda" else "cpu"
    copy_bytes = copy_bytes or COPY_BYTES[kind]
    n = matmul_size or MATMUL_SIZE[kind]
    t_copy = _copy_seconds(copy_bytes, device, repeats)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    t_mm = _best_time(lambda: a @ b, device, max(2, repeats // 2))
    return MachineLimits(memory_bandwidth=2 * copy_bytes / t_copy, matmul_flops=2 * n**3 / t_mm,
                         matmul_dtype=str(dtype).removeprefix("torch."), copy_bytes=copy_bytes,
                         matmul_size=n)


class PeakMemory:
    """The peak memory of one run: `start()` before it, `stop()` after; then `peak` and `increase`.

    On a GPU: `torch.cuda.max_memory_allocated` (what tensors held), reset at `start`. On a CPU:
    the process's peak resident set (VmHWM), which Linux resets when "5" is written to
    /proc/self/clear_refs. Either way the peak covers the whole process, so it includes the
    weights of every engine loaded for the benchmark; `increase` is the peak less what was held
    at `start`, the memory the run itself added (activations, and KV-cache pages touched for the
    first time). Where the peak cannot be reset, the process's lifetime peak is reported and
    `source` says so.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.start_bytes = 0
        self.peak = 0
        self.source = "cuda max_memory_allocated" if device.type == "cuda" else "process peak RSS (VmHWM)"

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start_bytes = torch.cuda.memory_allocated(self.device)
            return
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            self.source = "process lifetime peak RSS (ru_maxrss; the peak could not be reset)"
        self.start_bytes = _status_bytes("VmRSS") or 0

    def stop(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device)
        else:
            self.peak = _status_bytes("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    @property
    def increase(self) -> int:
        return max(0, self.peak - self.start_bytes)


def _status_bytes(field: str) -> int | None:
    """A 'kB' field of /proc/self/status, in bytes (None off Linux)."""
    try:
        m = re.search(rf"^{field}:\s+(\d+)\s+kB", Path("/proc/self/status").read_text(), re.MULTILINE)
    except OSError:
        return None
    return int(m.group(1)) * 1024 if m else None
