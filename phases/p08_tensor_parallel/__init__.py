"""Phase 8: tensor parallelism, one model over several ranks."""

from .executor import TensorParallelExecutor
from .layers import RowParallelLinear, TensorParallelLlama, VocabParallelEmbedding, head_ranges, shard_model
from .parallel import TensorParallelGroup
from .recipe import RECIPE, ShardedLoader

__all__ = ["RECIPE", "RowParallelLinear", "ShardedLoader", "TensorParallelExecutor", "TensorParallelGroup",
           "TensorParallelLlama", "VocabParallelEmbedding", "head_ranges", "shard_model"]
