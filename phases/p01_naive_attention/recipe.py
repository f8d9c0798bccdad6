"""Phase 1's recipe: the parts the one engine loop runs with, at their plainest.

    model_loader    reads the whole checkpoint (`tinyvllm.weights.load_model`)
    model       the Llama forward pass, as loaded
    sampler     the one sampler every phase uses (`tinyvllm.sampler.Sampler`)
    runner      `RecomputeRunner`: the whole sequence, every step, with `NaiveAttention`
    scheduler   `FifoScheduler`: one request at a time

Every later phase starts from this recipe and replaces parts (`Recipe.extend`).
"""

from __future__ import annotations

from tinyvllm.sampler import Sampler
from tinyvllm.weights import load_model

from .model_runner import RecomputeRunner
from .parts import EngineSetup, Parts, Recipe
from .scheduler import FifoScheduler


def load_checkpoint(setup: EngineSetup):
    """The model with all its weights loaded, on the engine's device and dtype: its layers
    `tinyvllm.layers`' plain ones."""
    return load_model(setup.model_path, setup.dtype, setup.device, setup.max_model_len)


def make_model_loader(setup: EngineSetup, parts: Parts):
    return load_checkpoint


def make_model(setup: EngineSetup, parts: Parts):
    return parts.model_loader(setup)


def make_sampler(setup: EngineSetup, parts: Parts) -> Sampler:
    return Sampler(setup.tokenizer)


def make_runner(setup: EngineSetup, parts: Parts) -> RecomputeRunner:
    return RecomputeRunner(parts.model, setup.device, setup.model_config.layer_windows(setup.max_model_len))


def make_scheduler(setup: EngineSetup, parts: Parts) -> FifoScheduler:
    return FifoScheduler()


RECIPE = Recipe(
    phase=1,
    # the engine arguments this phase acts on; each later phase adds the ones of its features
    engine_args=frozenset({"dtype", "device", "seed", "max_model_len", "tokenizer", "disable_log_stats"}),
    model_loader=make_model_loader, model=make_model, sampler=make_sampler, runner=make_runner, scheduler=make_scheduler,
)
