"""Phase 4 checkpoint, the kernels: every Triton kernel against phase 3's PyTorch attention.

On a CPU the kernels run in Triton's interpreter, in *one subprocess* started with
TRITON_INTERPRET=1 (`kernel_cases.py` runs every case there and reports its errors as JSON), so
the interpreter never enters this process and slows no other test. On a CUDA GPU the same cases
run compiled, in this process, in float32, float16 and bfloat16 (`gpu` marker; skipped with its
reason on a CPU). The cases and their tolerances are in `kernel_cases.py`.
"""

from __future__ import annotations

import pytest

from phases.p04_triton_kernels.tools.kernel_cases import CACHE_CASES, CASES, MERGE_CASES, run_in_subprocess


def run_cases(*args: str, interpret: bool = True) -> dict:
    """`python -m phases.p04_triton_kernels.tools.kernel_cases *args`, in the interpreter or not."""
    return run_in_subprocess("phases.p04_triton_kernels.tools.kernel_cases", *args, interpret=interpret)


@pytest.fixture(scope="module")
def interpreted():
    return run_cases()


def where_it_differs(result: dict) -> tuple[str, str]:
    """What the pattern of a case's wrong sequences points at ('' if nothing in particular), and
    which sequences of its batch are wrong."""
    tol, bs = result["tol"], result["bs"]
    bad = [(keys, queries) for keys, queries, err in result["seqs"] if not err <= tol]
    good = [(keys, queries) for keys, queries, err in result["seqs"] if err <= tol]
    where = f"wrong in the sequences of (keys, queries) {bad}, right in {good}"
    if any(keys == queries == 1 for keys, queries in bad):
        return ("a query over its own key alone is wrong: each query sees the keys up to and including its "
                "position (k_pos <= q_pos)"), where
    if bad and all(keys > bs for keys, _ in bad) and any(keys <= bs for keys, _ in good):
        return (f"the sequences within one block of {bs} keys are right and longer ones are not: each new block "
                "rescales what came before (acc and l_i) by alpha = exp2(m_i - m_new)"), where
    return "", where


@pytest.mark.interpreter
@pytest.mark.parametrize("case", list(CASES) + list(CACHE_CASES))
def test_kernel_in_interpreter(case, interpreted):
    result = interpreted[case]
    if not result["max_err"] <= result["tol"]:
        hint, where = where_it_differs(result) if "seqs" in result else ("", "")
        pytest.fail(f"{case}: " + (f"{hint}; " if hint else "") + f"largest error {result['max_err']:.2e} against "
                    f"phase 3's attention (tolerance {result['tol']:.0e}); {where}", pytrace=False)


@pytest.mark.interpreter
@pytest.mark.parametrize("case", list(MERGE_CASES))
def test_merge_attn_states_in_interpreter(case, interpreted):
    """Split-KV's last step alone: partial outputs and log-sum-exps merged into attention over
    every key (segments with no keys; scores whose exp overflows float32)."""
    result = interpreted[case]
    assert result["max_err"] <= result["tol"], (
        f"merge_attn_states, {case}: " + (f"it is what {result['like']} gives; " if result["like"] else "")
        + f"largest error {result['max_err']:.2e} against attention over every key; segment s weighs "
        "exp(lse_s - max lse) (0 for an empty one), divided by the sum of the weights")


@pytest.mark.interpreter
def test_split_kv_rule_chose_to_split_in_interpreter(interpreted):
    # the one case left to the rule must have split, or the merge path went unchecked by it
    assert interpreted["bs16-d64-gqa4-one-long-decode-auto-split-f32"]["num_kv_splits"] > 1


@pytest.mark.interpreter
@pytest.mark.slow  # a whole engine in the interpreter: ~21 s
def test_engine_in_interpreter_gives_phase3_tokens(tiny_model_dir):
    from phases.p04_triton_kernels.tools.kernel_cases import engine_tokens

    triton = run_cases("--engine", str(tiny_model_dir), "triton")
    assert triton["backend"] == "triton"
    ref = engine_tokens(str(tiny_model_dir), 3)  # phase 3 itself, in this process (no interpreter)
    assert triton["greedy"] == ref["greedy"]
    assert triton["sampled"] == ref["sampled"]


def test_kernels_compile_for_cuda_without_a_gpu():
    # ahead of time, for an H100 (compute capability 9.0): what the interpreter cannot check
    compiled = run_cases("--compile", "90", interpret=False)
    assert len(compiled) == 11


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_compiled_on_gpu(case, dtype):
    from phases.p04_triton_kernels.tools.kernel_cases import run_case

    result = run_case(case, "cuda", dtype)
    assert result["max_err"] <= result["tol"], result


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("case", list(CACHE_CASES))
def test_cache_write_compiled_on_gpu(case, dtype):
    from phases.p04_triton_kernels.tools.kernel_cases import run_cache_case

    result = run_cache_case(case, "cuda", dtype)
    assert result["max_err"] <= result["tol"], result


@pytest.mark.gpu
def test_engine_compiled_on_gpu_gives_phase3_tokens(tiny_model_dir):
    from phases.p04_triton_kernels.tools.kernel_cases import engine_tokens

    ours = engine_tokens(str(tiny_model_dir), 4, device="cuda", dtype="float32")
    ref = engine_tokens(str(tiny_model_dir), 3, device="cuda", dtype="float32")
    assert ours["backend"] == "triton"
    assert ours["greedy"] == ref["greedy"]
    assert ours["sampled"] == ref["sampled"]
