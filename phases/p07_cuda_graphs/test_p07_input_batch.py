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
    seqs = [FakeSeq(900, SamplingParams(temperature=0)), FakeSeq(5, SamplingParams(temperature=0.7, top_k=5)),
            FakeSeq(7, SamplingParams(temperature=1.3, top_p=0.9, min_p=0.1))]
    b.sync(seqs)
    moved = seqs[2]
    b.remove(seqs[0].seq_id)            # row 2 (7 tokens, 2 blocks) moves into row 0
    assert b.row_of == {moved.seq_id: 0, seqs[1].seq_id: 1}, (
        f"the request moved from the last row into the hole must be found there: row_of should be "
        f"{{{moved.seq_id}: 0, {seqs[1].seq_id}: 1}} (the removed request gone, the moved one at row 0), got {b.row_of}")
    assert b.num_reqs == 2 and b.seqs[0] is moved and b.seqs[2] is None, (
        f"2 rows are left, row 0 holding the moved request and row 2 empty: num_reqs {b.num_reqs}, "
        f"seqs {[s.seq_id if s is not None else None for s in b.seqs[:3]]}")
    assert b.elements_copied == 7 + 2, (
        f"a swap copies only the moved row's valid elements, its 7 tokens and 2 blocks: {b.elements_copied} copied")
    assert b.token_ids[0, :7].tolist() == moved.token_ids and b.block_table[0, :2].tolist() == moved.block_table.block_ids, (
        "row 0 holds the moved request's tokens and blocks")
    want = (7, 6, 2, 1.3, 0, 0.9, 0.1)
    got = (int(b.num_tokens[0]), int(b.num_computed[0]), int(b.num_blocks[0]), round(float(b.temperature[0]), 4),
           int(b.top_k[0]), round(float(b.top_p[0]), 4), round(float(b.min_p[0]), 4))
    assert got == want, (f"every per-row field moves with the request: row 0's (num_tokens, num_computed, num_blocks, "
                         f"temperature, top_k, top_p, min_p) should be {want}, got {got}")
    assert b.generators[0] is moved.generator, "row 0's generator is the moved request's"


def test_update_copies_what_changed_and_a_new_table_from_its_first_block():
    """A row brought up to date after 3 new tokens (one new block), then after a preemption and
    re-admission: a new table object, whose blocks are copied again from the first."""
    b = InputBatch(4, 64, 16, 1000)
    seq = FakeSeq(6, SamplingParams(temperature=0))
    b.sync([seq])
    seq.token_ids += [11, 12, 13]
    seq.grow()                                   # 9 tokens, 3 blocks, 8 computed
    b.sync([seq])
    row = (b.token_ids[0, :int(b.num_tokens[0])].tolist(), b.block_table[0, :int(b.num_blocks[0])].tolist(),
           int(b.num_computed[0]))
    assert row[0] == seq.token_ids, f"the row's tokens are the request's, new ones included: {row[0]} vs {seq.token_ids}"
    assert row[1] == seq.block_table.block_ids, f"the row's blocks are the table's, the new one included: {row[1]} vs {seq.block_table.block_ids}"
    assert row[2] == seq.num_computed_tokens, f"num_computed follows the request's: {row[2]} vs {seq.num_computed_tokens}"
    seq.block_table = BlockTable()               # preempted and re-admitted: other blocks, in a new table
    seq.grow()
    b.sync([seq])
    blocks = b.block_table[0, :int(b.num_blocks[0])].tolist()
    assert blocks == seq.block_table.block_ids, (
        f"a re-admitted request has a new table object: its blocks are copied from the first, "
        f"{seq.block_table.block_ids}; the row holds {blocks}")


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
