"""The quantized KV cache in phase 4's Triton kernels, checked against the CPU path.

Used by `test_triton_kv_quant.py` as phase 4's `kernel_cases.py` is by its tests: on a CPU in a
subprocess with TRITON_INTERPRET=1 (`python -m phases.p05_quantization.tools.kv_quant_cases` prints one
JSON object, {case: {"max_err": ..., "tol": ...}}), on a CUDA GPU compiled in the test process,
and without a GPU compiled ahead of time for one (`--compile 90`); `--engine MODEL_DIR FMT [ARGS]` runs
phase 5's engine with attention_backend="triton", kv_cache_dtype=FMT and the engine arguments
of the JSON object ARGS (greedy tokens).

- Attention cases: phase 4's batches (decodes at the block edges, a whole prompt, a chunk after
  cached tokens; or decodes with split-KV; two in a sliding window) over a quantized cache whose
  every slot holds random quantized values. The Triton path (`reshape_and_cache_quantized`, then
  `unified_attention_quantized`) against the CPU path over the same cache
  (`QuantizedPagedAttention` with phase 4's `cpu_paged_attention`, in float32): the written
  bytes and scales must be equal, the outputs within phase 4's float tolerances.
- Write cases: padded rows (slot -1), a head size that is not a power of two, and values where a
  rounding can go wrong (ties, an all-zero vector, -0.0, a carry into the next binade): the bytes
  and scales stored must be exactly `quantize_kv`'s, every other slot unchanged.
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import torch

from phases.p04_triton_kernels.tools.kernel_cases import DECODES, MIXED, TOLERANCE, case_inputs

from ..kv_quant import QuantizedKVCache, QuantizedPagedAttention, quantize_kv

CASES = {  # name: block size, head_dim, query heads per KV head, KV heads, batch, dtype, splits
    "int8-bs16-d64-gqa2-mixed-f32": dict(fmt="int8", bs=16, d=64, group=2, kvh=2, batch=MIXED,
                                         dtype="float32", splits=1),
    "fp8-bs16-d64-gqa2-mixed-f32": dict(fmt="fp8", bs=16, d=64, group=2, kvh=2, batch=MIXED,
                                        dtype="float32", splits=1),
    "int8-bs16-d80-gqa3-decode-split2-f16": dict(fmt="int8", bs=16, d=80, group=3, kvh=1, batch=DECODES,
                                                 dtype="float16", splits=2),
    "fp8-bs16-d80-gqa3-mixed-f16": dict(fmt="fp8", bs=16, d=80, group=3, kvh=1, batch=MIXED,
                                        dtype="float16", splits=1),
    # a sliding window (keys p - window + 1 .. p): across block edges, in prefill chunks and split decodes
    "int8-bs16-d64-gqa2-mixed-window20-f32": dict(fmt="int8", bs=16, d=64, group=2, kvh=2, batch=MIXED,
                                                  dtype="float32", splits=1, window=20),
    "fp8-bs16-d64-gqa1-decode-split4-window37-f32": dict(fmt="fp8", bs=16, d=64, group=1, kvh=2, batch=DECODES,
                                                         dtype="float32", splits=4, window=37),
}
WRITE_CASES = {
    "write-int8-d80-f32": dict(fmt="int8", d=80, kvh=3, dtype="float32"),
    "write-fp8-d80-f32": dict(fmt="fp8", d=80, kvh=3, dtype="float32"),
    "write-int8-d64-f16": dict(fmt="int8", d=64, kvh=2, dtype="float16"),
    "write-fp8-d64-f16": dict(fmt="fp8", d=64, kvh=2, dtype="float16"),
}
# Values whose rounding is decided by a tie or a carry, with max |x| = the format's largest level
# (so the scale is exactly 1.0): int8 levels are integers; e4m3's are 2 apart in [16, 32), 1 in
# [8, 16), 2^-9 below 2^-6.
EDGES = {"int8": [127.0, 2.5, -3.5, 0.5, -0.5, 1.5, 126.5, -0.0, 1e-30],
         "fp8": [448.0, 17.0, 19.0, -17.0, 15.5, 31.0, 2.0 ** -10, 3 * 2.0 ** -10, -2.0 ** -12, -0.0, 432.0, 440.0]}


def _cache(fmt: str, num_blocks: int, bs: int, kvh: int, d: int, device: str) -> QuantizedKVCache:
    model = SimpleNamespace(num_hidden_layers=1, num_key_value_heads=kvh, head_dim=d)
    return QuantizedKVCache(model, num_blocks, bs, torch.float32, torch.device(device), fmt)


def run_case(name: str, device: str = "cpu", dtype: str | None = None) -> dict:
    from ..triton_kv_quant import reshape_and_cache_quantized, unified_attention_quantized

    c = CASES[name]
    dtype = dtype or c["dtype"]
    meta, (k_cache, v_cache), (q, k, v), launch = case_inputs(c, device, getattr(torch, dtype))
    ref = _cache(c["fmt"], k_cache.shape[0], c["bs"], c["kvh"], c["d"], device)
    ref.windows = (c.get("window"),)                                        # the reference's window too
    every_slot = torch.arange(k_cache.shape[0] * c["bs"], device=device)
    ref.write(0, every_slot, k_cache.flatten(0, 1), v_cache.flatten(0, 1))  # random, quantized
    kv, scales = ref.kv[0].clone(), ref.scales[0].clone()                   # the Triton path's copy
    reshape_and_cache_quantized(k, v, kv, scales, meta.slot_mapping)
    out = torch.full_like(q, float("nan"))
    unified_attention_quantized(q, kv, scales, out, *launch, num_kv_splits=c["splits"], window=c.get("window"))

    from phases.p04_triton_kernels import cpu_paged_attention
    expect = QuantizedPagedAttention(ref, meta, cpu_paged_attention)(0, q.float(), k.float(), v.float())
    written = bool(torch.equal(kv, ref.kv[0]) and torch.equal(scales, ref.scales[0]))
    return dict(max_err=(out.float() - expect).abs().max().item(), tol=TOLERANCE[(device, dtype)],
                cache_equal=written)


def run_write_case(name: str, device: str = "cpu", dtype: str | None = None) -> dict:
    from ..triton_kv_quant import reshape_and_cache_quantized

    c = WRITE_CASES[name]
    dt = getattr(torch, dtype or c["dtype"])
    g = torch.Generator().manual_seed(2)
    num_blocks, bs, kvh, d = 5, 16, c["kvh"], c["d"]
    cache = _cache(c["fmt"], num_blocks, bs, kvh, d, device)
    cache.kv.copy_(torch.randint(-100, 100, cache.kv.shape, generator=g).to(cache.kv.dtype))  # not zeros:
    cache.scales.copy_(torch.rand(cache.scales.shape, generator=g))                           # must stay
    slots = [3 * bs + 1, -1, 0, bs - 1, -1, 4 * bs + bs - 1, 2 * bs]
    k = torch.randn(len(slots), kvh, d, generator=g) * 3
    v = torch.randn(len(slots), kvh, d, generator=g)
    edges = torch.tensor(EDGES[c["fmt"]])
    k[0, 0, : len(edges)], k[0, 0, len(edges):] = edges, 0.0  # ties and carries, scale 1.0
    v[2, -1] = 0.0                                            # an all-zero vector: the 1e-8 floor
    k, v = k.to(dt).to(device), v.to(dt).to(device)
    expect_kv, expect_scales = cache.kv[0].clone(), cache.scales[0].clone()
    real = [i for i, s in enumerate(slots) if s >= 0]
    for i, x in ((0, k), (1, v)):
        qx, sx = quantize_kv(x[real], c["fmt"])
        expect_kv[i].view(-1, kvh, d)[[slots[j] for j in real]] = qx.view(cache.kv.dtype)
        expect_scales[i].view(-1, kvh)[[slots[j] for j in real]] = sx
    reshape_and_cache_quantized(k, v, cache.kv[0], cache.scales[0], torch.tensor(slots, device=device))
    wrong_bytes = (cache.kv[0] != expect_kv).sum().item()
    wrong_scales = (cache.scales[0] != expect_scales).sum().item()
    return dict(max_err=wrong_bytes + wrong_scales, tol=0)  # exact: no byte or scale may differ


def compile_for_cuda(capability: int = 90) -> list[str]:
    """Compile phase 4's kernels with the quantized pair, ahead of time for a CUDA GPU (90: an
    H100; fp8 needs 89 or more), int8 and fp8, for bfloat16, float16 and float32 queries."""
    import triton

    from phases.p04_triton_kernels import triton_attention as ta
    from phases.p04_triton_kernels.tools.kernel_cases import compile_kernel

    from .. import triton_kv_quant as tq

    done = []
    for fmt, dt, splits, group in [("i8", "bf16", 1, 3), ("u8", "bf16", 4, 1), ("u8", "fp16", 1, 8),
                                   ("i8", "fp32", 2, 4)]:
        block_m = max(16, triton.next_power_of_2(group))
        types = {"out_ptr": "*" + dt, "q_ptr": "*" + dt, "k_cache_ptr": "*" + fmt, "v_cache_ptr": "*" + fmt,
                 "k_side_ptr": "*fp32", "v_side_ptr": "*fp32", "block_tables_ptr": "*i32",
                 "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32", "part_out_ptr": "*fp32",
                 "part_lse_ptr": "*fp32", "qk_scale": "fp32"}
        done.append(compile_kernel(ta.unified_attention_kernel, types,
                                   dict(GROUP=group, BLOCK_Q=block_m // group, BLOCK_M=block_m, BLOCK_SIZE=16,
                                        HEAD_P2=64, NUM_SPLITS=splits, IEEE_DOT=dt == "fp32",
                                        LOAD_KV=tq._load_quantized_kv_block), capability))
        types = {"k_ptr": "*" + dt, "v_ptr": "*" + dt, "k_cache_ptr": "*" + fmt, "v_cache_ptr": "*" + fmt,
                 "k_side_ptr": "*fp32", "v_side_ptr": "*fp32", "slot_mapping_ptr": "*i64"}
        done.append(compile_kernel(ta.reshape_and_cache_kernel, types,
                                   dict(BLOCK_SIZE=16, KVH_P2=4, HEAD_P2=128, STORE_KV=tq._store_quantized_kv),
                                   capability))
    return done


def main(argv: list[str]) -> None:
    if argv and argv[0] == "--compile":  # --compile CAPABILITY (without the interpreter)
        print(json.dumps(compile_for_cuda(int(argv[1]))))
        return
    if argv and argv[0] == "--engine":  # --engine MODEL_DIR KV_CACHE_DTYPE [ENGINE_ARGS_JSON]: phase 5
        from phases.p04_triton_kernels.tools.kernel_cases import engine_tokens
        extra = json.loads(argv[3]) if len(argv) > 3 else {}
        print(json.dumps(engine_tokens(argv[1], 5, sampled=False, attention_backend="triton",
                                       kv_cache_dtype=argv[2], **extra)))
        return
    results = {name: run_case(name) for name in CASES}
    results.update({name: run_write_case(name) for name in WRITE_CASES})
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])
