"""Static buffers, buckets, and the decode forward run on them: eagerly, or as CUDA graphs.

A CUDA graph records the kernels a forward pass launches, with the *addresses* of their inputs
and outputs, and replays them all with one launch. So a replay reads its inputs from exactly
the tensors it was captured with: the step's input ids, positions, slots, block tables and
sequence lengths live in `StaticDecodeBuffers`, allocated once at the largest batch size, and
each step copies its values into their first rows. A graph also fixes every shape, so one is
captured per batch-size *bucket* (`cudagraph_capture_sizes`) and a step of n requests runs the
bucket just above n, with the rows past n padded: their token writes its K/V into a scratch
block no request owns, and their logits are dropped before sampling. A forward run eagerly, or
compiled with a dynamic batch dimension (a CPU's), takes any number of rows, so there a step
runs just its n (unless `fixed_shapes`): a padded row costs a row of every product.

`DecodeRunner.run(bucket)` is the one interface: `DecodeRunner` (any device) runs the model
eagerly on the buffers; `CudaGraphDecodeRunner` captures a graph per bucket on its first use
(after one warm-up run) and replays it. Both attend through the attention part the recipe
chose (phase 2's, phase 4's Triton kernels, phase 5's quantized cache), handed metadata made of
the static buffers (`StaticDecodeBuffers.metadata`). For a capture that metadata has every
shape fixed: all the block-table columns, and `max_seq_len` the most a sequence may hold, so
the kernels read each row's length from `seq_lens` at every replay.
"""

from __future__ import annotations

from functools import partial

import torch

from phases.p02_paged_kv import AttentionMetadata, check_metadata
from phases.p04_triton_kernels.cpu_attention import attention_row
from tinyvllm import platform

from .cpu_step import CStep
from .fused import decode_forward, fused_model, layer_row


def default_capture_sizes(max_num_seqs: int) -> list[int]:
    """vLLM's default buckets: 1, 2, 4, 8, then every 8, up to max_num_seqs (always included)."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs] + list(range(8, max_num_seqs + 1, 8))
    return sizes if sizes and sizes[-1] == max_num_seqs else sizes + [max_num_seqs]


def bucket_for(n: int, sizes: list[int]) -> int:
    """The smallest bucket that holds n rows."""
    # >>> exercise bucket_for (1 star): The smallest bucket (a captured batch size) that holds n rows.
    # hint: the sizes are sorted; past the largest, a ValueError naming it.
    # checked by: test_bucket_for_is_the_smallest_that_holds_n, test_every_bucket_gives_eager_tokens, test_shrink_grow_cross_buckets_and_preempt
    for s in sizes:
        if s >= n:
            return s
    raise ValueError(f"{n} rows is more than the largest bucket ({sizes[-1]})")
    # <<< exercise bucket_for


class StaticDecodeBuffers:
    """A decode step's inputs at fixed addresses, `max_rows` rows each (one query per row)."""

    def __init__(self, max_rows: int, max_blocks: int, block_size: int, scratch_block: int,
                 device: torch.device):
        self.block_size, self.scratch_block = block_size, scratch_block
        z = {"dtype": torch.int64, "device": device}
        self.input_ids = torch.zeros(max_rows, **z)                  # (B,)
        self.positions = torch.zeros(max_rows, **z)                  # (B,)
        self.slot_mapping = torch.zeros(max_rows, **z)               # (B,)
        self.seq_lens = torch.ones(max_rows, **z)                    # (B,) after this step's write
        self.block_tables = torch.zeros(max_rows, max_blocks, **z)   # (B, M)
        self.query_start_loc = torch.arange(max_rows + 1, **z)       # (B+1,): one query a row
        self.num_blocks_used = 1  # block-table columns the real rows use (eager runs read only these)
        self.max_seq_len = 1      # the longest real row, after this step

    def fill(self, token_ids: torch.Tensor, num_computed: torch.Tensor, block_table: torch.Tensor,
             num_blocks: torch.Tensor, bucket: int) -> None:
        """Rows 0..n-1 from a batch's first n rows (token_ids (n, L), num_computed (n,),
        block_table (n, M), num_blocks (n,)); rows n..bucket-1 padded to the scratch block."""
        # >>> exercise fill_buffers (2 stars): Copy a batch's first n rows into the static buffers, and pad rows n .. bucket - 1 so they touch only the scratch block.
        # hint: a row's query is its token at position num_computed; its slot comes from its block table; a padded row is token 0 at position 0, written to the scratch block's first slot, attending to it alone.
        # checked by: test_fill_copies_each_row_and_pads_to_the_scratch_block, test_padding_writes_only_the_scratch_block, test_padded_rows_never_change_real_rows, test_every_bucket_gives_eager_tokens
        n, bs = len(num_computed), self.block_size
        pos = num_computed                                            # the query's position
        ids = token_ids.gather(1, pos[:, None])[:, 0]
        slots = block_table.gather(1, (pos // bs)[:, None])[:, 0] * bs + pos % bs
        m = int(num_blocks.max())
        self.input_ids[:n].copy_(ids, non_blocking=True)
        self.positions[:n].copy_(pos, non_blocking=True)
        self.slot_mapping[:n].copy_(slots, non_blocking=True)
        self.seq_lens[:n].copy_(pos + 1, non_blocking=True)
        self.block_tables[:n, :m].copy_(block_table[:, :m], non_blocking=True)
        # padding: token 0 at position 0, written to the scratch block's first slot, attending
        # to that slot alone
        self.input_ids[n:bucket], self.positions[n:bucket], self.seq_lens[n:bucket] = 0, 0, 1
        self.slot_mapping[n:bucket], self.block_tables[n:bucket, 0] = self.scratch_block * bs, self.scratch_block
        self.num_blocks_used, self.max_seq_len = m, int(pos.max()) + 1
        # <<< exercise fill_buffers

    def metadata(self, bucket: int, fixed_shapes: bool = False) -> AttentionMetadata:
        """Phase 2's metadata for the first `bucket` rows, one decode each, made of the buffers
        (views, not copies). fixed_shapes (what a captured graph needs): every block-table column
        and `max_seq_len` the most a sequence may hold, and no length copied to the host;
        otherwise the columns the real rows use and their longest length."""
        tables = self.block_tables[:bucket] if fixed_shapes else self.block_tables[:bucket, :self.num_blocks_used]
        longest = self.block_tables.shape[1] * self.block_size if fixed_shapes else self.max_seq_len
        seq_lens, starts = self.seq_lens[:bucket], self.query_start_loc[:bucket + 1]
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket], query_start_loc=list(range(bucket + 1)),
            seq_lens=[] if fixed_shapes else seq_lens.tolist(), block_tables=tables, prefill_rows=[],
            decode_token_idx=starts[:bucket], decode_block_tables=tables, decode_seq_lens=seq_lens,
            query_start_loc_tensor=starts, seq_lens_tensor=seq_lens, max_query_len=1, max_seq_len=longest,
            max_decode_seq_len=longest)


class DecodeRunner:
    """Runs the decode forward on the first `bucket` rows of the static buffers, eagerly, through
    the recipe's attention part (`attention`: metadata -> the step's attention). Returns the
    logits (bucket, V). `fixed_shapes`: a graph's shapes, eagerly: the step's rows padded to
    their bucket, and the attention handed the metadata a captured graph needs
    (`StaticDecodeBuffers.metadata`); a `CudaGraphDecodeRunner` always has them. Without, a step
    runs its own rows: an eager forward (or one compiled with a dynamic batch dimension) takes
    any number, and a padded row is a row of every product computed for nothing.

    A fused model (`fuse_projections`) runs `decode_forward`, the same numbers with fewer
    operator calls (float or quantized); any other (a layer it could not fuse) runs its own forward.
    On a CPU, the residual adds and norms are one C call each where the platform's `c_norm_decode`
    rule says, and a step `CStep` serves (where `c_step` says, every product and the attention
    with a C kernel, up to the rows they take) runs as one call of cpu_step.c instead."""

    def __init__(self, model, buffers: StaticDecodeBuffers, attention, fixed_shapes: bool = False):
        self.model, self.buf, self.attention, self.fixed_shapes = model, buffers, attention, fixed_shapes
        on_cpu, rules = buffers.input_ids.is_cpu, platform.current()
        c_norm = on_cpu and bool(rules.rule("c_norm_decode"))
        self.model_forward = partial(decode_forward, model, c_norm=c_norm) if fused_model(model) else model
        c_step = CStep(model, layer_row) if on_cpu and rules.rule("c_step") else None   # the layers in one C call
        self.c_step = c_step if c_step is not None and c_step.max_rows else None   # None: it serves no step

    def run(self, bucket: int, buf: StaticDecodeBuffers | None = None) -> torch.Tensor:
        """The forward on the first `bucket` rows of `buf` (the runner's own buffers unless given):
        cpu_step.c's where it serves, `decode_forward` (or the model's own) elsewhere."""
        b = self.buf if buf is None else buf
        ids, positions = b.input_ids[:bucket], b.positions[:bucket]
        attention = self.attention(b.metadata(bucket, self.fixed_shapes))
        hidden = None
        if self.c_step and not hooked(attention):
            hidden = self.c_step(ids, positions, attention_row(attention))
        if hidden is None:
            hidden = self.model_forward(ids, positions, attention)                       # (bucket, D)
        return self.model.compute_logits(hidden)                                          # (bucket, V)


def hooked(attention) -> bool:
    """Whether this step's attention is another part's wrapped with calls around each layer (phase
    10's connector, in a step with transfers: its `backend`): the fused forward runs that step,
    since cpu_step.c runs every layer in one call; the C step stays for the next."""
    return getattr(attention, "backend", None) is not None


class CudaGraphDecodeRunner(DecodeRunner):
    """One CUDA graph per bucket, captured at its first use after a warm-up run, all sharing one
    memory pool; a replay reads the static buffers and writes `outputs[bucket]`."""

    def __init__(self, model, buffers: StaticDecodeBuffers, attention, kv_cache=None):
        super().__init__(model, buffers, attention, fixed_shapes=True)
        self.graphs, self.outputs = {}, {}   # bucket -> its torch.cuda.CUDAGraph, its output tensor
        self.pool, self.num_captures = None, 0
        self.kv_cache = kv_cache   # where checked (`KVCache.checked`): each replay's buffers checked first

    def capture(self, bucket: int) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            super().run(bucket)  # warm-up: lazy inits and allocator growth stay out of the graph
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.outputs[bucket] = super().run(bucket)
        self.pool = self.pool or graph.pool()
        self.graphs[bucket], self.num_captures = graph, self.num_captures + 1

    def run(self, bucket: int) -> torch.Tensor:
        if bucket not in self.graphs:
            self.capture(bucket)
        if self.kv_cache is not None and self.kv_cache.checked:   # the buffers as filled, not in the graph
            check_metadata(self.buf.metadata(bucket, fixed_shapes=True), self.kv_cache.num_blocks,
                           self.kv_cache.block_size, "StaticDecodeBuffers")
        self.graphs[bucket].replay()
        return self.outputs[bucket]
