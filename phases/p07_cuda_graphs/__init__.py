"""Phase 7: a persistent batch, static buffers and captured (or compiled) decode steps."""

from .compiled import CompiledDecodeRunner, OpaqueLinear, make_opaque
from .cpu_step import CStep
from .decode_runner import (CudaGraphDecodeRunner, DecodeRunner, StaticDecodeBuffers, bucket_for,
                            default_capture_sizes)
from .fused import decode_forward, fuse_projections, fused_model
from .input_batch import InputBatch
from .model_runner import StaticModelRunner
from .recipe import RECIPE

__all__ = ["RECIPE", "CStep", "CompiledDecodeRunner", "CudaGraphDecodeRunner", "DecodeRunner", "InputBatch", "OpaqueLinear",
           "StaticDecodeBuffers", "StaticModelRunner", "bucket_for", "decode_forward", "default_capture_sizes",
           "fuse_projections", "fused_model", "make_opaque"]
