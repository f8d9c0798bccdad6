"""Phase 1: the engine's one loop, and a Llama forward pass with plain attention that recomputes
the whole sequence at every step."""

from .attention import NaiveAttention, causal_attention
from .engine import Engine
from .model_runner import RecomputeRunner, prompt_logits
from .parts import (AttentionInterface, BlockAllocatorInterface, EngineSetup, ModelRunnerInterface, Parts,
                    ProposerInterface, Recipe, SamplerInterface, SchedulerInterface)
from .recipe import RECIPE
from .scheduler import FifoScheduler, mark_scheduled

__all__ = ["AttentionInterface", "BlockAllocatorInterface", "Engine", "EngineSetup", "FifoScheduler",
           "ModelRunnerInterface", "NaiveAttention", "Parts", "ProposerInterface", "RECIPE", "Recipe",
           "RecomputeRunner", "SamplerInterface", "SchedulerInterface", "causal_attention", "mark_scheduled",
           "prompt_logits"]
