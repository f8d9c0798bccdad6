"""`tinyvllm bench`: one harness for every speed number of the project.

It runs the phase ladder (`--phases 1-3`) and peers (`--vs hf`) on the same seeded requests,
measures the machine's limits in the same run, and reports each engine against them:

    workloads.py   the requests: throughput, latency, prefix (seeded)
    runners.py     one engine, one run: wall time, TTFT/TPOT, cache counters, peak memory
    hf.py          the Hugging Face transformers peer (left-padded static batches)
    machine.py     the machine: CPU/GPU, measured memory bandwidth and matmul rate, peak memory
    roofline.py    the decode roofline: the fastest decoding could be on this machine
    harness.py     warm-up, interleaved repeats, rounds that agree (or extra rounds), medians
    report.py      the table, the JSON report and the plot
    cli.py         the `tinyvllm bench` flags

From Python:

    from tinyvllm.entrypoints.bench.workloads import make_workload
    from tinyvllm.entrypoints.bench.harness import load_runners, run_bench

This package imports only the light command-line part on import, so `tinyvllm --help` stays fast;
torch and the engines load when a benchmark runs.
"""

from .cli import add_bench_parser, run_bench_command

__all__ = ["add_bench_parser", "run_bench_command"]
