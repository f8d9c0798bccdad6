"""The kernel checks: each Triton kernel against phase 3's PyTorch attention, on shapes chosen to
hit the edges. Used by `test_p04_kernels.py` in two ways:

- on a CPU, in a subprocess with TRITON_INTERPRET=1 (so the interpreter never enters the test
  process): `TRITON_INTERPRET=1 python -m phases.p04_triton_kernels.tools.kernel_cases` runs every
  case and prints one JSON object, {case: {"max_err": ..., "tol": ...}};
- on a CUDA GPU, compiled, in the test process (`run_case(name, "cuda", dtype)`);
- without a GPU, compiled ahead of time for one (`python -m ... --compile 90`), which checks that
  the kernels *compile* for CUDA, not what they compute there.

Tolerances (absolute, on outputs of magnitude <= ~3, from unit-normal inputs). The reference is
phase 2's `paged_attention` in float32 on the *same* (already rounded) inputs, so the error is
only the kernel's own arithmetic:
- float32: 1e-4. The online softmax sums in another order than the reference (block by block,
  rescaled): a few float32 ulps (1.2e-7 relative) per step, far below 1e-4. (On a GPU the
  kernel asks `tl.dot` for IEEE float32 products, not its default TF32.)
- float16: 1e-2. The probabilities are rounded to float16 (2^-11 relative) before the P.V
  product, and the output once more when stored: a few 1e-3 at these magnitudes.
- bfloat16 (GPU only: the interpreter multiplies bfloat16 as raw bits): 4e-2, for its 8-bit
  mantissa (2^-8 relative per rounding).
"""

from __future__ import annotations

import json
import sys

import torch

from phases.p02_paged_kv import AttentionMetadata, paged_attention

# A batch mixing every kind of row, as (tokens in the cache after the step, queries this step):
# decodes at context 1, bs-1, bs, bs+1 and several blocks, a whole prompt, and a chunk with
# cached tokens before it ("bs" is replaced by the case's block size).
MIXED = [("1", 1), ("bs-1", 1), ("bs", 1), ("bs+1", 1), ("3*bs+5", 1), ("bs+3", "bs+3"),
         ("2*bs+9", 8)]
DECODES = [("1", 1), ("bs-1", 1), ("bs+1", 1), ("5*bs+3", 1)]

# name: block size, head_dim, query heads per KV head (GQA), KV heads, batch, dtype, splits
CASES = {
    "bs16-d64-gqa1-mixed-f32": dict(bs=16, d=64, group=1, kvh=2, batch=MIXED, dtype="float32", splits=1),
    "bs16-d64-gqa1-decode-split4-f32": dict(bs=16, d=64, group=1, kvh=2, batch=DECODES, dtype="float32", splits=4),
    "bs32-d128-gqa4-mixed-f32": dict(bs=32, d=128, group=4, kvh=2, batch=MIXED, dtype="float32", splits=1),
    "bs32-d96-gqa3-mixed-split2-f32": dict(bs=32, d=96, group=3, kvh=2, batch=MIXED, dtype="float32", splits=2),
    "bs16-d80-gqa8-mixed-f16": dict(bs=16, d=80, group=8, kvh=1, batch=MIXED, dtype="float16", splits=1),
    "bs16-d128-gqa4-decode-split4-f16": dict(bs=16, d=128, group=4, kvh=2, batch=DECODES, dtype="float16", splits=4),
    "bs32-d64-gqa3-mixed-f16": dict(bs=32, d=64, group=3, kvh=1, batch=MIXED, dtype="float16", splits=1),
    # split-KV chosen by the rule (None): one long decode has too few programs to fill the machine
    "bs16-d64-gqa4-one-long-decode-auto-split-f32": dict(bs=16, d=64, group=4, kvh=1, batch=[("20*bs+7", 1)],
                                                         dtype="float32", splits=None),
    # a sliding window (keys p - window + 1 .. p): across block edges, in prefill chunks and split decodes
    "bs16-d64-gqa2-mixed-window20-f32": dict(bs=16, d=64, group=2, kvh=2, batch=MIXED, dtype="float32", splits=1,
                                            window=20),
    "bs16-d64-gqa1-decode-split4-window37-f32": dict(bs=16, d=64, group=1, kvh=2, batch=DECODES, dtype="float32",
                                                    splits=4, window=37),
}
CACHE_CASES = {
    "cache-bs16-d80-f32": dict(bs=16, d=80, kvh=3, dtype="float32"),
    "cache-bs32-d64-f16": dict(bs=32, d=64, kvh=2, dtype="float16"),
}
# split-KV's merge alone: (segments, head_dim, segments with no keys, an offset added to every
# score: near 100, exp(lse) overflows float32 unless the largest lse is subtracted first)
MERGE_CASES = {
    "merge-s4-d24": dict(splits=4, d=24, empty=(), offset=0.0),
    "merge-s2-d64-an-empty-segment": dict(splits=2, d=64, empty=(1,), offset=0.0),
    "merge-s8-d32-empty-segments-scores-near-100": dict(splits=8, d=32, empty=(0, 5), offset=100.0),
}
TOLERANCE = {("cpu", "float32"): 1e-4, ("cuda", "float32"): 1e-4, ("cpu", "float16"): 1e-2,
             ("cuda", "float16"): 1e-2, ("cuda", "bfloat16"): 4e-2}


def _length(expr, bs: int) -> int:
    return int(eval(str(expr), {"bs": bs}))  # our own table's expressions: "bs+1", "3*bs+5"


def make_batch(batch: list, bs: int, kvh: int, d: int, dtype: torch.dtype, device: str, seed: int = 0):
    """A paged cache holding random K/V for each sequence in scattered blocks (and random values in
    the unused slots, which must not leak in), the step's q/k/v, and its AttentionMetadata."""
    g = torch.Generator().manual_seed(seed)
    lens = [(_length(total, bs), _length(q, bs)) for total, q in batch]
    num_blocks = sum(-(-L // bs) for L, _ in lens) + 3
    free = torch.randperm(num_blocks, generator=g).tolist()  # scattered, out of order
    tables, slots = [], []
    for total, qlen in lens:
        table = [free.pop() for _ in range(-(-total // bs))]
        tables.append(table)
        slots += [table[p // bs] * bs + p % bs for p in range(total - qlen, total)]
    meta = AttentionMetadata.build(slots, [q for _, q in lens], [t for t, _ in lens], tables,
                                   torch.device(device))
    k_cache = torch.randn(num_blocks, bs, kvh, d, generator=g).to(dtype).to(device)
    v_cache = torch.randn(num_blocks, bs, kvh, d, generator=g).to(dtype).to(device)
    return meta, k_cache, v_cache, g


def case_inputs(c: dict, device: str, dt: torch.dtype):
    """An attention case's step: its metadata, the paged (k_cache, v_cache) of `make_batch`, the
    step's (q, k, v), and the launch arguments `unified_attention` takes after (q, caches, out):
    (query_start_loc, seq_lens, block_tables, max_query_len, max_seq_len)."""
    meta, k_cache, v_cache, g = make_batch(c["batch"], c["bs"], c["kvh"], c["d"], dt, device)
    n, h = len(meta.slot_mapping), c["group"] * c["kvh"]
    q, k, v = (torch.randn(n, heads, c["d"], generator=g).to(dt).to(device) for heads in (h, c["kvh"], c["kvh"]))
    starts = meta.query_start_loc
    max_q = max(b - a for a, b in zip(starts, starts[1:]))
    launch = (torch.tensor(starts, dtype=torch.int32, device=device),
              torch.tensor(meta.seq_lens, dtype=torch.int32, device=device),
              meta.block_tables.to(torch.int32), max_q, max(meta.seq_lens))
    return meta, (k_cache, v_cache), (q, k, v), launch


def run_in_subprocess(module: str, *args: str, interpret: bool = True) -> dict:
    """`python -m module *args` with TRITON_INTERPRET=1 (or, interpret=False, without it), from
    the repository root: the interpreter has to be switched on before Triton is imported, so the
    cases run in a process of their own and print one JSON object as their last line."""
    import os
    import subprocess
    from pathlib import Path

    repo = Path(__file__).resolve().parents[3]   # tools/ -> the phase -> phases/ -> the repository
    env = dict(os.environ, PYTHONPATH=str(repo))
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, "-m", module, *args], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_case(name: str, device: str = "cpu", dtype: str | None = None) -> dict:
    """Run one attention case: write the step's K/V with `reshape_and_cache`, attend with
    `unified_attention`, compare with phase 2's `paged_attention` in float32."""
    from ..triton_attention import (
        choose_num_kv_splits,
        num_sms,
        reshape_and_cache,
        unified_attention,
    )

    c = CASES[name]
    dtype = dtype or c["dtype"]
    meta, (k_cache, v_cache), (q, k, v), launch = case_inputs(c, device, getattr(torch, dtype))
    reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping)
    out = torch.full_like(q, float("nan"))
    unified_attention(q, k_cache, v_cache, out, *launch, num_kv_splits=c["splits"], window=c.get("window"))
    max_q = launch[3]
    ref = paged_attention(q.float(), k_cache.float(), v_cache.float(), meta, c.get("window"))
    chosen = c["splits"] or choose_num_kv_splits(max_q, len(meta.seq_lens), c["kvh"], max(meta.seq_lens),
                                                 c["bs"], num_sms(torch.device(device)))
    err = (out.float() - ref).abs().nan_to_num(float("inf"))
    starts = meta.query_start_loc
    seqs = [(meta.seq_lens[b], starts[b + 1] - starts[b], err[starts[b]: starts[b + 1]].max().item())
            for b in range(len(meta.seq_lens))]   # (keys, queries, largest error): where it went wrong
    return dict(max_err=err.max().item(), tol=TOLERANCE[(device, dtype)], num_kv_splits=chosen, bs=c["bs"], seqs=seqs)


def run_cache_case(name: str, device: str = "cpu", dtype: str | None = None) -> dict:
    """`reshape_and_cache` with padded rows (slot -1): the written slots hold exactly the new K/V,
    every other slot is unchanged."""
    from ..triton_attention import reshape_and_cache

    c = CACHE_CASES[name]
    dt = getattr(torch, dtype or c["dtype"])
    g = torch.Generator().manual_seed(1)
    num_blocks, bs = 6, c["bs"]
    k_cache = torch.randn(num_blocks, bs, c["kvh"], c["d"], generator=g).to(dt).to(device)
    v_cache = torch.randn(num_blocks, bs, c["kvh"], c["d"], generator=g).to(dt).to(device)
    slots = [3 * bs + 1, -1, 0, bs - 1, -1, 5 * bs + bs - 1, 2 * bs]
    k = torch.randn(len(slots), c["kvh"], c["d"], generator=g).to(dt).to(device)
    v = torch.randn(len(slots), c["kvh"], c["d"], generator=g).to(dt).to(device)
    expect_k, expect_v = k_cache.clone(), v_cache.clone()
    real = [i for i, s in enumerate(slots) if s >= 0]
    expect_k.view(-1, c["kvh"], c["d"])[[slots[i] for i in real]] = k[real]
    expect_v.view(-1, c["kvh"], c["d"])[[slots[i] for i in real]] = v[real]
    reshape_and_cache(k, v, k_cache, v_cache, torch.tensor(slots, device=device))
    err = max((k_cache.float() - expect_k.float()).abs().max().item(),
              (v_cache.float() - expect_v.float()).abs().max().item())
    return dict(max_err=err, tol=0.0)  # a copy: exact


def run_merge_case(name: str, device: str = "cpu") -> dict:
    """`merge_attn_states` on partial results made here: each segment's softmax-normalized output
    and its log-sum-exp (-inf and zeros for a segment with no keys, as the kernel stores them),
    against attention over all the keys at once."""
    from ..triton_attention import merge_attn_states

    c = MERGE_CASES[name]
    g = torch.Generator().manual_seed(2)
    n, h, d, splits, keys = 3, 2, c["d"], c["splits"], 5
    head_p2 = 1 << (d - 1).bit_length()
    scores = torch.randn(n, h, splits, keys, generator=g) * 3 + c["offset"]   # (N, H, S, keys)
    values = torch.randn(n, h, splits, keys, d, generator=g)
    scores[:, :, list(c["empty"])] = float("-inf")                            # no keys there
    lse = torch.logsumexp(scores, dim=-1)                                       # (N, H, S)
    weights = torch.nan_to_num(torch.softmax(scores, dim=-1))                   # an empty one: 0
    part_out = torch.zeros(n, h, splits, head_p2)
    part_out[..., :d] = (weights[..., None] * values).sum(-2)                   # (N, H, S, d)
    ref = (torch.softmax(scores.flatten(2), dim=-1)[..., None] * values.flatten(2, 3)).sum(-2)
    out = torch.full((n, h, d), float("nan"), device=device)
    merge_attn_states(out, part_out.to(device), lse.to(device))
    # what common mistakes give: the weighted sum not divided by the sum of the weights, the
    # weights exp(lse) without the largest subtracted, every segment weighed the same
    w = torch.exp(lse - lse.amax(-1, keepdim=True))
    mistakes = {"not divided by the sum of the weights": (w[..., None] * part_out[..., :d]).sum(-2),
                "weighed by exp(lse) with no max subtracted (it overflows)":
                    (torch.exp(lse)[..., None] * part_out[..., :d]).sum(-2) / torch.exp(lse).sum(-1)[..., None],
                "every segment weighed the same": part_out[..., :d].mean(-2)}
    like = next((why for why, x in mistakes.items() if torch.allclose(out.cpu(), x, atol=1e-5, equal_nan=True)), "")
    return dict(max_err=(out.cpu() - ref).abs().nan_to_num(float("inf")).max().item(), tol=1e-5, like=like)


def engine_tokens(model_dir: str, phase: int, sampled: bool = True, **engine_args) -> dict:
    """Greedy tokens and (unless sampled=False) seeded samples of one phase on a tiny model, with
    chunked prefill and a prefix-cache hit (chunks with cached tokens before them) next to decodes."""
    from tinyvllm import LLM, SamplingParams

    llm = LLM(model_dir, phase=phase, max_num_batched_tokens=24, **engine_args)
    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 250 + 3 for j in range(n)]}
               for i, n in enumerate([5, 40, 17, 33])]
    prompts.append({"prompt_token_ids": prompts[1]["prompt_token_ids"][:32] + [9, 8, 7]})  # shares 2 blocks
    greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    samples = llm.generate(prompts, [SamplingParams(temperature=0.9, top_p=0.95, seed=50 + i, max_tokens=6,
                                                    ignore_eos=True) for i in range(len(prompts))],
                           use_tqdm=False) if sampled else []
    from phases.p04_triton_kernels import attention_backend

    return dict(backend=attention_backend(llm.llm_engine.setup) if phase >= 4 else "torch",
                greedy=[o.outputs[0].token_ids for o in greedy],
                sampled=[o.outputs[0].token_ids for o in samples])


def compile_for_cuda(capability: int = 90) -> list[str]:
    """Compile every kernel ahead of time for a CUDA GPU of this compute capability (90: H100), in
    bfloat16, float16 and float32, with and without split-KV: no GPU needed, only Triton's
    compiler. It catches what the interpreter lets through (a loop variable that changes type, a
    tl.dot tile below the hardware's minimum). Returns one line per compiled kernel."""
    import triton

    from .. import triton_attention as ta

    def build(fn, types: dict, consts: dict) -> str:
        return compile_kernel(fn, types, consts, capability)

    done = []
    for dt, splits, group in [("bf16", 1, 3), ("bf16", 8, 1), ("fp16", 4, 8), ("fp32", 1, 4), ("fp32", 2, 3)]:
        ptrs = {name: "*" + dt for name in ("out_ptr", "q_ptr", "k_cache_ptr", "v_cache_ptr")}
        ints = {name: "*i32" for name in ("block_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr")}
        block_m = max(16, triton.next_power_of_2(group))
        done.append(build(ta.unified_attention_kernel,
                          {**ptrs, **ints, "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "qk_scale": "fp32"},
                          dict(GROUP=group, BLOCK_Q=block_m // group, BLOCK_M=block_m, BLOCK_SIZE=16,
                               HEAD_P2=128, NUM_SPLITS=splits, IEEE_DOT=dt == "fp32",
                               LOAD_KV=ta.read_kv_block)))
        done.append(build(ta.reshape_and_cache_kernel,
                          {**{n: "*" + dt for n in ("k_ptr", "v_ptr", "k_cache_ptr", "v_cache_ptr")},
                           "slot_mapping_ptr": "*i64"},
                          dict(BLOCK_SIZE=32, KVH_P2=1, HEAD_P2=64, STORE_KV=ta.write_kv)))
    done.append(build(ta._merge_attn_states_kernel, {"out_ptr": "*bf16", "part_out_ptr": "*fp32",
                                                    "part_lse_ptr": "*fp32"}, dict(NUM_SPLITS=16, HEAD_P2=128)))
    return done


def compile_kernel(fn, types: dict, consts: dict, capability: int = 90) -> str:
    """Compile one kernel ahead of time for CUDA: `types` gives its arguments' Triton types
    ("*fp16", "fp32"; unnamed ones "i32"), `consts` its constexprs. Returns one line naming it."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {name: types.get(name, "i32") for name in fn.arg_names}
    signature.update({name: "constexpr" for name in consts})
    src = ASTSource(fn, signature, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    triton.compile(src, target=GPUTarget("cuda", capability, 32))
    return f"{fn.__name__} {consts}"


def main(argv: list[str]) -> None:
    if argv and argv[0] == "--compile":  # --compile CAPABILITY (without the interpreter)
        print(json.dumps(compile_for_cuda(int(argv[1]))))
        return
    if argv and argv[0] == "--engine":  # --engine MODEL_DIR BACKEND: phase 4 with that backend
        print(json.dumps(engine_tokens(argv[1], 4, attention_backend=argv[2])))
        return
    results = {name: run_case(name) for name in CASES}
    results.update({name: run_cache_case(name) for name in CACHE_CASES})
    results.update({name: run_merge_case(name) for name in MERGE_CASES})
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])
