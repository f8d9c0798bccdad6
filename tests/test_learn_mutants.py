"""A grader a learner can trust: every task of `tinyvllm learn` rejects the wrong solutions a learner
writes, and says what is wrong.

Each task has at least two plausible wrong versions here (`MUTANTS`): its reference body with one
mistake (a queue end, an off-by-one in a range or a mask, a reset forgotten, a wrong scale, a row
not moved). Each runs through the task's own checks, those its marker names, in that order, up to
the first failure (what `tinyvllm learn check` reports first for the task, through the same
`learn.grade`). It must fail, and that first line must name the mistake (`expect`).

How it stays fast: one pytest process (this file run as a script) grades every wrong version. It
holds a workspace with a copy of every phase, each task the reference's, and collects the checks
once. For each wrong version it writes the changed file into the workspace (so processes a check
starts, tensor-parallel ranks or Triton's interpreter, import it) and swaps the function's code
in the process itself; the fixtures and engines of one wrong version are torn down before the
next. A wrong version that crashes the process (a bad index fed to a C kernel) is recorded as
crashed in the check it was running, and the rest run in a fresh process, as `learn check` does.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import Future, wait
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutant:
    """A wrong version of a task: `old` (a piece of its reference body, found once in it) becomes
    `new`; the task's first failing check must say something matching `expect`."""
    task: str
    name: str      # the mistake in a few words (the test's id)
    old: str
    new: str
    expect: str    # a regular expression, searched in the first failing line

    @property
    def id(self) -> str:
        return f"{self.task}: {self.name}"


MUTANTS = [
    # -- phase 1 ---------------------------------------------------------------------------------
    Mutant("causal_attention", "num_past ignored", "[:, None] + num_past", "[:, None]",
           r"after 11 past keys.*as if num_past were 0"),
    Mutant("causal_attention", "scaled by 1/d", "* d ** -0.5", "/ d", r"scores scaled by 1/d"),
    Mutant("causal_attention", "a query blind to its own key", "k_pos > q_pos", "k_pos >= q_pos",
           r"blind to its own key"),
    Mutant("engine_step", "no try/except", """        try:
            out = self.runner.execute(plan)
            sampled = self.sampler.sample(out)
            self.scheduler.update(plan, sampled)
        except Exception as e:
            failed = plan.request_ids()
            self.abort_request(failed)
            raise StepError(failed, e) from e
""", """        out = self.runner.execute(plan)
        sampled = self.sampler.sample(out)
        self.scheduler.update(plan, sampled)
""", r"expected a StepError, the runner's exception escaped"),
    Mutant("engine_step", "the failed requests not aborted", "            self.abort_request(failed)\n", "",
           r"a failed step's requests are aborted: 'a' is still in the engine"),
    Mutant("recompute_step", "the first row's logits", "hidden[-1:]", "hidden[:1]",
           r"step 0: token \d+, but the logits of the last of the 10 tokens"),
    Mutant("recompute_step", "no prompt logits", "prompt_logits=prompt_logits(self.model, hidden, [(seq, 0, n, 0)])",
           "prompt_logits=[]", r"prompt_logprobs=2 was asked, and the output has none|entries for 11 tokens \(the runner returns the logits of the prompt rows"),
    Mutant("draw", "u not scaled by the row's total", "u[:, None].to(cdf.dtype) * total", "u[:, None].to(cdf.dtype)",
           r"row 1: u = .* token 2, not 0"),
    Mutant("draw", "one generator for every row",
           "u = torch.cat([torch.rand(1, generator=g, device=g.device) for g in generators]).to(probs.device)",
           "u = torch.rand(len(generators), generator=generators[0]).to(probs.device)",
           r"from its own generator|exactly one number from the row's generator"),
    Mutant("draw", "no fallback for an empty row", "        if bool(empty.any()):\n            idx = torch.where(empty, greedy_tokens(probs), idx)\n", "",
           r"row 3 has nothing to draw from"),
    Mutant("filter_probs", "top-p counts the token itself", "sorted_p.cumsum(dim=-1) - sorted_p", "sorted_p.cumsum(dim=-1)",
           r"top_p=0.7.*kept tokens \[1\], not \[1, 3\]"),
    Mutant("filter_probs", "min-p of 1, not of the largest", "thresh * probs.max(dim=-1, keepdim=True).values", "thresh",
           r"min_p=0.35: at least 0.35 \* 0.5\): kept tokens \[1\], not \[1, 3\]"),
    Mutant("filter_probs", "top-k keeps k + 1", "drop = rank >= k[:, None]", "drop = rank > k[:, None]",
           r"top_k=2: the two most likely\): kept tokens \[1, 2, 3\]"),
    # -- phase 2 ---------------------------------------------------------------------------------
    Mutant("allocate", "blocks for the new tokens only", "self.blocks_needed(table.num_tokens + num_tokens) - len(table)",
           "self.blocks_needed(num_tokens)", r"holds \d+ blocks of \d+: it needs exactly|must raise RuntimeError"),
    Mutant("allocate", "num_tokens not advanced", "        table.num_tokens += num_tokens\n", "",
           r"allocate\(\d+ tokens\) on a table of \d+ must leave it holding \d+ tokens"),
    Mutant("free", "blocks never given back", "self.release_block(block_id)", "pass",
           r"a block leaked after free|after freeing every table, \d+ of the pool's \d+ blocks are free"),
    Mutant("free", "num_tokens not reset", "        table.num_tokens = 0\n", "",
           r"free must empty the table: it still holds 0 blocks and \d+ tokens"),
    Mutant("free", "the table's list kept", "        table.block_ids.clear()\n", "",
           r"free must empty the table: it still holds \d+ blocks"),
    Mutant("write_kv", "V written where K goes", "index_copy_(0, slot_mapping, k)", "index_copy_(0, slot_mapping, v)",
           r"token 0's K is not in slot 13"),
    Mutant("write_kv", "always layer 0", "self.layer(layer_idx)", "self.layer(0)",
           r"token 0's K is not in slot 13 \(block 3, offset 1\) of layer 1"),
    Mutant("prepare_inputs", "positions from 0", "positions += range(start, start + n)", "positions += range(n)",
           r"positions continue after the computed tokens"),
    Mutant("prepare_inputs", "slots one ahead", "for p in range(start, start + n)]", "for p in range(start + 1, start + n + 1)]",
           r"position p's slot is block_ids\[p // 4\] \* 4 \+ p % 4"),
    Mutant("prepare_inputs", "seq_lens without the new tokens", "seq_lens.append(start + n)", "seq_lens.append(start)",
           r"seq_lens count each sequence's tokens after this step"),
    Mutant("decode_gather", "a slot past the end attended", ">= seq_lens[:, None]", "> seq_lens[:, None]",
           r"sequence 0 has 5 tokens: slots 0..4 are attended .* the mask attends slots \[0, 1, 2, 3, 4, 5\]"),
    Mutant("decode_gather", "blocks rounded down", "max_blocks = -(-max_seq_len // block_size)",
           "max_blocks = max_seq_len // block_size", r"blocks to gather are each sequence's first ceil\(9 / 4\) = 3"),
    # -- phase 4 ---------------------------------------------------------------------------------
    Mutant("prefill_attention", "the parts' weights swapped", "torch.lerp(own.float(), past.float(), share)",
           "torch.lerp(past.float(), own.float(), share)", r"the two parts' weights swapped"),
    Mutant("prefill_attention", "the cached keys masked causally", "vh[:, :, :c], 0.0, False)", "vh[:, :, :c], 0.0, True)",
           r"the cached keys masked causally"),
    Mutant("prefill_attention", "a prompt alone not causal", "is_causal=True, enable_gqa=True", "enable_gqa=True",
           r"9 queries after 0 cached keys.*the chunk's own keys seen without the causal mask"),
    Mutant("attend_block", "a query blind to its own key", "(k_pos[None, :] <= q_pos[:, None])",
           "(k_pos[None, :] < q_pos[:, None])", r"a query over its own key alone is wrong"),
    Mutant("attend_block", "the accumulator not rescaled", 'acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")',
           'acc = acc + tl.dot(p, v, input_precision="ieee")', r"within one block of \d+ keys are right and longer ones are not"),
    Mutant("attend_block", "the running sum not rescaled", "l_i = l_i * alpha + tl.sum(p, axis=1)", "l_i = l_i + tl.sum(p, axis=1)",
           r"within one block of \d+ keys are right and longer ones are not"),
    Mutant("merge_attn_states", "no max subtracted", "weight = tl.exp(lse - tl.max(lse, axis=0))", "weight = tl.exp(lse)",
           r"scores-near-100: it is what weighed by exp\(lse\) with no max subtracted"),
    Mutant("merge_attn_states", "not divided by the weights' sum", " / tl.sum(weight, axis=0)", "",
           r"it is what not divided by the sum of the weights gives"),
    # -- phase 5 ---------------------------------------------------------------------------------
    Mutant("quantize_int8", "a step of max/128", "clamp(min=1e-8) / 127", "clamp(min=1e-8) / 128",
           r"each row's scale is its own largest magnitude over 127"),
    Mutant("quantize_int8", "truncated, not rounded", "torch.round(w / scale[:, None])", "(w / scale[:, None]).trunc()",
           r"more than half a step .*q = round\(w / scale\)"),
    Mutant("quantize_int8", "the tensor's largest magnitude for every row", "w.abs().amax(dim=1)",
           "w.abs().amax().expand(w.shape[0])", r"each row's scale is its own largest magnitude over 127"),
    Mutant("quantize_int4", "16 steps, not 15", "((hi - lo) / 15)", "((hi - lo) / 16)",
           r"more than half a step .*scale = \(max - min\) / 15"),
    Mutant("quantize_int4", "floored, not rounded", "q = torch.round((g - lo[..., None]) / scale[..., None])",
           "q = torch.floor((g - lo[..., None]) / scale[..., None])", r"more than half a step .*q = round\(\(w - min\) / scale\)"),
    Mutant("pack_int4", "nibbles swapped", "q[:, 0::2] | (q[:, 1::2] << 4)", "(q[:, 0::2] << 4) | q[:, 1::2]",
           r"2j in the low nibble: .* got \[\[18, 240\]"),
    Mutant("pack_int4", "rows paired, not columns", "q[:, 0::2] | (q[:, 1::2] << 4)", "q[0::2] | (q[1::2] << 4)",
           r"each row's columns 2j and 2j\+1 share a byte"),
    Mutant("write_quantized_kv", "K and V swapped", "((0, k), (1, v))", "((0, v), (1, k))",
           r"token 0's K, slot 6 .*: the stored values are not quantize_kv's \(they are the V of the token\)"),
    Mutant("write_quantized_kv", "scales not stored",
           "            self.scales[layer_idx, i].view(-1, q.shape[1]).index_copy_(0, slot_mapping, scale)\n", "",
           r"the stored scales are not quantize_kv's"),
    Mutant("dequant_tile", "nibbles swapped", "byte & 0xF, byte >> 4", "byte >> 4, byte & 0xF",
           r"int4 weights.*column 2j read from the high nibble"),
    Mutant("dequant_tile", "the zero point left out", "return q * s + z", "return q * s",
           r"int4 weights.*the zero point left out"),
    # -- phase 6 ---------------------------------------------------------------------------------
    Mutant("ngram_propose", "the latest match", "start = int(hits[0]) + n", "start = int(hits[-1]) + n",
           r"the earliest match \(of \[1, 2, 3\] at 0 and at 6\) proposes what followed it: .* got \[7, 8\]"),
    Mutant("ngram_propose", "the shortest n first", "range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1)",
           "range(self.min_n, min(self.max_n, len(tokens) - 1) + 1)", r"the longest n that matches first .* got \[8, 2\]"),
    Mutant("rejection_sample", "the replacement drawn from p",
           "residual = (p - draft_probs[j].to(p.dtype)).clamp_(min=0.0)", "residual = p.clone()",
           r"drawn from p, not from max\(0, p - q\)"),
    Mutant("rejection_sample", "the bonus from the wrong row", "target_probs[-1][None]", "target_probs[-2][None]",
           r"the bonus token drawn from another row"),
    Mutant("rejection_sample", "accepted with q/p", "if u * q_d < float(p[d]):", "if u * float(p[d]) < q_d:",
           r"accepted with probability min\(1, q/p\)"),
    Mutant("truncate_table", "blocks not given back", "allocator.release_block(table.block_ids.pop())",
           "table.block_ids.pop()", r"block \d+, left with no token, goes back to the pool"),
    Mutant("truncate_table", "blocks counted by floor", "keep = allocator.blocks_needed(num_tokens)",
           "keep = num_tokens // allocator.block_size", r"10 tokens rolled back to 5 \(blocks of 4\): the first 2 blocks"),
    Mutant("truncate_table", "num_tokens may grow", "table.num_tokens = min(table.num_tokens, num_tokens)",
           "table.num_tokens = num_tokens", r"it only shrinks"),
    # -- phase 7 ---------------------------------------------------------------------------------
    Mutant("bucket_for", "a strictly larger bucket", "if s >= n:", "if s > n:",
           r"bucket_for\(1, \[1, 2, 4, 8\]\) must be 1, the smallest bucket that holds 1 rows, got 2"),
    Mutant("bucket_for", "the largest bucket first", "for s in sizes:", "for s in reversed(sizes):",
           r"bucket_for\(1, \[1, 2, 4, 8\]\) must be 1, the smallest bucket that holds 1 rows, got 8"),
    Mutant("fill_buffers", "the token before the query", "ids = token_ids.gather(1, pos[:, None])[:, 0]",
           "ids = token_ids.gather(1, (pos - 1)[:, None])[:, 0]", r"input_ids: each row's query is its token at position num_computed"),
    Mutant("fill_buffers", "the query's own key not counted", "self.seq_lens[:n].copy_(pos + 1, non_blocking=True)",
           "self.seq_lens[:n].copy_(pos, non_blocking=True)", r"seq_lens: a row attends to num_computed \+ 1 keys"),
    Mutant("fill_buffers", "padded rows written to block 0", "self.slot_mapping[n:bucket], self.block_tables[n:bucket, 0] = self.scratch_block * bs, self.scratch_block",
           "self.slot_mapping[n:bucket], self.block_tables[n:bucket, 0] = 0, self.scratch_block",
           r"slot_mapping: .* a padded row's the scratch block's first"),
    Mutant("remove_row", "the moved request keeps its old row", "            self.row_of[self.seqs[r].seq_id] = r\n", "",
           r"the request moved from the last row into the hole must be found there"),
    Mutant("remove_row", "num_computed not moved", "for t in (self.num_tokens, self.num_computed, self.num_blocks,",
           "for t in (self.num_tokens, self.num_blocks,", r"every per-row field moves with the request"),
    Mutant("remove_row", "the last row left behind", "        self.num_reqs = last\n", "",
           r"2 rows are left, row 0 holding the moved request and row 2 empty: num_reqs 3"),
    Mutant("update_row", "a new table copied from its old count", "start = int(self.num_blocks[r]) if table is self._tables[r] else 0",
           "start = int(self.num_blocks[r])", r"a re-admitted request has a new table object: its blocks are copied from the first"),
    Mutant("update_row", "num_computed not updated", "        self.num_computed[r] = seq.num_computed_tokens\n", "",
           r"num_computed follows the request's: 0 vs 8"),
    Mutant("compiled_run", "shapes_seen not recorded", "        self.shapes_seen.add(bucket == 1)\n", "",
           r"run records each shape it ran, bucket == 1, in shapes_seen"),
    Mutant("compiled_run", "every row of the buffers", "ids, positions = b.input_ids[:bucket], b.positions[:bucket]",
           "ids, positions = b.input_ids, b.positions", r"the graph takes the first 1 rows of the buffers\' input_ids and positions"),
    Mutant("compiled_run", "the layers not set", "_STEP.attention, _STEP.layers = self.attention(b.metadata(bucket)), self.opaque_layers",
           "_STEP.attention = self.attention(b.metadata(bucket))", r"while the graph runs, the forward context holds this step\'s attention.*and the model\'s layers"),
    Mutant("compiled_run", "the C++ step left set", "            use_step(None)\n", "", r"taken back\s+after the graph, use_step\(None\)|taken back after the graph, use_step\(None\)"),
    Mutant("compiled_run", "batch 1 on the dynamic graph", "graph = self.graphs[bucket == 1]", "graph = self.graphs[False]", r"a step of 1 row\(s\) calls the graph of its shape"),
    # -- phase 8 ---------------------------------------------------------------------------------
    Mutant("head_ranges", "query heads split apart from their KV heads", "return (kv[0] * group, kv[1] * group), kv",
           "return shard_range(num_heads, rank, world), kv", r"are on a rank without their KV head"),
    Mutant("head_ranges", "a shared KV head by rank modulo", "kv_head = rank // (world // num_kv_heads)",
           "kv_head = rank % num_kv_heads", r"8 query heads over 2 KV heads, 4 ranks: rank 1 .* on a rank without their KV head"),
    Mutant("row_parallel", "no all-reduce", "return self.group.all_reduce(self.linear(x))", "return self.linear(x)",
           r"goes through the group's all_reduce once .* called 0 times"),
    Mutant("row_parallel", "the input summed, not the product", "return self.group.all_reduce(self.linear(x))",
           "return self.linear(self.group.all_reduce(x))", r"all_reduce got a \(3, 6\) tensor \(the input\?\)"),
    Mutant("vocab_embedding", "other ranks' ids not zeroed", "x * inside[:, None].to(x.dtype)", "x",
           r"rank 0 holds ids 0..3: for id 9 its part must be zeros"),
    Mutant("vocab_embedding", "ids not shifted to the rank's rows", "local = input_ids - self.start", "local = input_ids",
           r"rank 1 holds ids 4..6: for id \d its part must be"),
    Mutant("vocab_embedding", "no all-reduce", "return self.group.all_reduce(x * inside[:, None].to(x.dtype))",
           "return x * inside[:, None].to(x.dtype)", r"goes through the group's all_reduce once"),
    Mutant("column_parallel", "a view of the whole matrix", "linear.weight.data[start:stop].clone()",
           "linear.weight.data[start:stop]", r"still holds the whole matrix's memory"),
    Mutant("column_parallel", "the bias not cut", "    if linear.bias is not None:\n        linear.bias = nn.Parameter(linear.bias.data[start:stop].clone(), requires_grad=False)\n",
           "", r"rank 0 keeps outputs 0..3: weight \(4, 6\) and bias \(4,\), got \(4, 6\) and \(10,\)"),
    Mutant("column_parallel", "out_features not updated", "    linear.out_features = stop - start\n", "",
           r"out_features must say how many outputs the shard has, 4: got 10"),
    # -- phase 3 ---------------------------------------------------------------------------------
    Mutant("match_prefix", "no token left to compute", "range((len(token_ids) - 1) // bs)", "range(len(token_ids) // bs)",
           r"must give 1 block, got 2: at least one token is left to compute"),
    Mutant("match_prefix", "keys not chained", "            parent = hash(key)\n", "",
           r"each key chains the hash of the one before.*gives 1 blocks"),
    Mutant("cache_full_blocks", "hash not chained on", "            table.last_hash = hash(key)\n", "",
           r"each key chains the hash of the one before.*gives 1 blocks"),
    Mutant("cache_full_blocks", "a block keyed before it is full", "(table.num_hashed_blocks + 1) * bs <= num_computed",
           "table.num_hashed_blocks * bs < num_computed", r"the third block filled while decoding\): match_prefix of them gives 2"),
    Mutant("schedule", "preempts the oldest", "victim = self.running[-1]", "victim = self.running[0]",
           r"the newest running sequence, c, must be preempted, got \['a'\]"),
    Mutant("schedule", "a seat past max_num_seqs", "len(self.running) < self.max_num_seqs",
           "len(self.running) <= self.max_num_seqs", r"max_num_seqs=2: two sequences run at most"),
    Mutant("schedule", "admissions not charged to the budget",
           "            budget -= num_new\n        self.kv_usage", "        self.kv_usage",
           r"a step's budget is 32 tokens.*scheduled \[\('a', 20\), \('b', 20\)\]"),
    Mutant("preempt", "back of the waiting queue", "self.waiting.appendleft(seq)", "self.waiting.append(seq)",
           r"back to the front of the waiting queue.*waiting is \['d', 'c'\]"),
    Mutant("preempt", "num_computed_tokens not reset", "        seq.num_computed_tokens = 0\n", "",
           r"must restart from 0 computed tokens .*got 3"),
    Mutant("preempt", "status left RUNNING", "        seq.status = SequenceStatus.PREEMPTED\n", "",
           r"status must be PREEMPTED, got RUNNING"),
    # -- phase 9 ---------------------------------------------------------------------------------
    Mutant("fill_placeholders", "matched by row, not by sequence",
           "            seq.token_ids[-1] = sampled[seq.seq_id]",
           "            seq.token_ids[-1] = before.token_ids[min(view.scheduled.index((seq, _)), len(before.seqs) - 1)][-1]",
           r"async scheduling.*request \d+'s tokens differ from token \d+ on"),
    Mutant("fill_placeholders", "the token appended after the placeholder",
           "            seq.token_ids[-1] = sampled[seq.seq_id]", "            seq.token_ids.append(sampled[seq.seq_id])",
           r"StepError|a step failed|IndexError|index out of range|out of bounds"),
    Mutant("fill_placeholders", "placeholders left as they are",
           "            seq.token_ids[-1] = sampled[seq.seq_id]", "            pass",
           r"StepError|a step failed|IndexError|index out of range|out of bounds"),
    Mutant("core_message", "an abort ignored", "            self.engine.abort_request(message.request_ids)\n", "",
           r"the request a stop string ended in the front"),
    Mutant("core_message", "a record only the core sends not refused",
           """            self.refuse(f"a {type(message).__name__} message, which only the engine core sends")""",
           "            pass", r"the bad message was not refused by name"),
    Mutant("front_outputs", "the core not told of a stop string", "                self._send(Abort([delta.request_id]))",
           "                pass", r"the request a stop string ended in the front"),
    Mutant("front_outputs", "finished only when the core says so", "        if finished:\n            del self._open",
           "        if delta.finished:\n            del self._open", r"the request a stop string ended in the front"),
    # -- phase 10 --------------------------------------------------------------------------------
    Mutant("tier_lru", "the most recently used evicted",
           "next((d for d, s in self.index.items() if s not in self.pinned), None)",
           "next((d for d, s in reversed(self.index.items()) if s not in self.pinned), None)",
           r"reuses the slot of its least recently used block \(b\)"),
    Mutant("tier_lru", "a pinned slot evicted", "next((d for d, s in self.index.items() if s not in self.pinned), None)",
           "next((d for d, s in self.index.items()), None)", r"with c pinned, the least recently used block that is not pinned"),
    Mutant("tier_lru", "the evicted block not forgotten", "slot = self.index.pop(victim)", "slot = self.index[victim]",
           r"b \(least recently used\) should have been forgotten"),
    Mutant("matched_tokens", "no token left to compute", "last = (seq.num_tokens - 1) // bs", "last = seq.num_tokens // bs",
           r"4 blocks \(16 tokens\) may be matched, leaving one token to compute; got 20"),
    Mutant("matched_tokens", "a gap skipped", "                break\n", "                continue\n",
           r"only block 0 \(4 tokens\) matches, a prefix stops at a gap; got 12"),
    Mutant("matched_tokens", "counted from the first block, not the pool's last",
           "self.block_digests(seq, last)[num_computed_tokens // bs:]", "self.block_digests(seq, last)",
           r"with 8 tokens in the pool, blocks 2 and 3 \(8 tokens\) are the tier's to add; got 16"),
    Mutant("layer_load", "layer 0 loaded into every layer", "self.store.block(slot)[layer]", "self.store.block(slot)[0]",
           r"layer 1's K/V of block 0 loaded back differ from the block saved"),
    Mutant("layer_load", "K loaded, V not", "self.kv[layer, :, block].copy_(self.store.block(slot)[layer])",
           "self.kv[layer, 0, block].copy_(self.store.block(slot)[layer, 0])",
           r"layer 0's K/V of block 0 loaded back differ from the block saved"),
    Mutant("layer_load", "the layer not marked loaded", "        self.loaded.add(layer)\n", "",
           r"the loads of layers \[0, 1\] were not made before their attention ran"),
    # -- phase 11 --------------------------------------------------------------------------------
    Mutant("first_needed_block", "the window one key short", "num_computed - self.sliding_window + 1",
           "num_computed - self.sliding_window + 2", r"a query at position 10 sees keys 3\.\.10 .*its first block is 0, got 1"),
    Mutant("first_needed_block", "the window one key long", "num_computed - self.sliding_window + 1",
           "num_computed - self.sliding_window", r"a query at position 11 sees keys 4\.\.11 .*its first block is 1, got 0"),
    Mutant("first_needed_block", "below 0 not clamped", "max(0, num_computed - self.sliding_window + 1)",
           "(num_computed - self.sliding_window + 1)", r"a query at position 0 sees keys 0\.\.0 .*its first block is 0, got -2"),
    Mutant("hit_length", "the window asked for every block", "hits[group.spec.first_needed_block(h * group.spec.block_size): h]",
           "hits[:h]", r"a window needs only its own blocks cached"),
    Mutant("hit_length", "one pass over the groups", "                changed = True\n", "",
           r"a hit length is one every group serves"),
    Mutant("remove_skipped_blocks", "the blocks nulled, not given back", "            self.release_block(table.block_ids[i])\n",
           "", r"the pool has \d+ blocks in use"),
    Mutant("remove_skipped_blocks", "the last block before the window kept", "i = spec.first_needed_block(table.num_tokens) - 1",
           "i = spec.first_needed_block(table.num_tokens) - 2", r"the pool has \d+ blocks in use"),
]


# -- the child: grades the wrong versions named on its command line ------------------------------

class MutantLoop:
    """A pytest plugin: instead of pytest's run, each wrong version's checks, recorded as JSON lines."""

    def __init__(self, mutants: list[Mutant], workspace: Path, record: Path):
        self.mutants, self.workspace, self.record = mutants, workspace, record

    def _write(self, **record) -> None:
        with open(self.record, "a") as f:
            f.write(json.dumps(record) + "\n")

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtestloop(self, session):
        from _pytest.runner import runtestprotocol

        from tinyvllm.entrypoints import learn

        tasks = {e.name: e for e in learn.exercises()}
        for m in self.mutants:
            e = tasks[m.task]
            mark = f"phase{e.phase:02d}"
            items = [i for i in session.items if i.originalname in e.checks and i.get_closest_marker(mark)]
            items.sort(key=lambda i: e.checks.index(i.originalname))   # stable: run order within a check
            self._write(mutant=m.id, start=time.time())
            with _applied(m, e, self.workspace):
                for k, item in enumerate(items):
                    self._write(mutant=m.id, check=item.nodeid, time=time.time())
                    reports = runtestprotocol(item, log=False, nextitem=items[k + 1] if k + 1 < len(items) else None)
                    bad = next((r for r in reports if r.failed), None)
                    message = ""
                    if bad is not None:
                        crash = getattr(bad.longrepr, "reprcrash", None)
                        message = crash.message if crash is not None else str(bad.longrepr)
                    self._write(mutant=m.id, case=item.nodeid, outcome="failed" if bad else "passed",
                                message=message, text=bad.longreprtext if bad else "")
                    if bad is not None:
                        session._setupstate.teardown_exact(None)
                        break
            for module in {item.module for item in items}:   # caches a test module keeps (_LLMS, ...)
                for name, value in vars(module).items():
                    if name.startswith("_") and name.isupper() and isinstance(value, dict):
                        value.clear()
            self._write(mutant=m.id, done=True)
        return True


def _module_name(e, workspace: Path) -> tuple[str, Path]:
    """The module that holds task `e` and its file in the workspace."""
    from phases.workspace import FOUNDATION_COPIES

    for module in FOUNDATION_COPIES.get(e.package, ()):
        if module.rpartition(".")[2] + ".py" == e.file:
            return module, workspace / e.package / e.file
    return f"phases.{e.package}.{e.file[:-3]}", workspace / e.package / e.file


class _applied:
    """Within the block, task `e`'s body is mutant `m`'s: in the workspace's file and in the code of
    the function the process has loaded."""

    def __init__(self, m: Mutant, e, workspace: Path):
        self.m, self.e, self.workspace = m, e, workspace

    def __enter__(self):
        import importlib
        import inspect

        module, self.path = _module_name(self.e, self.workspace)
        self.text = self.path.read_text()
        mutated = mutate(self.text, self.m)
        self.path.write_text(mutated)
        obj = importlib.import_module(module)
        for part in self.e.function.split("."):
            obj = inspect.getattr_static(obj, part) if isinstance(obj, type) else getattr(obj, part)
        obj = inspect.unwrap(getattr(obj, "__func__", obj))
        self.fn = getattr(obj, "fn", obj)          # a Triton kernel: the Python function it wraps
        self.code = self.fn.__code__
        self.fn.__code__ = _find_code(compile(mutated, str(self.path), "exec"), self.e.function)
        return self

    def __exit__(self, *exc):
        self.fn.__code__ = self.code
        self.path.write_text(self.text)


def _find_code(code, qualname: str):
    for const in code.co_consts:
        if hasattr(const, "co_qualname"):
            if const.co_qualname == qualname:
                return const
            found = _find_code(const, qualname)
            if found is not None:
                return found
    return None


def mutate(text: str, m: Mutant) -> str:
    """`text` (a file holding task m.task) with m.old replaced by m.new inside the task's body."""
    from phases.workspace import regions

    lines = text.splitlines(keepends=True)
    for f, i, end in regions(text):
        if f["name"] == m.task:
            body = "".join(lines[i + 3:end])
            if body.count(m.old) != 1:
                raise ValueError(f"{m.id}: {m.old!r} is {body.count(m.old)} times in the body of {m.task}, not once")
            return "".join(lines[:i + 3]) + body.replace(m.old, m.new) + "".join(lines[end:])
    raise ValueError(f"{m.id}: no exercise {m.task} in the file")


def _child(argv: list[str]) -> int:
    workspace, record, ids = Path(argv[0]), Path(argv[1]), json.loads(argv[2])
    chosen = [m for m in MUTANTS if m.id in ids]
    from tinyvllm.entrypoints import learn
    folders = sorted({f"phases/{learn.phase_package(e.phase)}" for e in learn.exercises()
                      if e.name in {m.task for m in chosen}})
    # as `learn check` collects: without the notebooks and the site (whose runs a session starts in
    # the background when it is collected)
    return pytest.main([*folders, "tests", f"--ignore={Path(__file__).resolve()}", "-m", "not docs and not notebooks",
                        "-p", "no:cacheprovider", "-q", "--check-timeout=120", "-o", "addopts="],
                       plugins=[MutantLoop(chosen, workspace, record)])


# -- the parent: makes the workspace, runs the child, grades what it recorded -----------------------

def _workspace(folder: Path) -> Path:
    """A copy of every phase with every task the reference's (what `learn solve` leaves)."""
    import io

    from tinyvllm.entrypoints import learn

    for phase in learn.phases.PHASES:
        learn.start(phase, folder, force=True, out=io.StringIO())
        for e in learn.exercises(phase):
            learn.solve(phase, folder, e.name, out=io.StringIO())
    return folder


def grade_mutants(mutants: list[Mutant], tmp: Path, log=None, env: dict[str, str] | None = None
                  ) -> dict[str, tuple[str, str]]:
    """mutant id -> (status, detail) as `learn check` reports the task, for each of `mutants`; the
    grading process gets `env` (by default this process's environment)."""
    from tinyvllm.entrypoints import learn
    from tinyvllm.entrypoints.learn_run import Case, how_it_ended, plain, test_name

    tasks = {e.name: e for e in learn.exercises()}
    results: dict[str, tuple[str, str]] = {}
    cases: dict[str, list[Case]] = {m.id: [] for m in mutants}
    left = list(mutants)
    while left:
        workspace = _workspace(tmp / "workspace")
        record = tmp / "record.jsonl"
        record.write_text("")
        child_env = {**(os.environ if env is None else env), "TINYVLLM_WORKSPACE": str(workspace),
                     "PYTHONPATH": str(REPO)}
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), str(workspace), str(record),
                               json.dumps([m.id for m in left])], cwd=REPO, env=child_env, stdout=log,
                              stderr=subprocess.STDOUT if log is not None else None, timeout=1800)
        running = {}
        for line in record.read_text().splitlines():
            r = json.loads(line)
            if "case" in r:
                cases[r["mutant"]].append(Case(test_name(r["case"]), r["case"], r["outcome"], plain(r["message"]),
                                               r["text"]))
            elif "check" in r:
                running[r["mutant"]] = r["check"]
            elif r.get("done"):
                running.pop(r["mutant"], None)
                results[r["mutant"]] = None
        crashed = [m for m in left if m.id in running]
        if crashed:   # one at most: the one under way when the process died
            m = crashed[0]
            nodeid = running[m.id]
            cases[m.id].append(Case(test_name(nodeid), nodeid, "failed", f"the process {how_it_ended(proc.returncode)}",
                                    "", crashed=True))
            results[m.id] = None
        elif proc.returncode not in (0, 5):
            raise RuntimeError(f"the grading process ended with {proc.returncode} outside any wrong version")
        left = [m for m in left if m.id not in results]
    out = {}
    for m in mutants:
        e = tasks[m.task]
        phase_tasks = learn.exercises(e.phase)
        graded = learn.grade(phase_tasks, cases[m.id], set(), {t.name for t in phase_tasks} - {m.task})
        out[m.id] = next((s, d) for t, s, d in graded if t.name == m.task)
    return out


# -- the tests ------------------------------------------------------------------------------------

def test_every_task_has_two_wrong_versions():
    """At least two per task, each a change of the task's current reference body."""
    from tinyvllm.entrypoints import learn

    tasks = {e.name: e for e in learn.exercises()}
    counts = dict.fromkeys(tasks, 0)
    texts = {}
    for m in MUTANTS:
        e = tasks.get(m.task)
        assert e is not None, f"{m.id}: no task {m.task}"
        mutate(texts.setdefault(e.path, (REPO / e.path).read_text()), m)   # its piece is in the body, once
        counts[m.task] += 1
    short = {task: n for task, n in counts.items() if n < 2}
    assert not short, f"tasks with fewer than two wrong versions: {short}"
    assert len({m.id for m in MUTANTS}) == len(MUTANTS), "two wrong versions share a name"


def start_in_background(ids: set[str], after: list[Future] = ()) -> Future:
    """Grade the wrong versions `ids` in a thread once `after` (the notebooks' runs and the site's
    build) are done, their grading process beside the other tests as the notebooks ran, and return
    at once a Future of `grade_mutants`' result. The session starts it when it is collected
    (conftest.py); the tests of this file come after the others and collect it."""
    future, env = Future(), dict(os.environ)   # the environment now, before a test changes it

    def run():
        wait(after)
        if future.set_running_or_notify_cancel():   # False: the session ended first
            tmp = Path(tempfile.mkdtemp(prefix="tinyvllm-mutants-"))
            try:
                with open(tmp / "log.txt", "w") as log:
                    future.set_result(grade_mutants([m for m in MUTANTS if m.id in ids], tmp, log, env))
            except BaseException as e:
                future.set_exception(e)
    threading.Thread(target=run, name="mutants", daemon=True).start()
    return future


def chosen_ids(items) -> set[str]:
    """The wrong versions a session's `items` grade."""
    return {item.callspec.params["mutant"].id for item in items
            if getattr(item, "originalname", "") == "test_a_wrong_version_fails_its_checks"}


@pytest.fixture(scope="module")
def graded(request):
    """The grades of the wrong versions this session runs, all in one process (started in the
    background when the session was collected, or here)."""
    from conftest import BACKGROUND_RUNS

    run = request.config.stash.get(BACKGROUND_RUNS, {}).get("mutants")
    return (run or start_in_background(chosen_ids(request.session.items))).result()


def _params():
    """Each wrong version; those whose task is checked only in Triton's interpreter are marked
    `interpreter` (the interpreter's cases take seconds each, and the inner loop leaves them out)."""
    from tinyvllm.entrypoints import learn

    checks = {e.name: e.checks for e in learn.exercises()}
    return [pytest.param(m, id=m.id, marks=[pytest.mark.interpreter] if all("interpreter" in c for c in checks[m.task])
                         else []) for m in MUTANTS]


@pytest.mark.parametrize("mutant", _params())
def test_a_wrong_version_fails_its_checks(mutant, graded):
    status, detail = graded[mutant.id]
    assert status == "failed", f"{mutant.id}: learn check reports the task {status}: {detail}"
    assert re.search(mutant.expect, detail), (
        f"{mutant.id}: the first failing line does not name the mistake (/{mutant.expect}/): {detail}")


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))
