"""The persistent batch under random add / append token / finish / abort / preempt sequences
(a hypothesis state machine): its rows always equal a batch built from scratch, and a swap
copies only the moved row's valid tokens and blocks."""

from __future__ import annotations

import itertools

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from phases.p02_paged_kv.block_allocator import BlockTable
from phases.p07_cuda_graphs.input_batch import InputBatch
from tinyvllm.sampling_params import SamplingParams

MAX_REQS, MAX_LEN, BS = 6, 40, 4
MAX_BLOCKS = MAX_LEN // BS
_ids = itertools.count()
_blocks = itertools.count()


class FakeSeq:
    """What InputBatch reads from a Sequence."""

    def __init__(self, n: int, params: SamplingParams):
        self.seq_id = next(_ids)
        self.token_ids = [int(t) for t in torch.randint(0, 1000, (n,))]
        self.params = params
        self.generator = None if params.is_greedy else torch.Generator().manual_seed(self.seq_id)
        self.block_table = BlockTable()
        self.num_computed_tokens = 0
        self.grow()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def grow(self) -> None:
        """Blocks for every token, as the allocator gives them; all but the last computed."""
        while len(self.block_table.block_ids) * BS < self.num_tokens:
            self.block_table.block_ids.append(next(_blocks))
        self.num_computed_tokens = self.num_tokens - 1


params_st = st.builds(SamplingParams, temperature=st.sampled_from([0.0, 0.7, 1.3]),
                      top_k=st.sampled_from([0, 1, 5]), top_p=st.sampled_from([1.0, 0.9]),
                      min_p=st.sampled_from([0.0, 0.1]))


def batch_state(b: InputBatch) -> dict[int, tuple]:
    """Every row's valid contents, keyed by seq_id (for comparing with a batch built from
    scratch: row order may differ, contents may not)."""
    out = {}
    for r in range(b.num_reqs):
        n, nb = int(b.num_tokens[r]), int(b.num_blocks[r])
        out[b.seqs[r].seq_id] = (
            b.token_ids[r, :n].tolist(), int(b.num_computed[r]), b.block_table[r, :nb].tolist(),
            float(b.temperature[r]), int(b.top_k[r]), float(b.top_p[r]), float(b.min_p[r]), b.generators[r])
    return out


class InputBatchMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.batch = InputBatch(MAX_REQS, MAX_LEN, MAX_BLOCKS, 1000)
        self.running: list[FakeSeq] = []

    def sync(self) -> None:
        rows = self.batch.sync(self.running)
        assert sorted(rows) == list(range(len(self.running)))
        self.batch.check(self.running, rows)   # checked mode never refuses a batch in order

    @precondition(lambda self: len(self.running) < MAX_REQS)
    @rule(n=st.integers(1, MAX_LEN - 10), params=params_st)
    def add(self, n, params):
        self.running.append(FakeSeq(n, params))
        self.sync()

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, MAX_REQS - 1), k=st.integers(1, 3))
    def append_tokens(self, i, k):
        seq = self.running[i % len(self.running)]
        if seq.num_tokens + k <= MAX_LEN:
            seq.token_ids += [int(t) for t in torch.randint(0, 1000, (k,))]
            seq.grow()
        self.sync()

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, MAX_REQS - 1))
    def finish(self, i):
        seq = self.running.pop(i % len(self.running))
        b = self.batch
        r, last = b.row_of[seq.seq_id], b.num_reqs - 1
        moved = 0 if r == last else int(b.num_tokens[last] + b.num_blocks[last])
        before = b.elements_copied
        b.remove(seq.seq_id)
        assert b.elements_copied - before == moved  # only the moved row's valid elements

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, MAX_REQS - 1))
    def abort(self, i):
        self.running.pop(i % len(self.running))
        self.sync()  # the step after: its row goes

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, MAX_REQS - 1))
    def preempt_and_readmit(self, i):
        # recompute preemption: the blocks are freed; on re-admission a new table is allocated
        seq = self.running[i % len(self.running)]
        seq.block_table = BlockTable()
        seq.grow()
        self.sync()

    @invariant()
    def equals_batch_from_scratch(self):
        fresh = InputBatch(MAX_REQS, MAX_LEN, MAX_BLOCKS, 1000)
        fresh.sync(self.running)
        assert self.batch.num_reqs == len(self.running)
        assert batch_state(self.batch) == batch_state(fresh)
        for s in self.running:
            st_ = batch_state(self.batch)[s.seq_id]
            assert st_[0] == s.token_ids and st_[2] == s.block_table.block_ids
            assert st_[1] == s.num_computed_tokens


TestInputBatch = InputBatchMachine.TestCase
TestInputBatch.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_swap_copies_valid_tokens_only():
    b = InputBatch(4, 1000, 250, 1000)
    seqs = [FakeSeq(n, SamplingParams(temperature=0)) for n in (900, 5, 7)]
    b.sync(seqs)
    b.remove(seqs[0].seq_id)            # row 2 (7 tokens, 2 blocks) moves into row 0
    assert b.elements_copied == 7 + 2
    assert b.token_ids[0, :7].tolist() == seqs[2].token_ids
    assert b.row_of == {seqs[2].seq_id: 0, seqs[1].seq_id: 1}


def test_checked_batch_names_the_row_a_slip_left_behind():
    """Checked mode (`InputBatch.check`, after each sync): a remove that moves the last request
    into the freed row but leaves its row_of entry on the old row, or an update that leaves a
    stale block, is a ValueError naming the request and the row, before a kernel reads the row."""
    b = InputBatch(4, MAX_LEN, MAX_BLOCKS, 1000)
    seqs = [FakeSeq(n, SamplingParams(temperature=0)) for n in (5, 9, 7)]
    b.sync(seqs)
    rows = b.sync(seqs[1:])                  # seqs[0] leaves: seqs[2] moves from row 2 into row 0
    b.check(seqs[1:], rows)
    b.row_of[seqs[2].seq_id] = 2             # the slip: its row_of still names the row it left
    with pytest.raises(ValueError, match=rf"row_of puts seq {seqs[2].seq_id} in row 2, but of the 2 rows that one "
                                         r"holds no request \(a request moved into a freed row"):
        b.check(seqs[1:], [1, 2])
    b.row_of[seqs[2].seq_id] = 0
    b.block_table[1, 0] += 1                 # a block id the request does not own
    with pytest.raises(ValueError, match=rf"row 1 holds seq {seqs[1].seq_id} with \(tokens, computed, blocks"):
        b.check(seqs[1:], rows)
