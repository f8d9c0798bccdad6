"""The throughput checkpoint of phase 8 (tests/test_throughput.py runs it)."""

from tinyvllm.testing import WIDE_TINY_LLAMA_COMMAND as WIDE_CMD
from tinyvllm.testing import ThroughputCheckpoint

# What phase 8 is for, more devices than one, cannot pay on a CPU of two cores shared by two
# ranks: the checkpoint bounds what the collectives cost instead. Two ranks over one, a decode
# batch of 32: every step pays two all-reduces a layer, a cost that a larger batch amortizes.
THROUGHPUT_CHECKPOINTS = (
    ThroughputCheckpoint(
        name="decode of 32 sequences over two ranks: what the all-reduces cost against one rank",
        baseline=7, workload="throughput", model="wide-tiny",
        engine_args=dict(tensor_parallel_size=2, max_num_seqs=32),
        workload_args=dict(num_prompts=32, dataset="random", input_len=16, output_len=64, seed=0),
        claimed_gain=0.32,
        claim_source="tests/test_throughput.py -m phase08 on a 2-core Intel Xeon (amx), 2026-11-24: "
                     "1749.6 vs 5581.8 and 1894.8 vs 5718.8 tok/s, 0.31x and 0.33x; not measured on an AVX2 CPU "
                     "or a GPU",
        min_gain=0.15, gpu_min_gain=None, rounds=2,
        bench_command=(WIDE_CMD + "tinyvllm bench throughput --model /tmp/wide-tiny --phases 7,8 "
                       "--tensor-parallel-size 2 --max-num-seqs 32 --num-prompts 32 --input-len 16 "
                       "--output-len 64 --repeat 3")),
)
