"""Sweep the decode launch of `unified_attention` on a CUDA GPU: split-KV segments x warps x stages.

    python -m phases.p04_triton_kernels.tools.tune_decode            # needs a CUDA GPU

For each decode shape (sequences x context, the default model's 9 query heads over 3 KV heads,
head_dim 64, bfloat16, blocks of 16), every combination is checked against SDPA in float32 and
timed with `triton.testing.do_bench` (the GPU's time, launches excluded); the six fastest are
printed with their share of the copy bandwidth measured in the same run. `choose_num_kv_splits`,
PROGRAMS_PER_SM and DECODE_NUM_WARPS/STAGES in `triton_attention.py` were set from its output on
an H100 (the lesson quotes it).
"""

from __future__ import annotations

import itertools

import torch

SHAPES = ((1, 4096), (8, 4096), (64, 4096), (64, 512), (256, 1024))
SPLITS, WARPS, STAGES = (1, 2, 4, 8, 16), (2, 4, 8), (1, 2, 3)


def main() -> None:
    import triton

    from tinyvllm.entrypoints.bench.machine import measure_limits

    from ..triton_attention import choose_num_kv_splits, num_sms, unified_attention

    if not torch.cuda.is_available():
        raise SystemExit("tune_decode needs a CUDA GPU (the interpreter's timings mean nothing)")
    dev, dt = torch.device("cuda"), torch.bfloat16
    h, kvh, d, bs = 9, 3, 64, 16
    copy = measure_limits(dev, dt).memory_bandwidth
    print(f"{torch.cuda.get_device_name(dev)}, copy bandwidth {copy / 1e9:,.0f} GB/s")
    for batch, ctx in SHAPES:
        per = ctx // bs
        kc = torch.randn(batch * per, bs, kvh, d, device=dev, dtype=dt)
        vc = torch.randn_like(kc)
        q, out = torch.randn(batch, h, d, device=dev, dtype=dt), torch.empty(batch, h, d, device=dev, dtype=dt)
        qsl = torch.arange(batch + 1, device=dev, dtype=torch.int32)
        lens = torch.full((batch,), ctx, device=dev, dtype=torch.int32)
        tables = torch.arange(batch * per, device=dev, dtype=torch.int32).reshape(batch, per)
        k = kc.view(batch, ctx, kvh, d).transpose(1, 2).float().repeat_interleave(h // kvh, 1)
        v = vc.view(batch, ctx, kvh, d).transpose(1, 2).float().repeat_interleave(h // kvh, 1)
        ref = torch.nn.functional.scaled_dot_product_attention(q[:, :, None].float(), k, v)[:, :, 0]
        nbytes = 2 * batch * ctx * kvh * d * kc.element_size()  # K and V, read once
        rows = []
        for s, w, st in itertools.product(SPLITS, WARPS, STAGES):
            def run():
                unified_attention(q, kc, vc, out, qsl, lens, tables, 1, ctx, num_kv_splits=s, num_warps=w,
                                  num_stages=st)
            run()
            err = (out.float() - ref).abs().max().item()
            rows.append((triton.testing.do_bench(run, warmup=10, rep=50), s, w, st, err))
        rows.sort()
        rule = choose_num_kv_splits(1, batch, kvh, ctx, bs, num_sms(dev))
        print(f"{batch} sequences x {ctx} tokens (the rule splits into {rule})")
        for ms, s, w, st, err in rows[:6]:
            print(f"  {ms * 1e3:8.1f} us  {nbytes / (ms * 1e-3) / copy:4.0%} of copy  splits {s:2d}  warps {w}  "
                  f"stages {st}  max err {err:.1e}")


if __name__ == "__main__":
    main()
