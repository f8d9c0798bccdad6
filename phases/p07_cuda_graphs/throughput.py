"""The throughput checkpoints of phase 7 (tests/test_throughput.py runs them)."""

from tinyvllm.testing import WIDE_TINY_LLAMA_COMMAND as WIDE_CMD
from tinyvllm.testing import ThroughputCheckpoint

# The gain phase 7 exists for: the per-step overhead of a decode step (a persistent batch, static
# buffers, one vectorized sampler, fused projections) at small batch; on a CPU it shows most with
# phase 5's int8 weights, whose every product call has a fixed cost that fusing removes (less
# since phase 5's own int8 kernel, cpu_int8, made each call cheap).
THROUGHPUT_CHECKPOINTS = (
    ThroughputCheckpoint(
        name="batch-1 decode with int8 weights: fused quantized projections, the lean decode step",
        baseline=6, workload="latency", model="wide-tiny", engine_args=dict(quantization="int8"),
        workload_args=dict(num_prompts=1, dataset="random", input_len=32, output_len=96, seed=0),
        claimed_gain=1.05,
        claim_source="tests/test_throughput.py -m phase07 on an idle 2-core EPYC (AVX2), 2026-11-23: "
                     "167.3 vs 159.4 tok/s, 1.05x with phase 5's cpu_int8 kernel (118.3 vs 88.1, 1.28x, "
                     "with fbgemm's, whose fixed cost per call fusing halved); not measured on a GPU",
        # rounds of a fraction of a second: eleven, so that each engine has one the other lane of
        # the suite left alone (on a Zen 4 EPYC, where it measures 1.08-1.29x idle, three gave
        # 0.88x once in a suite run, and seven 0.89x: phase 6 had one quiet round, 208 tok/s
        # against its others' 145-172)
        min_gain=0.9, gpu_min_gain=None, rounds=11,
        bench_command=(WIDE_CMD + "tinyvllm bench latency --model /tmp/wide-tiny --phases 6-7 "
                       "--quantization int8 --input-len 32 --output-len 96 --repeat 3")),
    ThroughputCheckpoint(
        name="decode of 8 sequences: persistent batch and static buffers over phase 6's step",
        baseline=6, workload="throughput", model="wide-tiny", engine_args=dict(max_num_seqs=8),
        workload_args=dict(num_prompts=8, dataset="random", input_len=16, output_len=96, seed=0),
        claimed_gain=1.03,
        claim_source="tests/test_throughput.py -m phase07 on an idle 2-core EPYC (AVX2), 2026-11-23: "
                     "646.1 vs 624.9 tok/s, 1.03x (no loss); on one H100 (torch 2.11+cu130, bfloat16), 2026-11-23: 8505.6 vs 2534.4 tok/s, "
                     "3.36x: the CUDA graphs",
        min_gain=0.8, gpu_min_gain=2.0,
        bench_command=(WIDE_CMD + "tinyvllm bench throughput --model /tmp/wide-tiny --phases 6-7 "
                       "--max-num-seqs 8 --num-prompts 8 --input-len 16 --output-len 96 --repeat 3")),
)
