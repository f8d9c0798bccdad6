"""Phase 5: int8 and int4 weights, and a quantized KV cache."""

from tinyvllm.testing import WIDE_TINY_LLAMA_COMMAND as WIDE_CMD
from tinyvllm.testing import ThroughputCheckpoint

from .engine import Engine

__all__ = ["Engine"]


# What phase 5 exists for: a decode step reads every weight, so int8 weights (a quarter of
# float32's bytes) make a small-batch decode step faster. On the default model (538 MB of float32
# weights a token) tinyvllm's own int8 kernel (cpu_int8.c) gains ~1.7-1.8x on this AVX2 CPU. On the
# wide tiny model a step is mostly fixed costs, not bytes: that checkpoint guards against a loss.
THROUGHPUT_CHECKPOINTS = (
    ThroughputCheckpoint(
        name="batch-1 decode of the default model: int8 weights over float32",
        baseline=4, workload="latency", model="default",
        engine_args=dict(quantization="int8", kv_cache_memory=2**27),  # one request: 128 MiB of KV
        workload_args=dict(num_prompts=1, dataset="random", input_len=32, output_len=32, seed=0),
        claimed_gain=1.69,
        claim_source="tests/test_throughput.py -m phase05 on an idle 2-core EPYC (AVX2), 2026-11-23, with 64 "
                     "new tokens: 19.9 vs 11.8 tok/s, 1.69x (cpu_int8); with the 32 it runs now (to save CI "
                     "time), at a slow moment of the machine: 14.6 vs 6.9, 2.11x; bench_command: 1.81x and "
                     "1.77x in two runs (docs/assets/bench/latency-int8.json); fbgemm's kernel, before it, "
                     "1.01x; not measured on a GPU",
        min_gain=1.2, rounds=2,
        bench_command=("tinyvllm bench latency --phases 4-5 --quantization int8 --input-len 32 "
                       "--output-len 128 --repeat 3")),
    ThroughputCheckpoint(
        name="batch-1 decode of a tiny model: int8 weights over float32",
        baseline=4, workload="latency", model="wide-tiny", engine_args=dict(quantization="int8"),
        workload_args=dict(num_prompts=1, dataset="random", input_len=32, output_len=96, seed=0),
        claimed_gain=1.54,
        claim_source="tests/test_throughput.py -m phase05 on an idle 2-core EPYC (AVX2), 2026-11-23: 163.5 vs "
                     "105.9 tok/s, 1.54x (cpu_int8; fbgemm's kernel, before it, 0.73x); on one H100 (torch "
                     "2.11+cu130, bfloat16, Triton kernels, unchanged since), 2026-11-23: 319.2 vs 344.8 tok/s, "
                     "0.93x (a step of this tiny model is kernel launches, not bytes)",
        min_gain=0.8, gpu_min_gain=0.7,
        bench_command=(WIDE_CMD + "tinyvllm bench latency --model /tmp/wide-tiny --phases 4-5 "
                       "--quantization int8 --input-len 32 --output-len 96 --repeat 3")),
)
