"""The throughput checkpoints of phase 3 (tests/test_throughput.py runs them)."""

from tinyvllm.testing import WIDE_TINY_LLAMA_COMMAND as WIDE_CMD
from tinyvllm.testing import KindClaim, ThroughputCheckpoint

# The gain phase 3 exists for: requests queueing for seats (max_num_seqs below the number of
# requests) with mixed output lengths. Static batches (phase 2, transformers' generate) keep a
# finished request's seat empty until the longest of its batch ends; continuous batching refills
# it at the next step (tests/test_throughput.py checks it).
_QUEUED = dict(num_prompts=32, dataset="random", input_len="16-64", output_len="4-64", seed=0)
_QUEUED_FLAGS = "--num-prompts 32 --dataset random --input-len 16-64 --output-len 4-64 --max-num-seqs 4"

THROUGHPUT_CHECKPOINTS = (
    ThroughputCheckpoint(
        name="requests queueing for 4 seats: continuous over static batching",
        baseline=2, workload="throughput", model="wide-tiny", engine_args=dict(max_num_seqs=4),
        workload_args=_QUEUED,
        claimed_gain=1.37,
        claim_source="docs/assets/bench/throughput-64-4seqs.json (SmolLM2-135M, 64 requests, 4 seats, "
                     "2-core EPYC): 1.37x; throughput-8seqs.json (8 seats): 1.25x",
        min_gain=1.05, rounds=6,  # rounds within 3% of each other on the first AVX2 EPYC; on a Zen 4
        # EPYC (avx2 too) best-of-2 ratios spread from 1.09x to 1.44x; best-of-4 gave 1.20-1.28x alone,
        # and 1.07x once in a full run (phase 2's one fast round against phase 3's four slowed ones): six;
        # best-of-6 gave 1.24x and 1.14x alone, 1.06x once in a fresh clone's full run (phase 2's rounds
        # 293, 313, 255, 252, 215, 195 tok/s against phase 3's 333, 333, 321, 272, 305, 294): 1.05x
        # on a faster CPU a step of the wide tiny model is mostly fixed costs, and the scheduler's
        # are larger than a static batch's: the 1.49x fewer steps buy less time
        per_cpu_kind={"amx": KindClaim(
            1.15, 1.03, "tests/test_throughput.py -m phase03 -s on a 2-core Intel Xeon (amx), 2026-11-24, "
                        "four runs: 1.10x, 1.14x, 1.17x, 1.17x (six rounds)", rounds=3)},
        bench_command=(WIDE_CMD + "tinyvllm bench throughput --model /tmp/wide-tiny --phases 2-3 "
                       + _QUEUED_FLAGS + " --repeat 3")),
    ThroughputCheckpoint(
        name="requests queueing for 4 seats: continuous batching over transformers' generate",
        baseline="hf", workload="throughput", model="wide-tiny", engine_args=dict(max_num_seqs=4),
        workload_args=_QUEUED,
        claimed_gain=2.3,
        claim_source="docs/assets/bench/throughput-8seqs.json (SmolLM2-135M, 32 requests, 8 seats, "
                     "2-core EPYC): 147 / 63 tok/s = 2.3x",
        min_gain=1.3, rounds=2,  # 2.04x measured: two rounds leave room enough
        # on a faster CPU transformers' static batches lose less time to their padding rows
        per_cpu_kind={"amx": KindClaim(
            1.4, 1.15, "tests/test_throughput.py -k phase3-vs-hf -s on a 2-core Intel Xeon (amx), "
                       "2026-11-24: 1.39x, 1.38x, 1.42x; 1.28x once, in a fresh clone's full run")},
        bench_command=(WIDE_CMD + "tinyvllm bench throughput --model /tmp/wide-tiny --phases 3 --vs hf "
                       + _QUEUED_FLAGS + " --repeat 2")),
)
