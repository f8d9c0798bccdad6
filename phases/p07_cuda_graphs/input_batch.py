"""The persistent batch (vLLM V1's `InputBatch`): one row per running request, kept between steps.

Phases 2-6 rebuild every input tensor of a step from Python lists: each running sequence's
tokens, positions, slots and block table, every step. Here the batch *persists*: a request gets a
row when it joins, the row is updated in place with what changed (one new token, a new block),
and it is given back when the request leaves. So the CPU work of a step is proportional to what
changed, not to batch x length.

    row r:  token_ids[r, :num_tokens[r]]       prompt + output tokens       (R, max_model_len)
            num_computed[r]                    tokens whose K/V is cached
            block_table[r, :num_blocks[r]]     its KV blocks                (R, max_blocks)
            temperature, top_k, top_p, min_p   its sampling params as tensors (R,)
            generators[r]                      its own torch.Generator (None when greedy)

Rows stay dense (0 .. num_reqs-1, no holes), so a step's inputs are the first num_reqs rows.
When the request of row r leaves, the *last* row moves into r, copying only its valid tokens
and blocks (`num_tokens[last]` + `num_blocks[last]` elements), not a whole max_model_len row:

    before: row 0 A | row 1 B (finishes) | row 2 C      after: row 0 A | row 1 C
"""

from __future__ import annotations

import torch

from tinyvllm.sequence import Sequence


class InputBatch:
    """Preallocated per-request tensors for up to `max_num_reqs` running requests.

    Args:
        max_num_reqs: rows (max_num_seqs).
        max_model_len: token columns of a row.
        max_blocks: block-table columns of a row (max_model_len / block_size, rounded up).
        vocab_size: the most top_k can keep (a larger top_k keeps them all).
    """

    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks: int, vocab_size: int):
        self.max_num_reqs, self.max_model_len, self.max_blocks = max_num_reqs, max_model_len, max_blocks
        self.vocab_size = vocab_size
        r = max_num_reqs
        # CPU tensors: the engine copies the few it needs into the device's static buffers
        self.token_ids = torch.zeros(r, max_model_len, dtype=torch.int64)   # (R, L)
        self.num_tokens = torch.zeros(r, dtype=torch.int64)                 # (R,)
        self.num_computed = torch.zeros(r, dtype=torch.int64)               # (R,)
        self.block_table = torch.zeros(r, max_blocks, dtype=torch.int64)    # (R, M)
        self.num_blocks = torch.zeros(r, dtype=torch.int64)                 # (R,)
        self.temperature = torch.zeros(r, dtype=torch.float32)              # (R,)
        self.top_k = torch.zeros(r, dtype=torch.int64)                      # (R,) 0 = off
        self.top_p = torch.ones(r, dtype=torch.float32)                     # (R,)
        self.min_p = torch.zeros(r, dtype=torch.float32)                    # (R,)
        self.generators: list[torch.Generator | None] = [None] * r
        self.seqs: list[Sequence | None] = [None] * r
        self._tables: list[object] = [None] * r  # the BlockTable object each row mirrors
        self.row_of: dict[int, int] = {}         # seq_id -> row
        self.num_reqs = 0
        self.elements_copied = 0  # token and block-table elements moved by swaps (for tests)

    # -- requests in and out -------------------------------------------------------------------
    def add(self, seq: Sequence) -> int:
        """Give `seq` the next free row, filled from scratch. Returns the row."""
        if seq.seq_id in self.row_of:
            raise ValueError(f"seq {seq.seq_id} already has row {self.row_of[seq.seq_id]}")
        if self.num_reqs == self.max_num_reqs:
            raise ValueError(f"the batch is full (max_num_reqs={self.max_num_reqs})")
        r, self.num_reqs = self.num_reqs, self.num_reqs + 1
        self.seqs[r], self.row_of[seq.seq_id] = seq, r
        n = seq.num_tokens
        self.token_ids[r, :n] = torch.tensor(seq.token_ids, dtype=torch.int64)
        self.num_tokens[r], self.num_blocks[r], self._tables[r] = n, 0, None
        self.update(seq)
        p = seq.params
        self.temperature[r], self.top_k[r] = p.temperature, min(max(p.top_k, 0), self.vocab_size)
        self.top_p[r], self.min_p[r] = p.top_p, p.min_p
        self.generators[r] = seq.generator
        return r

    def remove(self, seq_id: int) -> None:
        """Drop a request's row; the last row moves into the hole (valid elements only)."""
        # >>> exercise remove_row (2 stars): Drop a request's row of the persistent batch: the last row moves into the hole, copying only its valid tokens and blocks.
        # hint: every per-row tensor and list moves the same way; row_of of the moved request changes; count the elements copied in elements_copied.
        # checked by: test_swap_copies_valid_tokens_only, test_shrink_grow_cross_buckets_and_preempt
        r = self.row_of.pop(seq_id)
        last = self.num_reqs - 1
        if r != last:
            n, nb = int(self.num_tokens[last]), int(self.num_blocks[last])
            self.token_ids[r, :n] = self.token_ids[last, :n]
            self.block_table[r, :nb] = self.block_table[last, :nb]
            self.elements_copied += n + nb
            for t in (self.num_tokens, self.num_computed, self.num_blocks, self.temperature,
                      self.top_k, self.top_p, self.min_p):
                t[r] = t[last]
            for lst in (self.generators, self.seqs, self._tables):
                lst[r] = lst[last]
            self.row_of[self.seqs[r].seq_id] = r
        self.seqs[last] = self.generators[last] = self._tables[last] = None
        self.num_reqs = last
        # <<< exercise remove_row

    # -- what changed since the last step ------------------------------------------------------
    def update(self, seq: Sequence) -> None:
        """Copy into `seq`'s row what changed since it was last seen: new tokens, new blocks, the
        computed count. A request that was preempted and re-admitted has a new block table
        object: its blocks are copied again from the first."""
        # >>> exercise update_row (3 stars): Bring a request's row up to date with only what changed: new tokens, new blocks, the computed count.
        # hint: usually one new token and at most one new block; a re-admitted request (after preemption) has a new table object: copy its blocks from the first.
        # checked by: test_update_copies_what_changed_and_a_new_table_from_its_first_block, test_swap_copies_valid_tokens_only, test_shrink_grow_cross_buckets_and_preempt, test_every_bucket_gives_eager_tokens
        r = self.row_of[seq.seq_id]
        old, n = int(self.num_tokens[r]), seq.num_tokens
        if n > old:  # usually one token: the one sampled last step
            self.token_ids[r, old:n] = torch.tensor(seq.token_ids[old:n], dtype=torch.int64)
            self.num_tokens[r] = n
        table = seq.block_table
        ids = table.block_ids if table is not None else []
        start = int(self.num_blocks[r]) if table is self._tables[r] else 0
        if len(ids) > start:
            self.block_table[r, start:len(ids)] = torch.tensor(ids[start:], dtype=torch.int64)
        self.num_blocks[r], self._tables[r] = len(ids), table
        self.num_computed[r] = seq.num_computed_tokens
        # <<< exercise update_row

    def check(self, seqs: list[Sequence], rows: list[int]) -> None:
        """Checked mode, after `sync(seqs)` gave `rows`: the batch holds exactly `seqs`, each in its
        row, with its counts, its blocks and the token it feeds next, before any of it reaches a
        kernel. A slip in remove or update (a moved request left under its old row, a block not
        copied) is a ValueError naming the request and the row, not a wrong block read in C."""
        n = self.num_reqs
        for seq, r in zip(seqs, rows):
            if not (0 <= r < n and self.seqs[r] is seq):
                held = self.seqs[r] if 0 <= r < len(self.seqs) else None
                raise ValueError(f"InputBatch: row_of puts seq {seq.seq_id} in row {r}, but of the {n} rows that one "
                                 f"holds {'no request' if held is None else f'seq {held.seq_id}'} (a request moved "
                                 f"into a freed row must have its new row in row_of)")
        if n != len(seqs) or len(self.row_of) != n:
            raise ValueError(f"InputBatch: {len(seqs)} requests this step, but {n} rows and {len(self.row_of)} in row_of")
        # each tensor read once, as Python values (a few operators in all, not a few a row)
        tokens, computed, blocks = (t[:n].tolist() for t in (self.num_tokens, self.num_computed, self.num_blocks))
        tables = self.block_table[:n, :max(blocks, default=0)].tolist()
        width = self.token_ids.shape[1]
        at = [r * width + min(max(c, 0), width - 1) for r, c in enumerate(computed)]   # each row's next token
        feed = self.token_ids.take(torch.tensor(at, dtype=torch.int64)).tolist()
        for r, seq in enumerate(self.seqs[:n]):
            ids = seq.block_table.block_ids if seq.block_table is not None else []
            have = (tokens[r], computed[r], tables[r][:blocks[r]], feed[r] if computed[r] < tokens[r] else None)
            c = seq.num_computed_tokens
            want = (seq.num_tokens, c, ids, seq.token_ids[c] if c < seq.num_tokens else None)
            if have != want:
                raise ValueError(f"InputBatch: row {r} holds seq {seq.seq_id} with (tokens, computed, blocks, next "
                                 f"token) {have}, but the request has {want}")

    def sync(self, seqs: list[Sequence]) -> list[int]:
        """Make the batch hold exactly `seqs` (this step's requests): remove the rows of those
        that left, add the new ones, update the others. Returns each seq's row, in order."""
        keep = {s.seq_id for s in seqs}
        for seq_id in [sid for sid in self.row_of if sid not in keep]:
            self.remove(seq_id)
        rows = []
        for s in seqs:
            self.update(s) if s.seq_id in self.row_of else self.add(s)
            rows.append(self.row_of[s.seq_id])
            self.seqs[rows[-1]] = s   # the object this step's plan holds for the request
        return rows
