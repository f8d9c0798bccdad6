"""Phase 5: int8 and int4 weights, and a quantized KV cache."""

from tinyvllm.testing import WIDE_TINY_LLAMA_COMMAND as WIDE_CMD
from tinyvllm.testing import ThroughputCheckpoint

from .engine import Engine

__all__ = ["Engine"]


# What phase 5 exists for: a decode step reads every weight, so int8 weights (a quarter of
# float32's bytes) should make a small-batch decode step faster. On this AVX2 CPU they do not
# (fbgemm's int8 call costs about what reading a small layer's float32 weights does): the
# checkpoint records the loss measured, and guards it from growing, until a faster kernel lands.
THROUGHPUT_CHECKPOINTS = (
    ThroughputCheckpoint(
        name="batch-1 decode: int8 weights over float32",
        baseline=4, workload="latency", model="wide-tiny", engine_args=dict(quantization="int8"),
        workload_args=dict(num_prompts=1, dataset="random", input_len=32, output_len=96, seed=0),
        claimed_gain=0.73,
        claim_source="tests/test_throughput.py -m phase05 on an idle 2-core EPYC (AVX2), 2026-11-23: "
                     "89.1 vs 122.3 tok/s, 0.73x: int8 is SLOWER here, no gain is claimed (per-token "
                     "scales and the two-part split; the first int8 path measured 0.48x); on one H100 "
                     "(torch 2.11+cu130, bfloat16, Triton kernels, unchanged since), 2026-11-23: "
                     "319.2 vs 344.8 tok/s, 0.93x (a step of this tiny model is kernel launches, not bytes)",
        min_gain=0.5, gpu_min_gain=0.7,
        bench_command=(WIDE_CMD + "tinyvllm bench latency --model /tmp/wide-tiny --phases 4-5 "
                       "--quantization int8 --input-len 32 --output-len 96 --repeat 3")),
)
