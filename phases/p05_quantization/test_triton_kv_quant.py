"""The quantized KV cache in phase 4's Triton kernels (`triton_kv_quant.py`) against the CPU path
and `quantize_kv`: on a CPU through Triton's interpreter, in one subprocess started with
TRITON_INTERPRET=1 (so the interpreter never enters this process); compiled ahead of time for an
H100 without a GPU; and compiled on CUDA (`gpu`). The cases are in `kv_quant_cases.py`."""

from __future__ import annotations

import json
import os

import pytest

from phases.p04_triton_kernels.tools.kernel_cases import run_in_subprocess
from phases.p05_quantization.tools.kv_quant_cases import CASES, WRITE_CASES


def run_cases(*args: str, interpret: bool = True) -> dict:
    """`python -m phases.p05_quantization.tools.kv_quant_cases *args`, in the interpreter or not."""
    return run_in_subprocess("phases.p05_quantization.tools.kv_quant_cases", *args, interpret=interpret)


@pytest.fixture(scope="module")
def interpreted():
    return run_cases()


@pytest.mark.interpreter
@pytest.mark.parametrize("case", list(CASES))
def test_triton_attention_over_a_quantized_cache_equals_the_cpu_path(case, interpreted):
    result = interpreted[case]
    assert result["cache_equal"], result  # the kernel's write stored what quantize_kv stores
    assert result["max_err"] <= result["tol"], result


@pytest.mark.interpreter
@pytest.mark.parametrize("case", list(WRITE_CASES))
def test_triton_write_stores_exactly_what_quantize_kv_stores(case, interpreted):
    result = interpreted[case]
    assert result["max_err"] == 0, result  # bytes and scales that differ from quantize_kv's
    assert "TRITON_INTERPRET" not in os.environ


@pytest.mark.interpreter
@pytest.mark.slow  # a whole engine in the interpreter, greedy: ~18 s (fp8 passes too)
def test_engine_with_triton_over_a_quantized_cache_gives_the_cpu_paths_tokens(tiny_model_dir):
    # the engine's wiring (which backend, which cache); the kernels' numbers, sampling included,
    # are the cases above and phase 4's engine test
    from phases.p04_triton_kernels.tools.kernel_cases import engine_tokens

    triton = run_cases("--engine", str(tiny_model_dir), "int8")
    assert triton["backend"] == "triton"
    ref = engine_tokens(str(tiny_model_dir), 5, sampled=False, kv_cache_dtype="int8")  # the CPU path, here
    assert ref["backend"] == "cpu"
    assert triton["greedy"] == ref["greedy"] and len(ref["greedy"]) == 5


@pytest.mark.interpreter
@pytest.mark.slow  # two tiny windowed engines in the interpreter, greedy: ~10 s
def test_engine_with_triton_over_a_quantized_cache_reads_each_layer_s_window(tmp_path):
    """A windowed model (Mistral, window 8, prompts of up to 5 windows) with the Triton kernels
    over an int8 cache gives the tokens of the CPU path, which attends each windowed layer through
    phase 2's paged attention over the same dequantized blocks."""
    from phases.p04_triton_kernels.tools.kernel_cases import engine_tokens
    from tinyvllm.testing import make_tiny_family

    folder = make_tiny_family(tmp_path / "mistral", "MistralForCausalLM", sliding_window=8, seed=5)
    args = dict(dtype="float32", block_size=16, num_kv_blocks=48)
    triton = run_cases("--engine", str(folder), "int8", json.dumps(args))
    assert triton["backend"] == "triton"
    ref = engine_tokens(str(folder), 5, sampled=False, kv_cache_dtype="int8", **args)
    assert ref["backend"] == "cpu"
    assert triton["greedy"] == ref["greedy"] and len(ref["greedy"]) == 5


def test_quantized_kernels_compile_for_cuda_without_a_gpu():
    # ahead of time, for an H100 (compute capability 9.0): fp8's cast and the int8/fp8 loads
    compiled = run_cases("--compile", "90", interpret=False)
    assert len(compiled) == 8


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CASES))
def test_triton_attention_over_a_quantized_cache_compiled_on_gpu(case):
    from phases.p05_quantization.tools.kv_quant_cases import run_case

    result = run_case(case, "cuda")
    assert result["cache_equal"], result
    assert result["max_err"] <= result["tol"], result


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(WRITE_CASES))
def test_triton_write_compiled_on_gpu_stores_what_quantize_kv_stores(case):
    from phases.p05_quantization.tools.kv_quant_cases import run_write_case

    assert run_write_case(case, "cuda")["max_err"] == 0
