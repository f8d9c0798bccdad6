"""The model's layers, each in plain PyTorch: `Linear`, `RMSNorm`, `RotaryEmbedding`, `SiluAndMul`.

These are what a reader of lesson 1 sees, and what phases 1 to 3 run. A later phase that brings a
faster implementation of a layer (phase 4's CPU kernels, phase 5's quantized products, phase 7's
fused projections) gives the model another module of the same interface, chosen by the platform
(`tinyvllm.platform`) when its recipe builds the model; these stay the reference every one of them
is tested against. vLLM keeps its layers the same way (`vllm/model_executor/layers/`), as nano-vllm
does (`nanovllm/layers/`).
"""

from tinyvllm.layers.activation import SiluAndMul
from tinyvllm.layers.linear import Linear
from tinyvllm.layers.norm import RMSNorm
from tinyvllm.layers.rotary import RotaryEmbedding, apply_rotary, rope_inv_freq, rotate_half

__all__ = ["Linear", "RMSNorm", "RotaryEmbedding", "SiluAndMul", "apply_rotary", "rope_inv_freq", "rotate_half"]
