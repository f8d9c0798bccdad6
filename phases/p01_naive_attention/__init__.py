"""Phase 1: the engine's one loop, and a Llama forward pass with plain attention that recomputes
the whole sequence at every step."""

from .attention import NaiveAttention, causal_attention
from .engine import Engine
from .model_runner import RecomputeRunner, prompt_logits
from .parts import EngineSetup, Parts, Recipe
from .recipe import RECIPE
from .scheduler import FifoScheduler, mark_scheduled

__all__ = ["Engine", "EngineSetup", "FifoScheduler", "NaiveAttention", "Parts", "RECIPE", "Recipe",
           "RecomputeRunner", "causal_attention", "mark_scheduled", "prompt_logits"]
