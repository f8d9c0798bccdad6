"""The one place that knows the machine: which path each part takes on this CPU or GPU.

The fastest matrix product, attention loop or norm on a CPU depends on what the CPU can do, and
the machines tinyvllm runs on are not alike. tinyvllm tells four *kinds* of CPU apart
(`tinyvllm.hardware.kind_of`): "avx2" (AVX2 and FMA), "avx512_vnni" (AVX-512 with VNNI: an AMD
EPYC Zen 4), "amx" (AVX-512, VNNI, BF16 and AMX's matrix tiles: an Intel Xeon of the Sapphire
Rapids generation) and "other" (a CPU with none of tinyvllm's hand-written kernels: an ARM
laptop's). Every choice that depends on the kind is a row of `RULES`: one value per kind, and
the committed measurement that chose it. A part reads its rows once, when a recipe builds it
(`current().rule(name)`); nothing else in tinyvllm asks what CPU this is. vLLM answers the same
questions with one object per device (`vllm/platforms/`: `current_platform`).

A choice measured on one kind is made on that kind only: a kind where a path was not measured
keeps the plain one. So one machine can check every kind's paths: `TINYVLLM_CPU_KIND=<kind>`
makes the platform act as any kind this CPU can execute (amx contains avx512_vnni contains avx2;
"other" uses none of their instructions), hiding the flags the kind does not have from every C
kernel (`Platform.has`) and answering every rule as that kind. `make test-kinds` runs the
kind-keyed tests once per kind this machine can act as (`acting_kinds`).

    python -m tinyvllm.platform                    # this machine's kind, the kinds it can act as, every rule
    python -m tinyvllm.platform --acting-kinds     # just the kinds it can act as (--other-kinds: but its own)
"""

from __future__ import annotations

import os
import platform as _os_platform
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

from tinyvllm.hardware import cpu_flags, cpu_vendor, kind_of

KINDS = ("avx2", "avx512_vnni", "amx", "other")
ENV = "TINYVLLM_CPU_KIND"
REPORTS = "docs/assets/bench/"   # where the reports named below are committed


@dataclass(frozen=True)
class Rule:
    """One choice, on each kind of CPU, and why: the committed report (or lab note) that chose it.
    A kind where the choice was not measured has the plain path's value (0, False or None)."""

    avx2: object
    avx512_vnni: object
    amx: object
    other: object
    why: str


# Every choice that depends on the CPU's kind. Reports are under docs/assets/bench/; the lab notes
# (docs/lab/) hold the measurement logs.
RULES: dict[str, Rule] = {
    # -- products: phase 4's CpuLinear ------------------------------------------------------------
    "gemv_max_rows": Rule(8, 1, 0, 0, "float32 products up to this many rows in cpu_gemv.c: it streams "
                          "the weights faster than MKL and oneDNN on AVX2 (linear-cpu-amd-avx2.txt) and lets "
                          "cpu_step.c serve a float32 model at one row on AVX-512 (kind-rules-zen4-avx512-float32"
                          ".json); MKL wins on the amx kind (linear-codes-xeon-amx.txt, kind-rules-xeon-amx.json)"),
    "bf16_upcast_from_rows": Rule(24, 0, 0, 0, "a bfloat16 product of this many rows or more runs in float32 "
                                  "where the CPU has no bfloat16 arithmetic (dtype-avx2-bf16-latency.json, lab "
                                  "note 7)"),
    "bf16_onednn": Rule(False, True, False, False, "a bfloat16 product runs in oneDNN on the packed weight at "
                        "every row count where AVX512-BF16 is native (linear-bf16-zen4-avx512.txt)"),
    "bf16_products_from_rows": Rule(0, 7, 6, 0, "with dtype=\"auto\", a float32 model's products of this many rows "
                                    "or more run in bfloat16, output float32 (bf16-rows-zen4-avx512.json, "
                                    "bf16-rows-xeon-amx.json, accuracy-bf16-products-zen4-avx512.json, "
                                    "accuracy-auto-xeon-amx.json); nothing to gain without bfloat16 arithmetic"),
    "amx_product_max_rows": Rule(0, 0, 128, 0, "those bfloat16 products up to this many rows on cpu_amx.c's "
                                 "tiles, which read the weights faster than oneDNN at a decode step's rows "
                                 "(linear-amx-xeon-amx.txt); a bfloat16 model's too (dtype=\"bfloat16\": "
                                 "bf16-latency-vllm-xeon-amx.json, lab note 7)"),
    # -- norms, RoPE, the MLP: phase 4's layers, phase 7's decode step ----------------------------
    "c_rope": Rule(False, False, True, False, "RoPE on float32 rows in one call of cpu_norm.c (lab note 7: a "
                   "2,000-token prompt's first token 0.849 -> 0.820 s)"),
    "c_norm_decode": Rule(True, True, True, False, "the residual add and RMSNorm of phase 7's decode step in one "
                          "call of cpu_norm.c (lab note 7; kind-rules-zen4-avx512.json, kind-rules-xeon-amx.json)"),
    "c_norm_prompt": Rule(False, False, True, False, "the model's RMSNorm modules, a prompt's rows included, in "
                          "cpu_norm.c (lab note 7: a 2,000-token first token 1.284 -> 1.141 s)"),
    "bf16_mlp": Rule(False, False, True, False, "a prompt's fused MLP stays bfloat16 between its two products, "
                     "silu(gate) * up in one pass (lab note 7: a 2,000-token first token 1.440 -> 1.175 s)"),
    # -- attention: phase 4's CPU path ------------------------------------------------------------
    "bf16_kv_float32": Rule(False, False, True, False, "a bfloat16 model's KV cache in float32, so its decode "
                            "steps attend in cpu_attention.c (float32 only; q, k and v made float32 at the "
                            "call, exactly) instead of phase 2's gather and SDPA in bfloat16, and its prompts on "
                            "the AMX tiles where `bf16_prefill` says: twice the bytes a cached token (lab note 7: "
                            "bf16-latency-vllm-xeon-amx.json, bf16-throughput-48-vllm-xeon-amx.json)"),
    "c_prefill": Rule(True, True, False, False, "a prompt's float32 attention in cpu_attention.c's register "
                      "tiles, faster than SDPA at every length measured (kernels-prefill-zen4.json, "
                      "kernels-prefill-zen4-avx512.json)"),
    "bf16_prefill": Rule(False, True, True, False, "where the products run in bfloat16, so do a prompt's "
                         "attention products: the C kernel's VDPBF16PS loop (kernels-prefill-bf16-zen4-avx512"
                         ".json), cpu_amx.c's tiles on the amx kind (kernels-prefill-bf16-xeon-amx.json, "
                         "accuracy-bf16-prefill-attention-zen4-avx512.json)"),
    "decode_fetch_ahead": Rule(False, False, True, False, "the decode kernel asks for each next block while it "
                               "reads one (lab note 4: 48 chat prompts 681 -> 776 tok/s), the same numbers"),
    # -- the step ---------------------------------------------------------------------------------
    "bf16_max_num_batched_tokens": Rule(None, None, 2048, None, "a CPU step's token budget where dtype=\"auto\" "
                                        "multiplies in bfloat16: oneDNN's AMX products run faster on larger "
                                        "chunks (lab note 7: a 2,000-token first token 1.33 -> 1.18 s)"),
    "c_step": Rule(True, True, True, False, "phase 7's decode step in one call of cpu_step.c where every "
                   "product has a C kernel (kind-rules-zen4-avx512.json, kind-rules-xeon-amx.json, "
                   "kind-rules-xeon-amx-nogemv.json)"),
    # -- weights on codes: phase 5 ----------------------------------------------------------------
    "codes_max_rows": Rule(12, 12, 8, 0, "a float32 weight stored on 4- or 8-bit codes is read from them up to "
                           "this many rows (linear-codes-zen4.txt, linear-codes-zen4-avx512.txt, "
                           "linear-codes-xeon-amx.txt)"),
    "codes_fetch_ahead": Rule(0, 0, 4096, 0, "cpu_lossless.c asks for the codes this many bytes ahead of those "
                              "it reads (0: its own 1024): a decode step's pass over a Q4_K_M file's codes 7.9 -> "
                              "6.5 ms (codes-fetch-ahead-xeon-amx.txt)"),
    "int4_dequant_from_rows": Rule(64, None, None, None, "int4 products of this many rows or more unpack the "
                                   "weight for a float32 product (quant-kernels-cpu-many-rows-avx2.txt)"),
    "int4_f16_scales": Rule(False, True, False, False, "cpu_int4 reads 16-bit scales and zeros "
                            "(lab note 5: a decode step's products 4.37 against 4.84 ms)"),
}

# What each kind may use of a CPU's flags (/proc/cpuinfo), by prefix: acting as a kind hides the
# rest, so that no kernel built for a richer kind loads.
HIDDEN_PREFIXES = {"amx": (), "avx512_vnni": ("amx",), "avx2": ("amx", "avx512"), "other": None}
DEFAULT_MAX_NUM_BATCHED_TOKENS = {"cpu": 512, "cuda": 2048}   # vLLM's LLM takes 8192 or more on a GPU


@dataclass(frozen=True)
class Platform:
    """This machine as tinyvllm sees it: the CPU kind it acts as, the flags that kind may use,
    and the answer of every rule there (`overrides` first: a measurement tool's or a test's)."""

    kind: str
    flags: frozenset[str]
    vendor: str
    x86: bool
    overrides: dict = field(default_factory=dict)

    def rule(self, name: str):
        """The value of `RULES[name]` on this kind."""
        if name in self.overrides:
            return self.overrides[name]
        return getattr(RULES[name], self.kind)

    def with_rules(self, **values) -> "Platform":
        """This platform with some rules answered otherwise (a tool timing both ways, a test)."""
        unknown = set(values) - set(RULES)
        if unknown:
            raise ValueError(f"no such rule(s): {sorted(unknown)}; the rules are {sorted(RULES)}")
        return replace(self, overrides={**self.overrides, **values})

    def has(self, needs: frozenset[str] | set[str]) -> bool:
        """Whether this kind may run code built for these CPU flags (a C kernel's `needs`)."""
        return self.x86 and set(needs) <= self.flags

    @property
    def onednn(self) -> bool:
        """oneDNN's packed products: PyTorch's x86 CPU builds, on a kind with hand-written kernels
        ("other" stands for a CPU without them, whose products are PyTorch's plain ones)."""
        import torch

        return (self.x86 and self.kind != "other" and torch.backends.mkldnn.is_available()
                and hasattr(torch.ops.mkldnn, "_linear_pointwise"))

    @property
    def small_rows(self) -> tuple[int, bool]:
        """Up to how many rows a float32 product is a library's small-row one, and whether that is
        MKL's `F.linear` (an Intel CPU: MKL takes its fast paths there) or (W @ x^T)^T, which MKL
        streams fastest elsewhere (linear-cpu-intel.txt, linear-cpu-amd.txt)."""
        return (3, True) if self.vendor == "Intel" else (2, False)

    def max_num_batched_tokens(self, device_type: str, bf16_products: bool) -> int:
        """A step's token budget where the user sets none: the device's, or on a CPU whose
        products run in bfloat16 the kind's (`bf16_max_num_batched_tokens`)."""
        bf16 = self.rule("bf16_max_num_batched_tokens") if bf16_products and device_type == "cpu" else None
        return bf16 or DEFAULT_MAX_NUM_BATCHED_TOKENS.get(device_type, 2048)

    def bf16_product_rows(self, dtype: str, device_type: str, tensor_parallel_size: int = 1) -> int:
        """From how many rows a float32 model's products run in bfloat16 (0: never): with
        dtype="auto" on a CPU, one rank (several would round each rank's partial sum), where oneDNN
        runs, what `bf16_products_from_rows` says. $TINYVLLM_BF16_PRODUCTS=0 turns it off for every
        engine of the process (the test suite's setting: its references are float32's)."""
        if (dtype != "auto" or device_type != "cpu" or tensor_parallel_size > 1 or env_switch("TINYVLLM_BF16_PRODUCTS") == 0
                or not self.onednn):
            return 0
        return self.rule("bf16_products_from_rows") or 0

    def describe(self) -> str:
        lines = [f"kind: {self.kind} (this CPU: {native_kind()}; can act as: {', '.join(acting_kinds())})",
                 f"flags used: {' '.join(sorted(f for f in self.flags if f.startswith(('avx', 'fma', 'f16c', 'amx'))))}"]
        lines += [f"  {name} = {self.rule(name)!r}" for name in RULES]
        return "\n".join(lines)


def resolve_device(device: str):
    """"auto": a CUDA GPU where one is present, else the CPU; "cuda..." refused where none is."""
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was asked for, but no CUDA GPU is available")
    return torch.device(device)


def resolve_dtype(dtype: str, device):
    """The model's dtype: "auto" is float32 on a CPU and bfloat16 on a GPU. On a CPU, float32
    weights won on every kind measured (dtype-avx2-bf16-latency.json: no bfloat16 arithmetic on
    AVX2; dtype-zen4-avx512-bf16-*.json: a bfloat16 engine's attention and elementwise work are
    slower), so there "auto" keeps float32 and multiplies many rows in bfloat16 where the kind
    computes it (`Platform.bf16_product_rows`)."""
    import torch

    if dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]


def compile_default(device_type: str) -> str | None:
    """When phase 7 compiles its decode step if the engine does not say: on a CPU in the
    background, from an unset `compilation_mode` ($TINYVLLM_COMPILATION_MODE=0 or 1 stands for
    one: the test suite's engines run eagerly); on a GPU never (it captures CUDA graphs)."""
    mode = env_switch("TINYVLLM_COMPILATION_MODE")
    if device_type != "cpu" or mode == 0:
        return None
    return "start" if mode == 1 else "background"


def check_kernels_default(check_kernels: bool | None, device_type: str) -> bool:
    """Whether the engine runs in checked mode (`check_kernels`; phase 2's `check_metadata`): as
    asked, else $TINYVLLM_CHECK_KERNELS (0 or 1) where set, else on a CPU, where the checks were
    measured well under the 2% of a decode step a default may cost (phase 7's tools/check_cost.py,
    check-kernels-*.json), and off on a GPU, where they are not measured and each waits for the
    device to copy the metadata back."""
    if check_kernels is not None:
        return check_kernels
    switch = env_switch("TINYVLLM_CHECK_KERNELS")
    return bool(switch) if switch is not None else device_type == "cpu"


def async_scheduling_default(async_scheduling: bool | None, device_type: str) -> bool:
    """Whether phase 9's engine core schedules the next step while this one's model runs
    (`async_scheduling`): as asked, else on a GPU (vLLM's default, where the host's work would
    leave the device idle; not measured here) and not on a CPU, where the forward already keeps
    every core busy and the loop's Python cannot hide behind it: measured as a loss there, on
    the default model and more on a tiny one (lab note 9, `tools/loop_profile.py`)."""
    return device_type != "cpu" if async_scheduling is None else async_scheduling


def engine_core_process() -> bool:
    """Whether an engine whose recipe has a front end (phase 9 on) runs its engine core in a
    process of its own: yes, unless $TINYVLLM_ENABLE_MULTIPROCESSING is 0 (vLLM's
    VLLM_ENABLE_V1_MULTIPROCESSING), which keeps the whole engine in the caller's process."""
    return env_switch("TINYVLLM_ENABLE_MULTIPROCESSING") != 0


def env_switch(name: str) -> int | None:
    """A 0/1 environment switch (None: unset); anything else is refused by name."""
    value = os.environ.get(name, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{name} must be 0 or 1 (or unset), got {value!r}")
    return int(value) if value else None


def _x86() -> bool:
    return _os_platform.machine().lower() in ("x86_64", "amd64")


def native_kind() -> str:
    """The kind of this CPU itself."""
    return kind_of(set(cpu_flags())) if _x86() else "other"


def flags_as(kind: str) -> frozenset[str]:
    """This CPU's flags as `kind` sees them (what it may use)."""
    hidden = HIDDEN_PREFIXES[kind]
    if hidden is None or not _x86():
        return frozenset()
    return frozenset(f for f in cpu_flags() if not f.startswith(hidden))


def acting_kinds() -> list[str]:
    """The kinds this CPU can act as: its own and every kind its instructions contain."""
    return [k for k in KINDS if k == "other" or (_x86() and kind_of(set(flags_as(k))) == k)]


def platform_as(kind: str) -> Platform:
    """The platform acting as `kind` (one of `acting_kinds()`; refused by name otherwise)."""
    if kind not in KINDS:
        raise ValueError(f"{ENV}={kind!r} is not a CPU kind: the kinds are {', '.join(KINDS)}; this machine "
                         f"can act as {', '.join(acting_kinds())}")
    if kind not in acting_kinds():
        raise ValueError(f"{ENV}={kind!r}: this CPU ({native_kind()}) cannot run that kind's instructions; it "
                         f"can act as {', '.join(acting_kinds())}")
    return Platform(kind, flags_as(kind), cpu_vendor(), _x86())


def rules_of(kind: str) -> Platform:
    """A platform that answers every rule as `kind`, on any machine, and may use no CPU flag: for
    reading what a kind chooses (a test of a rule), never for building an engine (no C kernel
    would load under it)."""
    if kind not in KINDS:
        raise ValueError(f"no such CPU kind {kind!r}: the kinds are {', '.join(KINDS)}")
    return Platform(kind, frozenset(), cpu_vendor(), _x86())


_CURRENT: list[Platform] = []   # the platform in use: read from the machine once (and `using`'s)


def current() -> Platform:
    """The platform: this machine, acting as $TINYVLLM_CPU_KIND where it is set."""
    if not _CURRENT:
        _CURRENT.append(platform_as(os.environ.get(ENV) or native_kind()))
    return _CURRENT[-1]


@contextmanager
def using(platform: Platform):
    """Within the block, `current()` is `platform` (a test or a measurement tool that builds an
    engine with other rules; a part reads its rules when it is built)."""
    current()
    _CURRENT.append(platform)
    try:
        yield platform
    finally:
        _CURRENT.pop()


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["--acting-kinds"]:   # make test-kinds: the names on one line
        print(" ".join(acting_kinds()))
    elif sys.argv[1:] == ["--other-kinds"]:  # CI, after `make test` ran this CPU's own kind
        print(" ".join(k for k in acting_kinds() if k != native_kind()))
    else:
        print(current().describe())
