"""Where an int8 decode step's time goes: the same step with each product done another way.

    python -m phases.p05_quantization.tools.step_parts [--model DIR] [--steps 25]

One phase 5 engine with int8 weights decodes one greedy request; every `QuantizedLinear`
product of its steps is done in turn (one step each, interleaved, so a slower moment of the
machine falls on all alike) by:

- `none`: no product at all, zeros of the output's shape (wrong tokens, right timing): the rest
  of the step, what no kernel can save;
- `calls`: `none` plus the chosen kernel's call with no output rows (x still rounded to
  integers): the Python and `ctypes` around each product;
- `cpu_int8_vnni` (where the CPU has AVX512-VNNI), `cpu_int8`, `fbgemm_w8a8` (the two-part
  split) and `fbgemm_one_part` (fbgemm on x as it is, one 7-bit scale a call: the speed without
  the split, not its accuracy).

It prints the median step time of each (ms).
"""

from __future__ import annotations

import argparse

import torch

from tinyvllm import LLM, SamplingParams
from tinyvllm.entrypoints.bench.timing import elapsed, median

from .. import cpu_int8, quant


def _none(layer, x):
    return x.new_zeros(x.shape[0], layer.out_features)


def _calls(layer, x):  # the whole call, no output rows
    if layer.layout == "vnni":
        cpu_int8.vnni_int8_matmul(x, layer.qweight, layer.scale, 0)
    else:
        cpu_int8.int8_matmul(x, layer.qweight[:0], layer.scale[:0])
    return x.new_zeros(x.shape[0], layer.out_features)


def _fbgemm_one_part(layer, x):
    return torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
        x, 1 / 63, 64, layer.packed("fbgemm_w8a8"))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--steps", type=int, default=25)
    a = p.parse_args(argv)
    ways = {"none": _none, "fbgemm_one_part": _fbgemm_one_part,
            "fbgemm_w8a8": quant.KERNEL_FNS["fbgemm_w8a8"]}
    if cpu_int8.available():
        ways |= {"calls": _calls, "cpu_int8": quant.KERNEL_FNS["cpu_int8"]}
    if cpu_int8.vnni_available():
        ways |= {"calls": _calls, "cpu_int8_vnni": quant.KERNEL_FNS["cpu_int8_vnni"]}
    engine = LLM(a.model, phase=5, quantization="int8", kv_cache_memory=2**27).llm_engine
    engine.add_request("r0", "Write a short story about a robot who learns to paint.",
                       SamplingParams(max_tokens=(a.steps + 1) * len(ways) + 8, temperature=0, ignore_eos=True))
    chosen = quant.QuantizedLinear.choose_kernel
    quant.QuantizedLinear.choose_kernel = lambda self, n: "_step_parts"   # every product: the way timed

    def step_with(fn) -> float:
        quant.KERNEL_FNS["_step_parts"] = fn
        return elapsed(engine.step)

    times: dict[str, list[float]] = {name: [] for name in ways}
    try:
        step_with(_none)            # the prefill
        for fn in ways.values():    # each way's first call (fbgemm packs its weights then)
            step_with(fn)
        for _ in range(a.steps):
            for name, fn in ways.items():
                times[name].append(step_with(fn))
    finally:
        quant.QuantizedLinear.choose_kernel = chosen
        quant.KERNEL_FNS.pop("_step_parts", None)
    print(f"torch {torch.__version__}, cpu capability {torch.backends.cpu.get_cpu_capability()}, "
          f"{torch.get_num_threads()} threads; int8 decode step, batch 1, median of {a.steps}")
    for name, ts in times.items():
        print(f"{name:16s} {1e3 * median(ts):6.1f} ms")


if __name__ == "__main__":
    main()
