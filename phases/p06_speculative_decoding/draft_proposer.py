"""The draft-model proposer: a smaller model with the same tokenizer guesses k tokens.

The draft runs on phase 5's parts of its own (its own paged KV cache, allocator and block tables,
and phase 5's model runner), built from phase 5's recipe. For every sequence that speculates it
keeps a
`DraftSequence`: the target sequence's tokens, how many of them the draft has in its cache, and
the draft's block table. Each step it

1. catches up: computes the tokens the draft has not seen (the whole prompt the first time, then
   the one or two tokens the target emitted after the last accepted draft), which also gives the
   distribution q_0 of the next token; draws d_1 from it;
2. runs k - 1 more one-token steps, batched over all speculating sequences: d_2 .. d_k, each
   with q_j kept for the rejection sampler;
3. after verification rolls its own cache back to the target's accepted tokens (`sync`), and
   frees the cache of a sequence that leaves (`forget`).

Drafts are drawn as the target would sample (the same penalties, temperature, top-k/p, min-p,
the sequence's own generator), so q is the draft's *processed* distribution, and greedy drafts
are the draft's argmax.
"""

from __future__ import annotations

import torch

from phases.p01_naive_attention import EngineSetup, Parts
from phases.p02_paged_kv import BlockTable
from phases.p02_paged_kv.block_allocator import cdiv
from phases.p05_quantization import RECIPE as PHASE5
from tinyvllm.sampler import Sampler
from tinyvllm.sequence import Sequence
from tinyvllm.step import SchedulerOutput

from .rejection_sampler import SequenceAhead
from .rollback import truncate_table
from .spec_config import SpeculativeConfig


class DraftSequence:
    """What the draft's model runner reads of a sequence: tokens, cached count, blocks."""

    __slots__ = ("token_ids", "num_computed_tokens", "block_table")
    group = None  # a draft pass serves no request of its own: no prompt logprobs to record

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.block_table = BlockTable()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class DraftModelProposer:
    """Runs a draft model k steps ahead for every speculating sequence."""

    def __init__(self, target: EngineSetup, target_parts: Parts, spec: SpeculativeConfig):
        c = target.config
        k = spec.num_speculative_tokens
        # as many blocks as the target, plus room for k drafts per seat beyond its tokens
        blocks = target_parts.allocator.num_blocks + c.max_num_seqs * (cdiv(k, c.block_size) + 1)
        args = dict(dtype=c.dtype, device=c.device, block_size=c.block_size, num_kv_blocks=blocks,
                    max_model_len=target.max_model_len, enable_prefix_caching=False)
        if spec.quantization is not None:
            args["quantization"] = spec.quantization
        try:
            self.setup = EngineSetup.create(spec.model, args)
            self.parts = PHASE5.build(self.setup)
        except ValueError as e:
            raise ValueError(f"speculative_config: the draft model could not be built: {e}") from e
        if not _same_vocabulary(self.setup, target):
            raise ValueError(
                f"speculative_config['model']: the draft's vocabulary ({self.setup.model_config.vocab_size} "
                f"tokens, {spec.model}) differs from the target's ({target.model_config.vocab_size} "
                f"tokens); a draft must use the target's tokenizer")
        self.sampler = target_parts.sampler   # the target's rejection sampler: drafts drawn as it samples
        self.states: dict[Sequence, DraftSequence] = {}

    @torch.inference_mode()
    def propose(self, wanted: list[tuple[Sequence, int]]
                ) -> dict[Sequence, tuple[list[int], torch.Tensor | None]]:
        """wanted: (sequence, most drafts) pairs -> sequence: (drafts, q (k, V) or None if greedy)."""
        allocator, runner = self.parts.allocator, self.parts.runner
        active: list[tuple[Sequence, int, DraftSequence]] = []
        free = allocator.num_free_blocks
        for seq, k in wanted:
            st = self.states.setdefault(seq, DraftSequence())
            st.token_ids = list(seq.token_ids)
            need = allocator.blocks_needed(st.num_tokens + k - 1) - len(st.block_table)
            if need > free:
                continue  # no room in the draft's cache: this sequence decodes without drafts
            free -= need
            active.append((seq, k, st))
        drafts = {seq: [] for seq, _, _ in active}
        probs: dict[Sequence, list[torch.Tensor]] = {seq: [] for seq, _, _ in active}
        while active:
            plan = SchedulerOutput([(st, st.num_tokens - st.num_computed_tokens) for _, _, st in active])
            for st, n in plan.scheduled:
                allocator.allocate(st.block_table, n)
            logits = runner.execute(plan).logits                                   # (B, V)
            for st, n in plan.scheduled:
                st.num_computed_tokens += n
            for (seq, k, st), row in zip(active, logits):
                token, q = self._draw(row[None], seq, drafts[seq])
                drafts[seq].append(token)
                if q is not None:
                    probs[seq].append(q)
                st.token_ids.append(token)
            active = [(seq, k, st) for seq, k, st in active if len(drafts[seq]) < k]
        return {seq: (d, torch.stack(probs[seq]) if probs[seq] else None) for seq, d in drafts.items()}

    def _draw(self, logits: torch.Tensor, seq: Sequence, before: list[int]) -> tuple[int, torch.Tensor | None]:
        view = [SequenceAhead(seq, before)]
        if seq.params.is_greedy:
            return self.sampler.sampler(logits, view)[0][0], None
        q = self.sampler.target_probs(logits, view)                                  # (1, V)
        return Sampler.draw(q, [seq.generator])[0], q[0]

    def sync(self, running: list[Sequence]) -> None:
        """After a step: the draft keeps only the KV the target kept (the tokens before the
        target's `num_computed_tokens`: its accepted drafts, never a rejected one), and frees
        the cache of sequences that stopped running (preempted)."""
        keep = set(running)
        for seq in list(self.states):
            if seq not in keep:
                self.forget(seq)
                continue
            st = self.states[seq]
            st.num_computed_tokens = min(st.num_computed_tokens, seq.num_computed_tokens)
            truncate_table(self.parts.allocator, st.block_table, st.num_computed_tokens)

    def forget(self, seq: Sequence) -> None:
        """A sequence left (finished, aborted): its blocks in the draft's cache are free again."""
        st = self.states.pop(seq, None)
        if st is not None:
            self.parts.allocator.free(st.block_table)


def _same_vocabulary(draft: EngineSetup, target: EngineSetup) -> bool:
    return (draft.model_config.vocab_size == target.model_config.vocab_size
            and draft.tokenizer.get_vocab() == target.tokenizer.get_vocab())
