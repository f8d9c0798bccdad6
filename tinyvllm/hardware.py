"""What CPU this is: its vendor, its generation, its instruction-set flags, and which *kind* of
CPU a set of flags makes.

The fastest matrix product on a CPU depends on what the CPU can do, and the machines tinyvllm
runs on are not alike. Two things decide it:

- the vector instructions: AVX2 (8 float32 lanes, and `vpmaddwd` for 16-bit integers), AVX-512
  (16 lanes), and AVX512-VNNI (`vpdpbusd`: 64 byte multiply-adds in one instruction);
- the vendor: Intel's math library (MKL) takes its fast code paths only on Intel CPUs.

`kind_of(flags)` names the classes the kernels were measured on: "amx" (AVX-512 with VNNI and
AMX's matrix tiles: an Intel Xeon of the Sapphire Rapids generation), "avx512_vnni" (AVX-512 with
VNNI, no AMX: an AMD EPYC of the Zen 4 generation), "avx2" (AVX2 and FMA, no VNNI: older EPYCs
and Xeons, or a newer one whose virtual machine hides AVX-512), and "other" (anything else, an ARM
CPU included). This module only reads the machine; which kind tinyvllm acts as, and what each
kind chooses, is `tinyvllm.platform`'s. Reports record the kind beside the numbers, with the flags
it was told from (`report_kind` names the kind of a report's flags), and the generation where
the CPU's family and model number name one (`cpu_microarchitecture`: "Zen 4"), since one kind
spans generations whose cores and memory differ.
"""

from __future__ import annotations

import functools
from pathlib import Path


@functools.cache
def cpuinfo() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo ("flags", "vendor_id", "model name", "cpu
    family", "model", ...); empty off Linux."""
    fields: dict[str, str] = {}
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return fields
    for line in lines:
        if not line.strip():
            if fields:
                break   # the end of the first processor's block
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The instruction-set flags the kernel reports (/proc/cpuinfo's `flags`); empty off Linux."""
    return frozenset(cpuinfo().get("flags", "").split())


@functools.cache
def cpu_vendor() -> str:
    """"Intel", "AMD", or what /proc/cpuinfo's vendor_id says ("" where it says nothing)."""
    vendor = cpuinfo().get("vendor_id", "")
    return {"GenuineIntel": "Intel", "AuthenticAMD": "AMD"}.get(vendor, vendor)


# AMD's generations by CPU family and model number (/proc/cpuinfo's "cpu family" and "model"):
# in a virtual machine the model name is often just "AMD EPYC", and two generations under that
# name differ in what their cores do at one instruction set (and may hide instructions, as a VM
# that shows a Zen 4 without AVX-512 does). Ranges from AMD's processor programming references.
AMD_GENERATIONS = {
    0x17: [(0x00, 0x2F, "Zen"), (0x30, 0xFF, "Zen 2")],
    0x19: [(0x00, 0x0F, "Zen 3"), (0x10, 0x1F, "Zen 4"), (0x20, 0x5F, "Zen 3"), (0x60, 0x7F, "Zen 4"),
           (0xA0, 0xAF, "Zen 4")],
    0x1A: [(0x00, 0xFF, "Zen 5")],
}


def cpu_family_model() -> tuple[int, int] | None:
    """(cpu family, model) of /proc/cpuinfo's first processor, or None where it does not say."""
    info = cpuinfo()
    try:
        return int(info["cpu family"]), int(info["model"])
    except (KeyError, ValueError):
        return None


def microarchitecture(vendor: str, family_model: tuple[int, int] | None) -> str:
    """"Zen 4" for an AMD CPU of family 25, model 17; "" where the table does not name it."""
    if vendor != "AMD" or family_model is None:
        return ""
    family, model = family_model
    return next((name for lo, hi, name in AMD_GENERATIONS.get(family, []) if lo <= model <= hi), "")


def cpu_microarchitecture() -> str:
    """This CPU's generation where `microarchitecture` can tell it ("Zen 4"), else ""."""
    return microarchitecture(cpu_vendor(), cpu_family_model())


AVX512_VNNI_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_vnni"})
AVX512_BF16_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_bf16"})   # VDPBF16PS, VCVTNEPS2BF16
AMX_BF16_FLAGS = AVX512_BF16_FLAGS | {"amx_tile", "amx_bf16"}   # TDPBF16PS on AMX tiles (tinyvllm/cpu_amx.c)
AVX2_FLAGS = frozenset({"avx2", "fma"})
# the flags a report records: what decides which kernel runs
REPORTED_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
                  "avx_vnni", "amx_int8", "amx_bf16")


AMX_FLAGS = frozenset({"amx_int8", "amx_bf16"})


def kind_of(flags: frozenset[str] | set[str]) -> str:
    """The kind of an x86 CPU with these flags: "amx", "avx512_vnni", "avx2" or "other"."""
    if AVX512_VNNI_FLAGS <= flags:
        return "amx" if AMX_FLAGS <= flags else "avx512_vnni"
    return "avx2" if AVX2_FLAGS <= flags else "other"


def report_kind(machine: dict) -> str | None:
    """The kind a report's machine was of: told from the flags it records where it records them
    (a report written before "amx" was a kind of its own says "avx512_vnni" for an AMX Xeon), else
    the kind it records, else None."""
    if machine.get("cpu_flags") and machine.get("cpu_kind"):
        return kind_of(set(machine["cpu_flags"]))
    return machine.get("cpu_kind")


def reported_flags(flags: frozenset[str]) -> list[str]:
    """Which of `REPORTED_FLAGS` are among `flags`, for a report."""
    return [f for f in REPORTED_FLAGS if f in flags]
