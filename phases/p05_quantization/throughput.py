"""The throughput checkpoints of phase 5 (tests/test_throughput.py runs them)."""

from tinyvllm.testing import WIDE_TINY_LLAMA_COMMAND as WIDE_CMD
from tinyvllm.testing import KindClaim, ThroughputCheckpoint

# What phase 5 exists for: a decode step reads every weight, so int8 weights (a quarter of
# float32's bytes) make a small-batch decode step faster; with AVX512-VNNI (cpu_int8_vnni) int8
# also does four times float32's multiply-adds per instruction, so batches of many sequences gain
# too. On an AVX2 CPU cpu_int8 (x in int16) has half float32's multiply rate at many rows: the
# batch checkpoint there guards against a larger loss than the one measured. On the wide tiny
# model a step is mostly fixed costs, not bytes: that checkpoint guards against a loss.
_BATCH = dict(num_prompts=12, dataset="chat", output_len="16-48", seed=0)
THROUGHPUT_CHECKPOINTS = (
    ThroughputCheckpoint(
        name="batch-1 decode of the default model: int8 weights over float32",
        baseline=4, workload="latency", model="default",
        engine_args=dict(quantization="int8", kv_cache_memory=2**27),  # one request: 128 MiB of KV
        workload_args=dict(num_prompts=1, dataset="random", input_len=32, output_len=32, seed=0),
        claimed_gain=1.69,
        claim_source="tests/test_throughput.py -m phase05 on an idle 2-core AMD EPYC (avx2), 2026-11-23, with 64 "
                     "new tokens: 19.9 vs 11.8 tok/s, 1.69x (cpu_int8); bench_command: 1.81x and 1.77x in two "
                     "runs (docs/assets/bench/latency-int8.json); on a Zen 4 EPYC (avx2 too, its float32 "
                     "through cpu_gemv.c), 2026-11-26: 1.42, 1.33, 1.44 and 1.22x idle, 1.17x once in a "
                     "suite run; on one H100 (torch 2.11+cu130, bfloat16, "
                     "Triton kernels), 2026-11-26: 0.98x, 0.80x and 0.91x in three runs (33.2 vs 34.0 "
                     "tok/s in the first; an eager step is kernel launches there, not bytes)",
        min_gain=1.1, rounds=2, gpu_min_gain=0.6,
        per_cpu_kind={"amx": KindClaim(
            2.35, 1.4, "tests/test_throughput.py -m phase05 on a 2-core Intel Xeon (amx), 2026-11-24: "
                       "80.4 vs 34.2 tok/s, 2.35x (cpu_int8_vnni; float32 through MKL's small-row kernel)")},
        bench_command=("tinyvllm bench latency --phases 4-5 --quantization int8 --input-len 32 "
                       "--output-len 128 --repeat 3")),
    ThroughputCheckpoint(
        name="12 chat requests at once (decode batches of up to 12) of the default model: int8 over float32",
        baseline=4, workload="throughput", model="default",
        engine_args=dict(quantization="int8", kv_cache_memory=2**28), workload_args=_BATCH,
        claimed_gain=0.78,
        claim_source="docs/assets/bench/throughput-64-int8.json, the 64-request version, on a 2-core AMD EPYC "
                     "(avx2), 2026-11-23: 0.78x (cpu_int8); this 12-request one 0.92x there (tests/test_throughput.py "
                     "-s, 2026-11-26): a guard",
        min_gain=0.5, rounds=1, gpu_min_gain=0.5,  # a guard far below both kinds' claims: one round
        per_cpu_kind={"amx": KindClaim(
            1.91, 1.3, "the bench_command with 24 requests on a 2-core Intel Xeon (amx), 2026-11-24: 443.4 vs "
                       "231.6 tok/s, 1.91x (cpu_int8_vnni); 1.59x on 64 requests of 16-256 new tokens "
                       "(docs/assets/bench/throughput-64-int8-vnni.json); not measured on a GPU")},
        bench_command=("tinyvllm bench throughput --phases 4-5 --quantization int8 --num-prompts 12 "
                       "--output-len 16-48 --repeat 2")),
    ThroughputCheckpoint(
        name="batch-1 decode of a tiny model: int8 weights over float32",
        baseline=4, workload="latency", model="wide-tiny", engine_args=dict(quantization="int8"),
        workload_args=dict(num_prompts=1, dataset="random", input_len=32, output_len=96, seed=0),
        claimed_gain=1.54,
        claim_source="tests/test_throughput.py -m phase05 on an idle 2-core AMD EPYC (avx2), 2026-11-23: 163.5 vs "
                     "105.9 tok/s, 1.54x (cpu_int8); on one H100 (torch 2.11+cu130, bfloat16, Triton kernels), "
                     "2026-11-23: 319.2 vs 344.8 tok/s, 0.93x (a step of this tiny model is kernel launches, "
                     "not bytes)",
        min_gain=0.8, gpu_min_gain=0.7,
        per_cpu_kind={"amx": KindClaim(
            1.37, 0.8, "tests/test_throughput.py -m phase05 on a 2-core Intel Xeon (amx), 2026-11-24: "
                       "780.3 vs 570.0 tok/s, 1.37x (cpu_int8_vnni)")},
        bench_command=(WIDE_CMD + "tinyvllm bench latency --model /tmp/wide-tiny --phases 4-5 "
                       "--quantization int8 --input-len 32 --output-len 96 --repeat 3")),
)
