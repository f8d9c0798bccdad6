"""Phase 1: a Llama forward pass with plain attention; every step recomputes the whole sequence."""

from .attention import NaiveAttention, causal_attention
from .engine import Engine, record_prompt_logprobs

__all__ = ["Engine", "record_prompt_logprobs", "NaiveAttention", "causal_attention"]


# Phase 1 is the first rung: the baseline of phase 2's checkpoint, with no phase before it.
THROUGHPUT_CHECKPOINTS: tuple = ()
