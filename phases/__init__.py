"""The phase registry: phase number -> the package whose `RECIPE` builds that phase's engine.

A new phase joins every shared test and the front door (`LLM(phase=N)`) by adding one line here.
`make_engine(N, model, **engine_args)` is `Engine(setup, RECIPE.build(setup))`: the one engine
loop (phase 1's `Engine`) with phase N's parts; where the recipe has a `front_end` (phase 9 on),
what that makes of them (the client of an engine core in a process of its own), with the same
public methods.
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
    9: "phases.p09_engine_core",
    10: "phases.p10_kv_tiers",
    11: "phases.p11_hybrid_kv",
}

if os.environ.get("TINYVLLM_WORKSPACE"):  # a learner's copies of phases stand in (phases/workspace.py)
    from .workspace import use_workspace
    use_workspace(os.environ["TINYVLLM_WORKSPACE"])


def latest_phase() -> int:
    return max(PHASES)


def _check_phase(phase: int | None) -> int:
    if phase is None:
        return latest_phase()
    if isinstance(phase, bool) or not isinstance(phase, int):
        raise TypeError(f"phase must be an int or None, got {phase!r}")
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {sorted(PHASES)}, got {phase}")
    return phase


def get_recipe(phase: int | None = None):
    """The `Recipe` of `phase` (None: the newest)."""
    return importlib.import_module(PHASES[_check_phase(phase)]).RECIPE


def first_phase_with(engine_arg: str) -> int | None:
    """The first registered phase whose recipe acts on `engine_arg` (None: no phase does)."""
    for phase in sorted(PHASES):
        if engine_arg in get_recipe(phase).engine_args:
            return phase
    return None


def check_engine_args(phase: int, engine_args: dict) -> None:
    """Refuse an argument phase `phase` would ignore (`quantization="int4"` on phase 3): the user
    asked for a feature, and silently getting something else would mislead them. The error names
    the first phase that has it."""
    from tinyvllm.config import EngineConfig, unsupported_engine_args

    EngineConfig.from_kwargs(**engine_args)  # unknown names and bad values first
    for name in unsupported_engine_args(engine_args, get_recipe(phase).engine_args):
        first = first_phase_with(name)
        where = (f"phase {first} is the first that has it: LLM(phase={first}) or later"
                 if first else "no registered phase has it yet")
        raise ValueError(f"{name}={engine_args[name]!r}: phase {phase} does not have this "
                         f"feature ({where}); or leave {name} at its default")


def make_engine(phase: int | None = None, model=None, **engine_args):
    """Phase `phase`'s engine (None: the newest) on `model` (None: the default model)."""
    from phases.p01_naive_attention import Engine, EngineSetup

    phase = _check_phase(phase)
    check_engine_args(phase, engine_args)
    recipe = get_recipe(phase)
    if recipe.front_end is not None:   # phase 9 on: a client of the engine core's process
        return recipe.front_end(model, engine_args, recipe)
    setup = EngineSetup.create(model, engine_args)
    return Engine(setup, recipe.build(setup))
