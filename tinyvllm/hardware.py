"""What CPU this is: its vendor, its instruction-set flags, and the *kind* tinyvllm tells apart.

The fastest matrix product on a CPU depends on what the CPU can do, and the machines tinyvllm
runs on are not alike. Two things decide it:

- the vector instructions: AVX2 (8 float32 lanes, and `vpmaddwd` for 16-bit integers), AVX-512
  (16 lanes), and AVX512-VNNI (`vpdpbusd`: 64 byte multiply-adds in one instruction);
- the vendor: Intel's math library (MKL) takes its fast code paths only on Intel CPUs.

`cpu_kind()` names the classes the kernels were measured on: "avx512_vnni" (AVX-512 with VNNI:
an Intel Xeon of the Sapphire Rapids generation, an AMD EPYC of the Zen 4 generation), "avx2"
(AVX2 and FMA, no VNNI: older EPYCs and Xeons), and "other" (anything else, an ARM CPU
included). Reports and throughput checkpoints record it beside the numbers.
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The instruction-set flags the kernel reports (/proc/cpuinfo's `flags`); empty off Linux."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@functools.cache
def cpu_vendor() -> str:
    """"Intel", "AMD", or what /proc/cpuinfo's vendor_id says ("" where it says nothing)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("vendor_id"):
                vendor = line.split(":", 1)[1].strip()
                return {"GenuineIntel": "Intel", "AuthenticAMD": "AMD"}.get(vendor, vendor)
    except OSError:
        pass
    return ""


AVX512_VNNI_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_vnni"})
AVX2_FLAGS = frozenset({"avx2", "fma"})
# the flags a report records: what decides which kernel runs
REPORTED_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
                  "avx_vnni", "amx_int8", "amx_bf16")


def has_flags(flags: frozenset[str]) -> bool:
    return platform.machine().lower() in ("x86_64", "amd64") and flags <= cpu_flags()


def cpu_kind() -> str:
    """"avx512_vnni", "avx2" or "other": the class of CPU a kernel choice was measured on."""
    if has_flags(AVX512_VNNI_FLAGS):
        return "avx512_vnni"
    if has_flags(AVX2_FLAGS):
        return "avx2"
    return "other"


def reported_flags() -> list[str]:
    """Which of `REPORTED_FLAGS` this CPU has, for a report."""
    return [f for f in REPORTED_FLAGS if f in cpu_flags()]
