"""The phase registry: phase number -> the module that exports its `Engine`.

A new phase joins every shared test and the front door (`LLM(phase=N)`) by adding one line here.
"""

from __future__ import annotations

import importlib
import os

PHASES: dict[int, str] = {
    1: "phases.p01_naive_attention",
    2: "phases.p02_paged_kv",
    3: "phases.p03_continuous_batching",
    4: "phases.p04_triton_kernels",
    5: "phases.p05_quantization",
    6: "phases.p06_speculative_decoding",
    7: "phases.p07_cuda_graphs",
    8: "phases.p08_tensor_parallel",
}

if os.environ.get("TINYVLLM_WORKSPACE"):  # a learner's copies of phases stand in (phases/workspace.py)
    from .workspace import use_workspace
    use_workspace(os.environ["TINYVLLM_WORKSPACE"])


def first_phase_with(engine_arg: str) -> int | None:
    """The first registered phase whose engine acts on `engine_arg` (None: no phase does)."""
    for phase in sorted(PHASES):
        if engine_arg in get_engine_class(phase).ENGINE_ARGS:
            return phase
    return None


def latest_phase() -> int:
    return max(PHASES)


def get_engine_class(phase: int | None = None) -> type:
    """The Engine class of `phase` (None: the newest)."""
    if phase is None:
        phase = latest_phase()
    if isinstance(phase, bool) or not isinstance(phase, int):
        raise TypeError(f"phase must be an int or None, got {phase!r}")
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {sorted(PHASES)}, got {phase}")
    return importlib.import_module(PHASES[phase]).Engine
