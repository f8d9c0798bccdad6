"""Phase 5: int8 and int4 weights, and a quantized KV cache."""

from .kv_quant import QuantizedKVCache, QuantizedPagedAttention
from .lossless import LosslessLinear, keep_lossless, lossless_codes
from .quant import QuantizedLinear
from .quantize_layers import linear_layers, quantize_model
from .recipe import RECIPE

__all__ = ["RECIPE", "LosslessLinear", "QuantizedKVCache", "QuantizedLinear", "QuantizedPagedAttention", "keep_lossless",
           "linear_layers", "lossless_codes", "quantize_model"]
