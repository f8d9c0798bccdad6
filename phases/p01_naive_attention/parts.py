"""What an engine is built from: the setup, the parts, and a recipe that says which part is whose.

    EngineSetup     the resolved engine arguments: the model's folder and shape, device, dtype,
                    the tokenizer, the longest sequence; read once, before any part is built
    Recipe          one factory per part: setup, the parts built so far -> the part
    Parts           what a recipe builds, in this order:

        model_loader    setup -> the model with its weights
        model       the network that runs: the loaded `tinyvllm.model.LlamaForCausalLM`, or a
                    phase's change of it
        kv_cache    a pool of K/V blocks, where a phase keeps one
        allocator   hands out its blocks
        attention   metadata -> the attention of one step, over the cache (phase 1 has no cache:
                    its runner attends itself)
        sampler     sample(runner output) -> the tokens (`tinyvllm.sampler.Sampler`)
        runner      execute(plan) -> the logits rows to sample (`tinyvllm.step.ModelRunnerOutput`)
        proposer    guesses draft tokens, where a phase speculates
        scheduler   schedule() -> the plan of a step; update(plan, sampled) -> the requests move on

What the engine asks of each part is a `Protocol` (`SchedulerInterface`, `ModelRunnerInterface`,
...): the methods the engine loop and the other parts call on it, and nothing else. A part is any
object that has them; it inherits from nothing.

A phase's recipe is the recipe of the phase before with the factories it replaces
(`Recipe.extend`). A switch (`enforce_eager`, `quantization`, `speculative_config`, ...) is read
by a factory once, when it builds its part: a part never tests a flag another part decided.
Parts are built lazily from factories, not made and then replaced, so a phase that brings its
own KV pool never allocates the one before it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from tinyvllm.config import EngineConfig, ModelConfig
from tinyvllm.download import resolve_model
from tinyvllm.model import AttentionBackend
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.sequence import Sequence
from tinyvllm.step import ModelRunnerOutput, SamplerOutput, SchedulerOutput
from tinyvllm.tokenizer import Tokenizer
from tinyvllm import platform


@dataclass
class EngineSetup:
    """Everything the parts are built from, resolved once from the engine arguments."""

    config: EngineConfig            # every engine argument, checked
    engine_args: dict               # as given (a worker rank rebuilds the same engine from them)
    model_path: Path
    model_config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    max_model_len: int              # the longest sequence: max_model_len, within the model's
    tokenizer: Tokenizer
    eos_token_ids: frozenset[int]
    tensor_parallel_rank: int = 0   # which of several processes running one model this one is
    bf16_rows: int = 0              # dtype="auto" on this CPU: float32 products from this many rows in
                                    # bfloat16 (0: never), where a phase's products do (phase 4 on)
    check_kernels: bool = True      # checked mode (phase 2 on: `check_kernels`, as the platform resolves it)
    detokenize: bool = True         # the engine makes each sequence's text (phase 9's core leaves it to its front)

    @classmethod
    def create(cls, model: str | Path | None, engine_args: dict, tensor_parallel_rank: int = 0) -> "EngineSetup":
        """Check the arguments, find the model (None: the default one) and read its config and
        tokenizer."""
        config = EngineConfig.from_kwargs(**engine_args)
        machine = platform.current()   # first: a $TINYVLLM_CPU_KIND this CPU cannot be is refused here
        if config.tokenizer is not None and not (Path(config.tokenizer).expanduser() / "tokenizer.json").is_file():
            raise ValueError(f"tokenizer: no tokenizer.json in {str(config.tokenizer)!r}")
        model_path = resolve_model(model, config.tokenizer)
        device = platform.resolve_device(config.device)
        model_config = ModelConfig.from_pretrained(model_path)
        limit = model_config.max_position_embeddings
        max_model_len = min(config.max_model_len or limit, limit)
        tokenizer = Tokenizer(Path(config.tokenizer).expanduser() if config.tokenizer else model_path)
        return cls(config, dict(engine_args), model_path, model_config, device,
                   platform.resolve_dtype(config.dtype, device), max_model_len, tokenizer,
                   eos_token_ids(model_path, model_config, tokenizer), tensor_parallel_rank,
                   machine.bf16_product_rows(config.dtype, device.type, config.tensor_parallel_size),
                   platform.check_kernels_default(config.check_kernels, device.type))


def eos_token_ids(folder: Path, config: ModelConfig, tokenizer: Tokenizer) -> frozenset[int]:
    """End-of-sequence ids: generation_config.json's (what transformers' generate uses), else
    config.json's, plus the tokenizer's eos token."""
    ids = set(config.eos_token_id)
    gen = folder / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        if eos is not None:
            ids = set([eos] if isinstance(eos, int) else eos)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


# -- what the engine asks of each part --------------------------------------------------------------
# Each Protocol lists what the engine loop (engine.py) and the other parts call on that part, so a
# part that lost one of them is found when its engine is built (tests/test_architecture.py), not
# at the step that needs it. vLLM's `SchedulerInterface` (vllm/v1/core/sched/interface.py) does
# the same for its scheduler. Beside these, a part may keep counters (`stats()`, `reset_stats()`:
# `Engine.get_stats`) or hold something outside the process (`close()`: `Parts.close`); the
# engine looks for those with getattr.


@runtime_checkable
class SchedulerInterface(Protocol):
    """Who runs each step, and what happens to the requests after it (phase 1's `FifoScheduler`,
    and each later phase's scheduler)."""

    def add(self, seq: Sequence) -> None: ...
    def check_fits(self, num_prompt_tokens: int, params: SamplingParams) -> None: ...  # ValueError: it never fits
    def schedule(self) -> SchedulerOutput: ...
    def update(self, plan: SchedulerOutput, sampled: SamplerOutput) -> None: ...
    def finish(self, seq: Sequence) -> None: ...     # it leaves (finished or aborted) and frees its blocks

    @property
    def running(self) -> Collection[Sequence]: ...   # for `Engine.snapshot`

    @property
    def waiting(self) -> Collection[Sequence]: ...


@runtime_checkable
class BlockAllocatorInterface(Protocol):
    """The KV cache's manager, where a phase keeps a pool of blocks: hands them out to the
    sequences' block tables (`table`), as vLLM's `KVCacheManager` and `BlockPool` do. An allocator
    with a prefix cache has lookups besides, which only its own scheduler calls."""

    num_blocks: int
    block_size: int                                  # tokens per block
    ref_counts: list[int]                            # sequences holding each block

    @property
    def num_free_blocks(self) -> int: ...

    @property
    def num_used_blocks(self) -> int: ...

    def blocks_needed(self, num_tokens: int) -> int: ...
    def allocate(self, table: Any, num_tokens: int) -> None: ...
    def append_slot(self, table: Any) -> int: ...
    def release_block(self, block_id: int) -> None: ...   # one reference fewer (a rollback)
    def free(self, table: Any) -> None: ...


@runtime_checkable
class AttentionInterface(Protocol):
    """Called once a step with the step's attention metadata (how its flat tokens map to
    sequences and cache slots); returns the `tinyvllm.model.AttentionBackend` the model calls in
    every layer, `(layer_idx, q, k, v) -> out`. Typically `functools.partial(SomeBackend, kv_cache)`."""

    def __call__(self, meta: Any) -> AttentionBackend: ...


@runtime_checkable
class ModelRunnerInterface(Protocol):
    """The plan as tensors, the model over them, the logits rows to sample (phase 1's
    `RecomputeRunner`, and each later phase's runner).

    There is no executor part: with several ranks, phase 8's runner is `TensorParallelExecutor`,
    which keeps this interface and runs the runner of the phase before with the worker ranks
    beside it (what vLLM's executor does between the engine and its workers)."""

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput: ...


@runtime_checkable
class SamplerInterface(Protocol):
    """The tokens, from the runner's logits rows (`tinyvllm.sampler.Sampler`, or one that also
    verifies draft tokens)."""

    def sample(self, out: ModelRunnerOutput) -> SamplerOutput: ...


@runtime_checkable
class ProposerInterface(Protocol):
    """Guesses draft tokens for the scheduler, where a phase speculates. Proposers of different
    kinds take different arguments (a sequence's tokens; every sequence that wants drafts), and
    the scheduler that asks knows which it holds. One with a KV cache of its own also has
    `sync(running)` and `forget(seq)`, which the scheduler calls where they exist."""

    def propose(self, *args: Any) -> Any: ...


@dataclass
class Parts:
    """The parts of one engine (see the module docstring); None where a phase has no such part."""

    phase: int
    model_loader: Callable[[EngineSetup], torch.nn.Module] | None = None
    model: torch.nn.Module | None = None
    kv_cache: object = None
    allocator: BlockAllocatorInterface | None = None
    attention: AttentionInterface | None = None
    sampler: SamplerInterface | None = None
    runner: ModelRunnerInterface | None = None
    proposer: ProposerInterface | None = None
    scheduler: SchedulerInterface | None = None

    def close(self) -> None:
        """Let go of what a part holds outside this process (worker processes, say)."""
        for f in fields(self):
            close = getattr(getattr(self, f.name), "close", None)
            if callable(close):
                close()


# A factory: (the setup, the parts built so far) -> the part
Factory = Callable[[EngineSetup, Parts], object]
PART_ORDER = ("model_loader", "model", "kv_cache", "allocator", "attention", "sampler", "runner", "proposer", "scheduler")


@dataclass(frozen=True)
class Recipe:
    """Which factory builds each part of a phase's engine, the engine arguments the phase acts
    on, and the checks its arguments must pass before anything is built."""

    phase: int
    engine_args: frozenset[str]
    model_loader: Factory
    model: Factory
    sampler: Factory
    runner: Factory
    scheduler: Factory
    kv_cache: Factory | None = None
    allocator: Factory | None = None
    attention: Factory | None = None
    proposer: Factory | None = None
    checks: tuple[Callable[[EngineSetup], None], ...] = ()
    # What the caller holds, where it is not the engine itself: (model, engine arguments, this
    # recipe) -> an object with the engine's public methods (phase 9's client of an engine core in
    # a process of its own). None: the registry builds `Engine(setup, recipe.build(setup))` in
    # the caller's process.
    front_end: Callable[[Any, dict, "Recipe"], Any] | None = None

    def extend(self, phase: int, engine_args=(), checks=(), front_end=None, **factories: Factory) -> "Recipe":
        """The recipe of the next phase: this one with the factories it replaces, the engine
        arguments it adds, its checks after these, and its front end (or the one before)."""
        unknown = set(factories) - set(PART_ORDER)
        if unknown:
            raise TypeError(f"no such part(s): {sorted(unknown)}; the parts are {PART_ORDER}")
        return replace(self, phase=phase, engine_args=self.engine_args | frozenset(engine_args),
                       checks=self.checks + tuple(checks), front_end=front_end or self.front_end, **factories)

    def build(self, setup: EngineSetup) -> Parts:
        """Run the checks, then each factory in PART_ORDER."""
        for check in self.checks:
            check(setup)
        parts = Parts(self.phase)
        for name in PART_ORDER:
            factory = getattr(self, name)
            if factory is not None:
                setattr(parts, name, factory(setup, parts))
        return parts
