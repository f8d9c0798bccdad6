"""Engine arguments on a command line: a flag per `EngineConfig` field, and back.

Every engine argument is a flag, made from the dataclass itself, so an argument a later phase
adds is available without touching this file: `max_num_seqs` is `--max-num-seqs N`; a switch
that is on by default, `enable_prefix_caching`, is turned off by `--no-prefix-caching`; one that
is off, `enforce_eager`, is turned on by `--enforce-eager`. `tinyvllm bench` and `tinyvllm
serve` take them; `engine_flags_from` writes them back for a server the bench starts.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import MISSING, fields

from tinyvllm.config import EngineConfig

# Engine arguments the bench does not offer: the engine's own sampling seed (the bench decodes
# greedily; --seed seeds the workload) and log switches.
_SKIPPED_ENGINE_ARGS = ("seed", "disable_log_stats")

ENGINE_ARG_HELP = {
    "dtype": "float32, bfloat16, float16 or auto (float32 on a CPU, its products of many rows in bfloat16 "
              "where the CPU computes it; bfloat16 on a GPU)",
    "device": "'cpu', 'cuda[:N]' or 'auto' (default)",
    "max_model_len": "context length limit (default: the model's)",
    "tokenizer": "a folder whose tokenizer.json and tokenizer_config.json replace the model's (a GGUF "
                 "file's vocabulary, a folder without one)",
    "block_size": "tokens per KV-cache block (phase 2 on; default 16)",
    "check_kernels": "checked mode: each step's block ids, slots and rows checked before a C kernel "
                     "indexes them, a bad batch refused with an error (phase 2 on; default: on a "
                     "CPU, $TINYVLLM_CHECK_KERNELS=0/1 when set); --no-check-kernels turns it off",
    "num_kv_blocks": "KV-cache blocks in the pool, exactly (phase 2 on)",
    "kv_cache_memory": "bytes for the KV cache (phase 2 on)",
    "gpu_memory_utilization": "fraction of GPU memory for weights and KV cache (phase 2 on)",
    "max_num_seqs": "most sequences running at once (phase 2 on; default 256); "
                    "also --vs hf's batch size unless --hf-batch-size is given",
    "max_num_batched_tokens": "most tokens one step may run (phase 3 on)",
    "enable_chunked_prefill": "turn off chunked prefill (phase 3 on)",
    "enable_prefix_caching": "turn off prefix caching (phase 3 on)",
    "batch_invariant": "every output in one fixed order: a request's tokens do not depend on its "
                       "batch or on preemption (phase 3 on; a CPU, float32)",
    "attention_backend": "auto (default), triton or torch (phase 4 on)",
    "quantization": "weight quantization: int8 or int4 (phase 5 on)",
    "quantization_group_size": "input columns per int4 scale: 32, 64 or 128 (default: 128 where it divides every layer's input size, else 32; phase 5 on)",
    "kv_cache_dtype": "KV-cache dtype: auto (default), int8 or fp8 (phase 5 on)",
    "speculative_config": "speculative decoding, as JSON, e.g. "
                          "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4}' (phase 6 on)",
    "enforce_eager": "no CUDA graphs or compiled steps (phase 7)",
    "cudagraph_capture_sizes": "batch-size buckets of the captured decode step, e.g. 1 2 4 8 (phase 7)",
    "nnodes": "hosts the tensor-parallel ranks run on (phase 8; default 1)",
    "node_rank": "this host's place among --nnodes (0 runs the engine; the others run only "
                 "their ranks: tinyvllm serve ... --node-rank N --headless)",
    "master_addr": "node 0's address, where every host's ranks meet (phase 8 with --nnodes > 1)",
    "master_port": "the port on --master-addr where the ranks meet (default 29501)",
    "async_scheduling": "the engine core schedules the next step while this one's model runs "
                        "(phase 9; default: on a GPU, not on a CPU, where it measured as a loss); "
                        "--no-async-scheduling steps one at a time",
    "kv_transfer_config": "a KV connector, as JSON, e.g. '{\"kv_connector\": \"OffloadingConnector\", "
                          "\"kv_role\": \"kv_both\", \"kv_connector_extra_config\": {\"cpu_bytes_to_use\": "
                          "1073741824}}' (phase 10)",
    "compilation_mode": "1: compile the decode step with torch.compile on a CPU before the first "
                        "request (phase 7; the first start compiles for a minute, later ones read "
                        "$TINYVLLM_CACHE/inductor); 0: eager; default: on a CPU, once the engine has "
                        "run 512 decode steps, compiled in the background while it serves eagerly",
}


def engine_flag(name: str, default) -> tuple[str, dict]:
    """The flag and argparse keywords for one EngineConfig field."""
    if isinstance(default, bool):
        if default:  # on by default: --no-<name>, dropping vLLM's 'enable_' prefix
            flag = "--no-" + name.removeprefix("enable_").replace("_", "-")
            return flag, dict(action="store_false")
        return "--" + name.replace("_", "-"), dict(action="store_true")
    return "--" + name.replace("_", "-"), {}


def _field_type(annotation: str):
    """int, float, JSON or str, from the field's annotation ('int | None', 'dict | None', ...)."""
    for word, kind in (("int", int), ("float", float), ("dict", json.loads)):
        if word in str(annotation):
            return kind
    return str


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """A flag per EngineConfig field. Unset flags stay out of the namespace (argparse.SUPPRESS),
    so the engine's own defaults apply."""
    g = parser.add_argument_group("engine arguments (passed to every phase that acts on them)")
    for f in fields(EngineConfig):
        if f.name in _SKIPPED_ENGINE_ARGS:
            continue
        default = f.default if f.default is not MISSING else None
        flag, kwargs = engine_flag(f.name, default)
        if "action" not in kwargs and str(f.type) == "bool | None":   # --name, and --no-name
            kwargs.update(action=argparse.BooleanOptionalAction)
        elif "action" not in kwargs and "list" in str(f.type):
            kwargs.update(type=int, nargs="+", metavar="N")
        elif "action" not in kwargs:
            kwargs.update(type=_field_type(f.type), metavar=f.name.upper())
        help_text = ENGINE_ARG_HELP.get(f.name, f"engine argument {f.name}")
        g.add_argument(flag, dest=f.name, default=argparse.SUPPRESS, help=help_text, **kwargs)


def engine_args_from(args: argparse.Namespace) -> dict:
    """The engine arguments given on the command line (and only those)."""
    return {f.name: getattr(args, f.name) for f in fields(EngineConfig)
            if f.name not in _SKIPPED_ENGINE_ARGS and hasattr(args, f.name)}


def engine_flags_from(engine_args: dict) -> list[str]:
    """Engine arguments back into `tinyvllm serve` flags (the spellings add_engine_args makes)."""
    flags = []
    for name, value in engine_args.items():
        if isinstance(value, bool):  # only a flip from the default is given: its flag
            flags.append(engine_flag(name, not value)[0])
            continue
        flag = engine_flag(name, None)[0]
        if isinstance(value, list):
            flags += [flag, *map(str, value)]
        elif isinstance(value, dict):
            flags += [flag, json.dumps(value)]
        else:
            flags += [flag, str(value)]
    return flags
