"""Cutting a loaded Llama into one rank's share, in place, the way Megatron-LM does.

A product y = x @ W^T can be split two ways across ranks:

    column-parallel (split W's rows = y's columns)      row-parallel (split W's columns = x's columns)
      rank r: y_r = x @ W_r^T        (N, out/R)            rank r: y_r = x_r @ W_r^T     (N, out), partial
      nothing to combine: each rank keeps its columns       y = y_0 + y_1 + ...: one all-reduce

In a decoder layer the two alternate so that only one all-reduce is needed per block:

    attention:  q, k, v  column-parallel (whole heads: a rank attends with its own heads, on its
                         own share of the KV cache) -> o_proj row-parallel -> all-reduce
    MLP:        gate, up column-parallel (SiLU(gate) * up is column by column) -> down_proj
                row-parallel -> all-reduce

The embedding is split by vocabulary (each rank looks up the ids in its range, zeros elsewhere,
then an all-reduce), and so is the LM head (each rank computes its columns of the logits, the
driver gathers them). Nothing else is split: the norms and RoPE run on every rank on the same
(N, D) hidden state.

Heads are split by groups of grouped-query attention, so a query head always sits with its KV
head: with more KV heads than ranks, the KV heads are split as evenly as possible (the default
model's 3 KV heads over 2 ranks: 2 and 1, with their 6 and 3 query heads); with fewer, each KV
head is copied to `world / num_kv_heads` ranks, which then split its query heads.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from tinyvllm.config import ModelConfig
from tinyvllm.model import LlamaForCausalLM

from .parallel import TensorParallelGroup, shard_range


def head_ranges(num_heads: int, num_kv_heads: int, rank: int, world: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Rank `rank`'s query heads and KV heads, as (start, stop) each."""
    # >>> exercise head_ranges (2 stars): Which query heads and KV heads rank `rank` of `world` holds, each as (start, stop), so that every query head sits on the rank of its KV head.
    # hint: with num_kv_heads >= world, split the KV heads with shard_range and take their query heads (num_heads // num_kv_heads per KV head); with fewer, world // num_kv_heads ranks share one KV head and split its query heads.
    # checked by: test_head_ranges_cover_every_head_once, test_two_ranks_give_one_rank_tokens
    group = num_heads // num_kv_heads
    if num_kv_heads >= world:
        kv = shard_range(num_kv_heads, rank, world)
        return (kv[0] * group, kv[1] * group), kv
    if world % num_kv_heads or num_heads % world:
        raise ValueError(f"tensor_parallel_size={world}: with fewer KV heads ({num_kv_heads}) than ranks, "
                         f"it must be a multiple of the KV heads and divide the {num_heads} query heads")
    kv_head = rank // (world // num_kv_heads)
    return shard_range(num_heads, rank, world), (kv_head, kv_head + 1)
    # <<< exercise head_ranges


class RowParallelLinear(nn.Module):
    """A product whose input columns (and weight columns) are split over the ranks: each rank's
    output is a partial sum, and one all-reduce makes every rank's output the whole."""

    def __init__(self, linear: nn.Module, group: TensorParallelGroup):
        super().__init__()
        self.linear, self.group = linear, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # >>> exercise row_parallel (1 star): The product of this rank's columns, summed over the ranks.
        # hint: self.linear gives this rank's partial (N, out); the group's all_reduce sums it over the ranks, in place.
        # checked by: test_row_parallel_linear_sums_its_partial_product, test_two_ranks_give_one_rank_tokens, test_row_parallel_sums_the_partial_products
        return self.group.all_reduce(self.linear(x))
        # <<< exercise row_parallel


class VocabParallelEmbedding(nn.Module):
    """Rows `start .. start + n` of the embedding table: ids outside them give zeros, and the
    all-reduce adds the one rank's row that is not zero (so the sum is exact)."""

    def __init__(self, weight: torch.Tensor, start: int, group: TensorParallelGroup):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start, self.group = start, group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # >>> exercise vocab_embedding (2 stars): Look up the ids in this rank's rows of the table (zeros for an id another rank holds), summed over the ranks.
        # hint: local = input_ids - self.start is inside when 0 <= local < the rows held; look up a clamped local id (F.embedding), zero the rows of ids outside, then self.group.all_reduce.
        # checked by: test_vocab_parallel_embedding_sums_to_the_whole_table, test_two_ranks_give_one_rank_tokens
        local = input_ids - self.start
        inside = (local >= 0) & (local < self.weight.shape[0])
        x = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)     # (N, D)
        return self.group.all_reduce(x * inside[:, None].to(x.dtype))
        # <<< exercise vocab_embedding


def _keep_rows(linear: nn.Linear, start: int, stop: int) -> None:
    """Column-parallel: keep rows start .. stop of `linear` (its outputs start .. stop), in place."""
    # >>> exercise column_parallel (1 star): Keep only output rows start .. stop of a linear layer (its weight's rows, its bias's entries): this rank's columns of y.
    # hint: weight.data[start:stop] (O, I) -> a clone (so the whole matrix can be freed) in an nn.Parameter(requires_grad=False); the same for the bias, if any; then out_features.
    # checked by: test_column_parallel_keeps_its_output_columns, test_each_rank_holds_its_share, test_two_ranks_give_one_rank_tokens
    linear.weight = nn.Parameter(linear.weight.data[start:stop].clone(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.data[start:stop].clone(), requires_grad=False)
    linear.out_features = stop - start
    # <<< exercise column_parallel


def _keep_columns(linear: nn.Linear, start: int, stop: int, rank: int) -> None:
    linear.weight = nn.Parameter(linear.weight.data[:, start:stop].clone(), requires_grad=False)
    if linear.bias is not None and rank != 0:   # a bias is added once, by rank 0's partial sum
        linear.bias = nn.Parameter(torch.zeros_like(linear.bias), requires_grad=False)
    linear.in_features = stop - start


def shard_model(model: LlamaForCausalLM, group: TensorParallelGroup) -> ModelConfig:
    """Keep rank `group.rank`'s share of every weight of `model`, in place, and put the
    all-reduces after the row-parallel products. Returns the config of the shard (its heads,
    intermediate size and vocabulary), which sizes this rank's KV cache."""
    c, rank, world = model.config, group.rank, group.world
    (q0, q1), (k0, k1) = head_ranges(c.num_attention_heads, c.num_key_value_heads, rank, world)
    i0, i1 = shard_range(c.intermediate_size, rank, world)
    v0, v1 = shard_range(c.vocab_size, rank, world)
    d = c.head_dim
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        _keep_rows(a.q_proj, q0 * d, q1 * d)
        _keep_rows(a.k_proj, k0 * d, k1 * d)
        _keep_rows(a.v_proj, k0 * d, k1 * d)
        _keep_columns(a.o_proj, q0 * d, q1 * d, rank)
        a.num_heads, a.num_kv_heads = q1 - q0, k1 - k0
        a.o_proj = RowParallelLinear(a.o_proj, group)
        _keep_rows(m.gate_proj, i0, i1)
        _keep_rows(m.up_proj, i0, i1)
        _keep_columns(m.down_proj, i0, i1, rank)
        m.down_proj = RowParallelLinear(m.down_proj, group)
    embed = model.model.embed_tokens.weight.data[v0:v1].clone()
    model.model.embed_tokens = VocabParallelEmbedding(embed, v0, group)
    if c.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
        model.lm_head.out_features = v1 - v0
    else:
        _keep_rows(model.lm_head, v0, v1)
    return dataclasses.replace(c, num_attention_heads=q1 - q0, num_key_value_heads=k1 - k0,
                               intermediate_size=i1 - i0, vocab_size=v1 - v0)


class TensorParallelLlama(LlamaForCausalLM):
    """One rank's shard as a model. On the driver, `forward` and `compute_logits` first send the
    workers what to run (the same call on their shards), then run their own share; the logits of
    all ranks' vocabulary columns are gathered on the driver. Inside a decode step every rank runs
    on its own (`group.in_lockstep`): then nothing is sent."""

    def __init__(self, shard: LlamaForCausalLM, full_config: ModelConfig, group: TensorParallelGroup):
        nn.Module.__init__(self)
        self.config, self.group = full_config, group
        self.model, self.lm_head = shard.model, shard.lm_head

    def forward(self, input_ids, positions, attn):
        if self.group.is_driver and self.group.world > 1 and not self.group.lockstep:
            self.group.broadcast_object(("forward", input_ids, positions, attn.meta))
        return self.model(input_ids, positions, attn)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """(M, D) -> (M, V) float32 logits on the driver (None on a worker)."""
        if self.group.is_driver and self.group.world > 1 and not self.group.lockstep:
            self.group.broadcast_object(("logits", hidden))
        return self.group.gather_columns(self.lm_head(hidden).float(), self.config.vocab_size)
