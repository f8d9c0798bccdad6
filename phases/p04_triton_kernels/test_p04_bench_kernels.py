"""`tinyvllm bench kernels` on tiny shapes: every case has a row per kernel, the bytes are the
K/V the sequences hold, the ratios come from the times of the same run, Triton's rows say why they
are skipped on a CPU, and --json writes the report. No speed is asserted."""

from __future__ import annotations

import json

import pytest
import torch

from phases.p04_triton_kernels.cpu_attention import prefill_paths
from tinyvllm.entrypoints.bench.kernels import run_kernels
from tinyvllm.entrypoints.bench.machine import MachineLimits
from tinyvllm.entrypoints.cli import main

LIMITS = MachineLimits(memory_bandwidth=10e9, matmul_flops=50e9, matmul_dtype="float32",
                       copy_bytes=1, matmul_size=1)  # made up: the measurement is not under test


def test_rows_bytes_and_ratios():
    report = run_kernels(4, 2, 16, torch.float32, torch.device("cpu"), block_size=16, batch_sizes=[1, 3],
                         context_lens=[5, 40], prefill_lens=[20, 600], repeat=1, limits=LIMITS)
    rows = report["rows"]
    cases = {(r["case"], r["batch"], r["context"]) for r in rows}
    assert cases == {("decode", 1, 5), ("decode", 3, 5), ("decode", 1, 40), ("decode", 3, 40), ("prefill", 1, 20),
                     ("prefill", 1, 600), ("chunk", 1, 600)}   # 600 tokens: a last chunk of 512 after 88
    for case in cases:
        mine = {r["kernel"]: r for r in rows if (r["case"], r["batch"], r["context"]) == case}
        # the prefills also through SDPA, where the CPU path may take cpu_attention.c, and through
        # its bfloat16 products where they run
        prefill_only = {"sdpa"} | ({"cpu_bf16"} if prefill_paths()[1] else set())
        assert set(mine) == {"phase3", "cpu", "triton"} | (prefill_only if case[0] != "decode" else set())
        b, ctx = case[1], case[2]
        qlen = {"decode": 1, "prefill": ctx, "chunk": 512}[case[0]]
        assert mine["cpu"]["query_len"] == qlen
        # K and V of every cached token, plus q and the output, 4 bytes each
        assert mine["cpu"]["bytes"] == (2 * b * ctx * 2 * 16 + 2 * b * qlen * 4 * 16) * 4
        assert mine["phase3"]["speedup_vs_phase3"] == 1.0
        cpu = mine["cpu"]
        assert cpu["speedup_vs_phase3"] == pytest.approx(mine["phase3"]["seconds"] / cpu["seconds"])
        assert cpu["fraction_of_copy"] == pytest.approx(cpu["bytes"] / cpu["seconds"] / 10e9)
        if not torch.cuda.is_available():
            assert mine["triton"]["seconds"] is None and "interpreter" in mine["triton"]["skipped"]


def test_cli_json(tiny_model_dir, tmp_path, capsys):
    path = tmp_path / "k.json"
    assert main(["bench", "kernels", "--model", str(tiny_model_dir), "--batch-sizes", "2",
                 "--context-lens", "17", "--prefill-len", "9", "--repeat", "1", "--device", "cpu",
                 "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    assert report["benchmark"] == "kernels" and report["command"].startswith("tinyvllm bench kernels")
    assert report["shape"]["kv_heads"] == 2 and report["limits"]["memory_bandwidth"] > 0
    assert len([r for r in report["rows"] if r["kernel"] == "cpu"]) == 2
    assert "vs phase3" in capsys.readouterr().out


def test_cli_rejects_bad_sizes(tiny_model_dir, capsys):
    assert main(["bench", "kernels", "--model", str(tiny_model_dir), "--batch-sizes", "0"]) == 2
    assert "--batch-sizes" in capsys.readouterr().err
