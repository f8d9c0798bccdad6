"""`tinyvllm bench kernels`: each attention kernel alone, against the machine's copy bandwidth.

    tinyvllm bench kernels                                  # the default model's heads, its dtype
    tinyvllm bench kernels --batch-sizes 1 8 64 --context-lens 512 4096 --prefill-len 512 --json k.json

Decoding reads every cached K and V of every sequence once per layer, and does little arithmetic
with them, so a decode attention kernel is as fast as it moves bytes: its time is compared with
the machine's best copy (`measure_limits`, measured in the same run). For each case (decode
batches of B sequences at context L, prefills of whole prompts, and the last chunk of a long
prompt after the rest cached, as the CPU engine prefills it), with the model's query heads,
KV heads and head_dim, one layer:

- `phase3`: phase 3's attention (on a CUDA GPU this is SDPA over the gathered blocks);
- `cpu`: phase 4's CPU path (cpu_attention.c for the decodes, and for the prefill where it runs);
- `sdpa`: the same path with every prefill chunk through PyTorch's fused SDPA (prefill rows only);
- `cpu_bf16`: the same path with the C prefill kernel's products in bfloat16, what `dtype="auto"`
  runs where it multiplies in bfloat16 (prefill rows only, where that kernel runs);
- `triton`: phase 4's `unified_attention` (CUDA only: on a CPU Triton runs only in its
  interpreter, far too slow to time, so the row is skipped with that reason).

bytes = the K/V bytes the sequences hold plus q and the output, read or written once; achieved
bytes/s = bytes / best time of `--repeat` calls; `of copy` = that over the measured bandwidth.

The phases' kernels are imported inside the functions that time them: `tinyvllm bench` (and the
`tinyvllm` command, which builds its parser) must start without loading four phases and, worse,
Triton, whose import decides once whether its kernels compile or run in the interpreter.
"""

from __future__ import annotations

import argparse
import json
from functools import partial

import torch

DEFAULT_BATCH_SIZES = (1, 8, 64)
DEFAULT_CONTEXT_LENS = (512, 4096)
DEFAULT_PREFILL_LENS = (512,)


def add_kernel_args(parser: argparse.ArgumentParser) -> None:
    """The flags of `tinyvllm bench kernels` (the other workloads ignore them)."""
    k = parser.add_argument_group("kernels (tinyvllm bench kernels only)")
    k.add_argument("--batch-sizes", type=int, nargs="+", default=list(DEFAULT_BATCH_SIZES), metavar="B",
                   help="decode batch sizes (default 1 8 64)")
    k.add_argument("--context-lens", type=int, nargs="+", default=list(DEFAULT_CONTEXT_LENS), metavar="L",
                   help="decode context lengths (default 512 4096)")
    k.add_argument("--prefill-len", type=int, nargs="+", default=list(DEFAULT_PREFILL_LENS), metavar="T",
                   help="prompt lengths of the prefill cases (default 512); a prompt longer than a CPU "
                        "step (512 tokens) also gives the case of its last chunk, after the rest cached")


def _paged_inputs(batch: int, context: int, query_len: int, heads: int, kv_heads: int, head_dim: int,
                  block_size: int, dtype: torch.dtype, device: torch.device):
    """q, k, v (the new tokens), a cache holding `batch` sequences of `context` tokens in shuffled
    blocks (the new tokens already written), and the step's AttentionMetadata."""
    from phases.p02_paged_kv import AttentionMetadata

    per_seq = -(-context // block_size)
    order = torch.randperm(batch * per_seq).tolist()
    tables = [order[b * per_seq:(b + 1) * per_seq] for b in range(batch)]
    slots = [t[p // block_size] * block_size + p % block_size
             for t in tables for p in range(context - query_len, context)]
    meta = AttentionMetadata.build(slots, [query_len] * batch, [context] * batch, tables, device)
    k_cache = torch.randn(batch * per_seq, block_size, kv_heads, head_dim, dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    n = batch * query_len
    q = torch.randn(n, heads, head_dim, dtype=dtype, device=device)
    k = k_cache.view(-1, kv_heads, head_dim)[meta.slot_mapping]
    v = v_cache.view(-1, kv_heads, head_dim)[meta.slot_mapping]
    return q, k, v, k_cache, v_cache, meta


def _kernels(device: torch.device) -> tuple[dict, str | None]:
    """name -> make(meta) -> fn(q, k, v, k_cache, v_cache): the per-step preparation (Triton's
    int32 metadata) is made once, outside the timing, as the engine makes it once for all layers.
    Also why Triton is left out (None: it is in)."""
    from phases.p02_paged_kv import paged_attention
    from phases.p04_triton_kernels import TritonPagedAttention, cpu_paged_attention, prefill_paths

    makers = {"phase3": lambda meta: lambda q, k, v, kc, vc: paged_attention(q, kc, vc, meta),
              "cpu": lambda meta: lambda q, k, v, kc, vc: cpu_paged_attention(q, k, v, kc, vc, meta)}
    if device.type != "cuda":
        makers["sdpa"] = lambda meta: lambda q, k, v, kc, vc: cpu_paged_attention(q, k, v, kc, vc, meta,
                                                                                 c_prefill=False)
        if prefill_paths()[1]:   # where a prompt's attention may multiply in bfloat16
            makers["cpu_bf16"] = lambda meta: lambda q, k, v, kc, vc: cpu_paged_attention(q, k, v, kc, vc, meta,
                                                                                         bf16_prefill=True)
        return makers, ("Triton compiles for CUDA GPUs only; on a CPU it runs in its interpreter "
                        "(TRITON_INTERPRET=1), far too slow to time: see test_p04_kernels.py for its checks")
    from phases.p04_triton_kernels.triton_attention import unified_attention

    def make_triton(meta):
        t = TritonPagedAttention(None, meta)  # only its int32 metadata: the cache comes as arguments
        return lambda q, k, v, kc, vc: unified_attention(q, kc, vc, torch.empty_like(q), t.query_start_loc,
                                                         t.seq_lens, t.block_tables, t.max_query_len,
                                                         t.max_seq_len)

    makers["triton"] = make_triton
    return makers, None


@torch.inference_mode()
def run_kernels(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                block_size: int = 16, batch_sizes=DEFAULT_BATCH_SIZES, context_lens=DEFAULT_CONTEXT_LENS,
                prefill_lens=DEFAULT_PREFILL_LENS, repeat: int = 5, limits=None) -> dict:
    """Time every kernel on every case; returns the report (rows, limits, machine)."""
    from tinyvllm.platform import DEFAULT_MAX_NUM_BATCHED_TOKENS

    from .machine import _best_time, machine_info, measure_limits

    limits = limits or measure_limits(device, dtype)
    fns, triton_skip = _kernels(device)
    elem = torch.empty((), dtype=dtype).element_size()
    cases = [("decode", b, L, 1) for L in context_lens for b in batch_sizes]
    step = DEFAULT_MAX_NUM_BATCHED_TOKENS["cpu"]   # a CPU step's tokens: a longer prompt's chunks
    for t in prefill_lens:
        cases += [("prefill", 1, t, t)] + ([("chunk", 1, t, step)] if t > step and device.type == "cpu" else [])
    rows = []
    for kind, batch, context, qlen in cases:
        q, k, v, kc, vc, meta = _paged_inputs(batch, context, qlen, heads, kv_heads, head_dim,
                                              block_size, dtype, device)
        nbytes = (2 * batch * context * kv_heads * head_dim + 2 * q.numel()) * elem
        base = None
        for name, make in fns.items():
            if name in ("sdpa", "cpu_bf16") and kind == "decode":   # the decodes' path is cpu's
                continue
            s = _best_time(partial(make(meta), q, k, v, kc, vc), device, repeat)
            base = base or s
            rows.append(dict(case=kind, batch=batch, context=context, query_len=qlen, kernel=name,
                             seconds=s, bytes=nbytes, bytes_per_s=nbytes / s,
                             fraction_of_copy=nbytes / s / limits.memory_bandwidth,
                             speedup_vs_phase3=base / s, skipped=None))
        if triton_skip:
            rows.append(dict(case=kind, batch=batch, context=context, query_len=qlen, kernel="triton",
                             seconds=None, bytes=nbytes, bytes_per_s=None, fraction_of_copy=None,
                             speedup_vs_phase3=None, skipped=triton_skip))
        del q, k, v, kc, vc, meta
    return dict(benchmark="kernels", machine=machine_info(device), limits=limits.to_dict(),
                shape=dict(heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size,
                           dtype=str(dtype).removeprefix("torch.")),
                repeat=repeat, rows=rows)


def format_kernels_table(report: dict) -> str:
    from .report import cpu_name

    m, lim, s = report["machine"], report["limits"], report["shape"]
    lines = [(f"attention kernels, one layer: {s['heads']} query heads, {s['kv_heads']} KV heads, head_dim "
              f"{s['head_dim']}, block_size {s['block_size']}, {s['dtype']}; best of {report['repeat']}"),
             (f"machine: {cpu_name(m)} ({m['cores']} cores), {m.get('gpu', m['device'])}, torch {m['torch']}; "
              f"measured copy bandwidth {lim['memory_bandwidth'] / 1e9:.1f} GB/s"), ""]
    head = ["case", "seqs", "context", "kernel", "ms", "GB/s", "of copy", "vs phase3"]
    table = [head]
    for r in report["rows"]:
        if r["skipped"]:
            table.append([r["case"], str(r["batch"]), str(r["context"]), r["kernel"], "skipped", "-", "-", "-"])
            continue
        table.append([r["case"], str(r["batch"]), str(r["context"]), r["kernel"], f"{r['seconds'] * 1e3:.3f}",
                      f"{r['bytes_per_s'] / 1e9:.1f}", f"{100 * r['fraction_of_copy']:.0f}%",
                      f"{r['speedup_vs_phase3']:.2f}x"])
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    for i, row in enumerate(table):
        lines.append("  ".join(c.ljust(w) if j in (0, 3) else c.rjust(w) for j, (c, w) in enumerate(zip(row, widths))))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    reasons = sorted({r["skipped"] for r in report["rows"] if r["skipped"]})
    lines += [f"skipped: {why}" for why in reasons]
    return "\n".join(lines)


def run_kernels_command(args: argparse.Namespace, argv: list[str]) -> int:
    """`tinyvllm bench kernels`: the shapes of --model's attention, on --device, in --dtype."""
    import shlex
    import sys

    from tinyvllm.config import ModelConfig
    from tinyvllm.download import resolve_model
    from tinyvllm.platform import resolve_device, resolve_dtype

    if args.repeat < 1 or min(args.batch_sizes + args.context_lens + args.prefill_len) < 1:
        raise ValueError("--repeat, --batch-sizes, --context-lens and --prefill-len must be >= 1")
    config = ModelConfig.from_pretrained(resolve_model(args.model))
    device = resolve_device(getattr(args, "device", "auto"))
    dtype = resolve_dtype(getattr(args, "dtype", "auto"), device)
    report = run_kernels(config.num_attention_heads, config.num_key_value_heads, config.head_dim, dtype,
                         device, getattr(args, "block_size", 16), args.batch_sizes, args.context_lens,
                         args.prefill_len, args.repeat)
    report["command"] = "tinyvllm " + shlex.join(argv)
    print(format_kernels_table(report))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.json_path}", file=sys.stderr)
    return 0
