"""Time one decode step, phase 7's static path against enforce_eager (phase 6), on one model.

    python -m phases.p07_cuda_graphs.tools.bench_step [--model DIR] [--batch 1 8] [--steps 30] [--gc-freeze]
        [--quantization none int8] [--profile [--json FILE] [--plot FILE]]
    python -m phases.p07_cuda_graphs.tools.bench_step --fused [--model DIR] [--batch 1 8]

Each batch: `batch` requests are prefilled in each engine, then `steps` decode steps of each are
timed, interleaved (median of the per-step times). With --profile, five more steps run under
torch.profiler and their time is split into the matrix products (PyTorch's product operators,
and phase 5's C kernels timed around each call), attention (the paged gather,
the cache write and SDPA) and the rest (every other operator and the Python between them: the
median step minus the first two), with the table of their top CPU ops; --json saves those
splits with the machine, --plot draws them. --quantization runs the pair once per weight format
(phase 5's `quantization`; "none" is float), all engines interleaved.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import sys
import time

import torch

from tinyvllm import LLM, SamplingParams
from tinyvllm.entrypoints.bench.timing import elapsed, median

PROMPT = "Write a short story about a robot who learns to paint."


def decode_step_times(engines: dict, batch: int, steps: int, gc_freeze: bool) -> dict[str, list[float]]:
    """Each engine's decode step times, `batch` requests each, the engines' steps interleaved
    (one step of each in turn), so a slower moment of the machine falls on both alike."""
    params = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
    for engine in engines.values():
        for i in range(batch):
            engine.add_request(f"r{i}", PROMPT, params)
        engine.step()           # prefills
        engine.step()           # warm-up decode
    if gc_freeze:
        gc.collect()
        gc.freeze()             # move what exists now out of the collector's reach
    times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(steps):
        for name, engine in engines.items():
            times[name].append(elapsed(engine.step))
    for engine in engines.values():
        engine.abort_request([f"r{i}" for i in range(batch)])
    if gc_freeze:
        gc.unfreeze()
    return times


# operators (self CPU time) counted as a step's matrix products and as its attention
PRODUCT_OPS = ("aten::mm", "aten::addmm", "aten::linear", "mkldnn::_linear_pointwise",
               "quantized::linear_with_input_q_dq_qweight_dq_output_fp32",
               "aten::_weight_int4pack_mm_for_cpu")
ATTENTION_OPS = ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::index_select",
                 "aten::index_copy_")
C_KERNELS = ("cpu_int8", "cpu_int8_vnni", "cpu_int4")   # phase 5's own, called through ctypes


@contextlib.contextmanager
def c_products_timed():
    """Phase 5's C kernels are calls through ctypes, not PyTorch operators, so the profiler sees
    them only as time between operators: while this is open each call is timed with a clock
    (the seconds add up in the list it yields), to be counted as a product."""
    from phases.p05_quantization import quant

    total = [0.0]

    def timed(fn):
        def call(layer, x):
            start = time.perf_counter()
            y = fn(layer, x)
            total[0] += time.perf_counter() - start
            return y
        return call

    saved = dict(quant.KERNEL_FNS)
    quant.KERNEL_FNS.update({k: timed(saved[k]) for k in C_KERNELS})
    try:
        yield total
    finally:
        quant.KERNEL_FNS.update(saved)


def step_breakdown(engine, steps: int = 5) -> tuple[float, float, float]:
    """`steps` decode steps under torch.profiler: (step, matrix products, attention), each the
    mean per step in ms."""
    from torch.profiler import ProfilerActivity, profile

    with c_products_timed() as c_seconds, profile(activities=[ProfilerActivity.CPU]) as prof:
        step = elapsed(lambda: [engine.step() for _ in range(steps)]) / steps
    ops = {e.key: e.self_cpu_time_total for e in prof.key_averages()}   # microseconds
    products = (sum(ops.get(k, 0.0) for k in PRODUCT_OPS) / 1e3 + c_seconds[0] * 1e3) / steps
    attention = sum(ops.get(k, 0.0) for k in ATTENTION_OPS) / 1e3 / steps
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    return 1e3 * step, products, attention


def plot_breakdown(report: dict):
    """Stacked bars: each (batch, engine)'s median step as matrix products, attention, the rest."""
    from tinyvllm.entrypoints.bench.report import cpu_name, require_matplotlib

    require_matplotlib()
    from matplotlib.figure import Figure

    batches = sorted({r["batch"] for r in report["rows"]})
    fig = Figure(figsize=(9, 1.6 + 1.2 * len(report["rows"])), layout="constrained")
    axes = fig.subplots(len(batches), 1, squeeze=False)[:, 0]
    parts = (("products_ms", "matrix products", "#4c72b0"), ("attention_ms", "attention", "#dd8452"),
             ("rest_ms", "the rest (other operators, Python)", "#c44e52"))
    for ax, b in zip(axes, batches):
        rows = [r for r in report["rows"] if r["batch"] == b]
        left = [0.0] * len(rows)
        for key, label, color in parts:
            vals = [r[key] for r in rows]
            ax.barh([r["engine"] for r in rows], vals, left=left, color=color, label=label)
            left = [x + v for x, v in zip(left, vals)]
        for y, r in enumerate(rows):
            ax.text(r["step_ms"], y, f" {r['step_ms']:.1f} ms", va="center")
        ax.set_title(f"batch {b}: one decode step", loc="left")
        ax.set_xlim(0, 1.18 * max(r["step_ms"] for r in rows))
        ax.invert_yaxis()
    axes[-1].set_xlabel("milliseconds (median step; products and attention from torch.profiler)")
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncols=3, fontsize=8)
    m = report["machine"]
    fig.suptitle(f"{cpu_name(m)}, {m['torch_threads']} threads, torch {m['torch']}", fontsize=9)
    return fig


class _NoCache:
    """Attention stand-in (returns q): times the projections and MLP alone."""

    def __call__(self, layer_idx, q, k, v):
        return q


def bench_fused(model_dir, batches: list[int], repeat: int = 15) -> None:
    """The model's forward with separate and with fused projections, interleaved, min of `repeat`."""
    import copy

    from ..fused import fuse_projections

    model = LLM(model_dir, phase=7, enforce_eager=True).llm_engine.model
    fused = copy.deepcopy(model)
    print(f"copy + fuse_projections: {elapsed(lambda: fuse_projections(fused)):.2f} s")
    for n in batches:
        device = model.model.embed_tokens.weight.device
        ids, pos = torch.randint(0, 1000, (n,), device=device), torch.arange(n, device=device) + 20
        times: dict[str, list[float]] = {"separate": [], "fused": []}
        for _ in range(repeat):
            for name, m in (("separate", model), ("fused", fused)):
                sync = torch.cuda.synchronize if device.type == "cuda" else None  # the GPU's time
                times[name].append(elapsed(lambda: m(ids, pos, _NoCache()), sync))
        print(f"batch {n:3d}  forward separate {1e3 * min(times['separate']):7.1f} ms, "
              f"fused {1e3 * min(times['fused']):7.1f} ms (min of {repeat}, interleaved)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--gc-freeze", action="store_true")
    ap.add_argument("--quantization", nargs="+", default=["none"], choices=["none", "int8", "int4"],
                    help="phase 5's weight formats: the two engines once per format")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--fused", action="store_true", help="time separate against fused projections")
    ap.add_argument("--json", default=None, help="with --profile: save the step splits here")
    ap.add_argument("--plot", default=None, help="with --profile: draw the step splits here (PNG)")
    a = ap.parse_args()
    if (a.json or a.plot) and not a.profile:
        ap.error("--json and --plot need --profile")
    torch.set_grad_enabled(False)
    if a.fused:
        return bench_fused(a.model, a.batch)
    engines = {}
    for q in a.quantization:
        args = dict(phase=7, max_num_seqs=max(a.batch), quantization=None if q == "none" else q)
        suffix = "" if q == "none" else f", {q}"
        engines[f"phase 7{suffix}"] = LLM(a.model, **args).llm_engine
        engines[f"enforce_eager (phase 6){suffix}"] = LLM(a.model, enforce_eager=True, **args).llm_engine
    rows = []
    for b in a.batch:
        times = decode_step_times(engines, b, a.steps, a.gc_freeze)
        for name, engine in engines.items():
            ms = 1e3 * median(times[name])
            print(f"batch {b:3d}  {name:30s} decode step {ms:7.2f} ms (median of {a.steps})", flush=True)
            if a.profile:
                params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
                for i in range(b):
                    engine.add_request(f"p{i}", PROMPT, params)
                engine.step(), engine.step()
                step, products, attention = step_breakdown(engine)
                # the profiler slows every operator call a little, so "the rest" is taken from
                # the unprofiled median step: what the products and attention do not explain
                rest = ms - products - attention
                print(f"batch {b:3d}  {name:30s} profiled step {step:.1f} ms: matrix products "
                      f"{products:.1f}, attention {attention:.1f}; the rest of the median step "
                      f"{rest:.1f}", flush=True)
                engine.abort_request([f"p{i}" for i in range(b)])
                rows.append(dict(batch=b, engine=name, step_ms=round(ms, 2), products_ms=round(products, 2),
                                 attention_ms=round(attention, 2), rest_ms=round(rest, 2)))
    if a.json or a.plot:
        from tinyvllm.entrypoints.bench.machine import machine_info
        from tinyvllm.entrypoints.bench.report import write_json

        report = dict(command="python -m phases.p07_cuda_graphs.tools.bench_step " + " ".join(sys.argv[1:]),
                      date=time.strftime("%Y-%m-%d"), machine=machine_info(torch.device("cpu")),
                      steps=a.steps, rows=rows)
        if a.json:
            write_json(report, a.json)
        if a.plot:
            plot_breakdown(report).savefig(a.plot, dpi=110)


if __name__ == "__main__":
    main()
