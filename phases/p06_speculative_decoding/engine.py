"""Phase 6 engine: speculative decoding.

At small batch a decode step reads every weight of the model to produce one token per sequence;
the arithmetic is nearly idle. Scoring k + 1 positions of a sequence in that pass costs little
more than scoring one. So, each step:

1. A *proposer* guesses up to k next tokens for every decoding sequence: the n-gram proposer
   looks them up in the sequence's own tokens, the draft-model proposer runs a small model k
   times (`speculative_config`).
2. The scheduler gives such a sequence 1 + k tokens of the step (its last token and the drafts),
   counted in the token budget and the cache like a prefill chunk; sequences without drafts and
   prefill chunks share the same flat batch.
3. The target model scores all of them in one pass (the `SpecModelRunner`, with logits at every
   one of the k + 1 rows), and the `RejectionSampler` keeps the drafts the target agrees with,
   plus one token of its own: between 1 and k + 1 tokens for one pass, distributed exactly as
   without drafts.
4. The slots of rejected drafts are rolled back (`num_computed_tokens`, the block table; blocks
   left empty go back to the pool), in the draft model's cache too.

Parts: `make_scheduler` gives phase 3's scheduler with drafts counted (`SpecScheduler`),
`make_model_runner` phase 2's runner with the drafts in the batch (`SpecModelRunner`),
`make_proposer` the n-gram or the draft-model proposer. Overrides: `step` (propose first),
`append_tokens` (verification), `abort_request`, `get_stats`, `reset_stats`.
"""

from __future__ import annotations

import time

import torch

from phases.p05_quantization import Engine as Phase5Engine
from tinyvllm.outputs import RequestOutput
from tinyvllm.sequence import Sequence

from .draft_proposer import DraftModelProposer
from .model_runner import SpecModelRunner
from .ngram_proposer import NgramProposer
from .rejection_sampler import RejectionSampler
from .rollback import truncate_table
from .scheduler import SpecScheduler
from .spec_config import SpeculativeConfig


class Engine(Phase5Engine):
    """The phase 6 engine: propose, verify in one pass, keep what the target agrees with."""

    phase = 6
    ENGINE_ARGS = Phase5Engine.ENGINE_ARGS | {"speculative_config"}

    def __init__(self, model=None, **engine_args):
        # checked before any model is loaded: a bad config costs nothing
        self.spec_config = SpeculativeConfig.from_dict(engine_args.get("speculative_config"))
        # this step's drafts, by sequence: the proposer writes them, the scheduler counts them,
        # the model runner scores them
        self.spec_token_ids: dict[Sequence, list[int]] = {}
        super().__init__(model, **engine_args)
        self._spec_stats = self._zero_spec_stats()
        self.rejection_sampler = RejectionSampler(self.sampler)
        self.proposer = self.make_proposer(self.spec_config)
        self._draft_probs: dict[Sequence, torch.Tensor | None] = {}  # q of each, (k, V); None: one-hot

    def make_scheduler(self) -> SpecScheduler:
        """Phase 3's scheduler, counting each decode's drafts in its tokens."""
        c = self.config
        return SpecScheduler(self.allocator, c.max_num_seqs, self.max_num_batched_tokens, c.enable_chunked_prefill,
                             spec_token_ids=self.spec_token_ids)

    def make_proposer(self, spec: SpeculativeConfig | None):
        if spec is None:
            return None
        if spec.method == "ngram":
            return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
        return DraftModelProposer(self, spec)

    # -- one step ------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Propose drafts, then phase 3's step: schedule, one pass, verify, free the finished."""
        self.propose_drafts()
        outputs = super().step()
        if hasattr(self.proposer, "sync"):  # the draft model's cache follows the target's
            self.proposer.sync(self.scheduler.running)
        return outputs

    def propose_drafts(self) -> None:
        """Drafts for every running sequence that is decoding, unless the batch is too large."""
        drafts = self.spec_token_ids
        drafts.clear()
        self._draft_probs.clear()
        spec, running = self.spec_config, self.scheduler.running
        if spec is None or (spec.disable_by_batch_size is not None
                            and len(running) > spec.disable_by_batch_size):
            return
        wanted = []
        for seq in running:
            if seq.num_computed_tokens + 1 != seq.num_tokens:
                continue  # still prefilling
            # never past max_model_len or max_tokens: the verified run can emit k + 1 tokens
            k = min(spec.num_speculative_tokens, self.max_model_len - seq.num_tokens - 1)
            if seq.params.max_tokens is not None:
                k = min(k, seq.params.max_tokens - seq.num_output_tokens - 1)
            if k > 0:
                wanted.append((seq, k))
        if isinstance(self.proposer, NgramProposer):
            for seq, k in wanted:
                tokens = self.proposer.propose(seq.token_ids, k)
                if tokens:
                    drafts[seq] = tokens
        else:
            for seq, (tokens, q) in self.proposer.propose(wanted).items():
                drafts[seq], self._draft_probs[seq] = tokens, q

    # -- the drafts in the flat batch ----------------------------------------------------------
    def make_model_runner(self) -> SpecModelRunner:
        """Phase 2's runner, with each decoding sequence's drafts scored in the same pass."""
        return SpecModelRunner(self.model, self.sampler, self.block_size, self.make_attention, self.device,
                               spec_token_ids=self.spec_token_ids)

    def append_tokens(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        """Sample as before for sequences without drafts; verify the drafts of the others."""
        verifying = self.model_runner.take_verifying()
        if not verifying:
            return super().append_tokens(seqs, logits)
        plain, plain_rows, runs, r = [], [], [], 0
        for seq in seqs:
            k = len(verifying.get(seq, ()))
            if k:
                runs.append((seq, logits[r: r + k + 1]))
            else:
                plain.append(seq)
                plain_rows.append(r)
            r += k + 1
        if plain:
            super().append_tokens(plain, logits[plain_rows])
        for seq, rows in runs:
            drafts = verifying[seq]
            tokens, logprobs = self.rejection_sampler(rows, seq, drafts, self._draft_probs.get(seq))
            self.record_verification(seq, drafts, tokens)
            for token, lp in zip(tokens, logprobs):
                seq.append_token(token, lp)
                if seq.is_finished:  # EOS, a stop, max_tokens inside the run: cut it there
                    break
            seq.group.record_token_time(time.perf_counter())
            # KV is valid for the last real token and the accepted drafts; the rest is rolled back
            seq.num_computed_tokens -= len(drafts) - (len(tokens) - 1)
            truncate_table(self.allocator, seq.block_table, seq.num_computed_tokens)

    def abort_request(self, request_id: str | list[str]) -> None:
        super().abort_request(request_id)
        if hasattr(self.proposer, "sync"):
            self.proposer.sync(self.scheduler.running)

    # -- numbers -------------------------------------------------------------------------------
    def record_verification(self, seq: Sequence, drafts: list[int], tokens: list[int]) -> None:
        s, accepted = self._spec_stats, len(tokens) - 1
        s["spec_num_drafts"] += 1
        s["spec_num_draft_tokens"] += len(drafts)
        s["spec_num_accepted_tokens"] += accepted
        metrics = seq.group.metrics  # the same counts per request, in RequestOutput.metrics
        metrics.spec_num_draft_tokens += len(drafts)
        metrics.spec_num_accepted_tokens += accepted
        per_pos = s["spec_num_accepted_tokens_per_pos"]
        per_pos.extend([0] * (len(drafts) - len(per_pos)))
        for j in range(accepted):
            per_pos[j] += 1

    def reset_stats(self) -> None:
        super().reset_stats()
        self._spec_stats = self._zero_spec_stats()

    @staticmethod
    def _zero_spec_stats() -> dict:
        return dict(spec_num_drafts=0, spec_num_draft_tokens=0, spec_num_accepted_tokens=0,
                    spec_num_accepted_tokens_per_pos=[])

    def get_stats(self) -> dict:
        """Phase 5's counters plus speculation's (vLLM's names): spec_num_drafts (verified runs),
        spec_num_draft_tokens, spec_num_accepted_tokens, spec_num_accepted_tokens_per_pos,
        spec_acceptance_rate (accepted / proposed) and spec_mean_accepted_length (tokens emitted
        per verified run, the target's own token included: 1 + accepted / runs)."""
        stats = super().get_stats()
        s = self._spec_stats
        stats.update(s, spec_num_accepted_tokens_per_pos=list(s["spec_num_accepted_tokens_per_pos"]))
        if self.spec_config is not None:
            stats["spec_acceptance_rate"] = (s["spec_num_accepted_tokens"] / s["spec_num_draft_tokens"]
                                             if s["spec_num_draft_tokens"] else 0.0)
            stats["spec_mean_accepted_length"] = (1 + s["spec_num_accepted_tokens"] / s["spec_num_drafts"]
                                                  if s["spec_num_drafts"] else 1.0)
        return stats
