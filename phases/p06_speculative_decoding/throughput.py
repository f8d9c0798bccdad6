"""The throughput checkpoints of phase 6 (tests/test_throughput.py runs them)."""

from tinyvllm.testing import WIDE_TINY_LLAMA_COMMAND as WIDE_CMD
from tinyvllm.testing import ThroughputCheckpoint

# The gain phase 6 exists for: a batch-1 answer that copies its prompt; n-gram proposals are
# verified k at a time in one pass. The default model is needed for that: only a trained model
# copies. The second checkpoint guards the cost of speculating where proposals mostly miss.
_NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
THROUGHPUT_CHECKPOINTS = (
    ThroughputCheckpoint(
        name="batch-1 answer that copies its prompt: n-gram speculation over one token a pass",
        baseline=5, workload="latency", model="default",
        engine_args=dict(speculative_config=_NGRAM, kv_cache_memory=2**27),  # one request: 128 MiB of KV
        workload_args=dict(num_prompts=1, dataset="reuse", output_len=64, seed=0),
        claimed_gain=2.34,
        claim_source="bench_command on an idle 2-core EPYC (AVX2), 2026-11-23: 21.5 vs 9.2 tok/s, "
                     "2.34x (94% of drafts accepted); over 6 reuse prompts 2.19x "
                     "(docs/assets/bench/spec-ngram-reuse.json); not measured on a GPU",
        min_gain=1.5, rounds=2,
        bench_command=("tinyvllm bench latency --phases 5,6 --dataset reuse --num-prompts 1 --output-len 64 "
                       "--repeat 3 --speculative-config '{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
                       "\"prompt_lookup_min\": 2, \"prompt_lookup_max\": 4}'")),
    ThroughputCheckpoint(
        name="batch-1 decode of text that repeats: n-gram speculation over one token a pass",
        baseline=5, workload="latency", model="wide-tiny", engine_args=dict(speculative_config=_NGRAM),
        workload_args=dict(num_prompts=1, dataset="random", input_len=32, output_len=128, seed=0),
        claimed_gain=0.85,
        claim_source="tests/test_throughput.py on the wide tiny model (its greedy output loops, so "
                     "the n-gram proposer finds it), idle 2-core EPYC (AVX2), 2026-11-23: 96.8 vs "
                     "113.8 tok/s, 0.85x: no gain on this workload yet; on one H100 (torch 2.11+cu130, bfloat16), 2026-11-23: 313.6 vs 345.8 tok/s, "
                     "0.91x",
        min_gain=0.6, gpu_min_gain=0.7,
        bench_command=(WIDE_CMD + "tinyvllm bench latency --model /tmp/wide-tiny --phases 5-6 "
                       "--input-len 32 --output-len 128 --repeat 3 --speculative-config "
                       "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4}'")),
)
