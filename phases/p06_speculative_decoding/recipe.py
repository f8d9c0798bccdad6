"""Phase 6's recipe: phase 5's, with speculative decoding (`speculative_config`).

At small batch a decode step reads every weight of the model to produce one token per sequence;
the arithmetic is nearly idle. Scoring k + 1 positions of a sequence in that pass costs little
more than scoring one. So, each step:

1. A *proposer* guesses up to k next tokens for every decoding sequence: `NgramProposer` looks
   them up in the sequence's own tokens, `DraftModelProposer` runs a small model k times.
2. The scheduler (`SpecScheduler`) asks for them and gives such a sequence 1 + k tokens of the
   step (its last token and the drafts), counted in the token budget and the cache like a
   prefill chunk; sequences without drafts and prefill chunks share the same flat batch.
3. The runner (`SpecModelRunner`) scores them in the same pass, with logits at every one of the
   k + 1 rows, and the sampler (`RejectionSampler`) keeps the drafts the target agrees with,
   plus one token of its own: between 1 and k + 1 tokens for one pass, distributed exactly as
   without drafts.
4. The scheduler's update rolls back the slots of rejected drafts (`truncate_table`), in the
   draft model's cache too.

With `speculative_config=None` (the default) every part is phase 5's.
"""

from __future__ import annotations

from phases.p01_naive_attention import EngineSetup, Parts
from phases.p03_continuous_batching.recipe import max_num_batched_tokens
from phases.p05_quantization import RECIPE as PHASE5

from .draft_proposer import DraftModelProposer
from .model_runner import SpecModelRunner
from .ngram_proposer import NgramProposer
from .rejection_sampler import RejectionSampler
from .scheduler import SpecScheduler
from .spec_config import SpeculativeConfig


def spec_config(setup: EngineSetup) -> SpeculativeConfig | None:
    """The validated `speculative_config` (None: speculation off)."""
    return SpeculativeConfig.from_dict(setup.config.speculative_config)


def check_spec(setup: EngineSetup) -> None:
    spec_config(setup)  # a bad config is refused before any model loads


def make_sampler(setup: EngineSetup, parts: Parts):
    sampler = PHASE5.sampler(setup, parts)
    return sampler if spec_config(setup) is None else RejectionSampler(sampler)


def make_runner(setup: EngineSetup, parts: Parts):
    if spec_config(setup) is None:
        return PHASE5.runner(setup, parts)
    return SpecModelRunner(parts.model, parts.attention, setup.config.block_size, setup.device)


def make_proposer(setup: EngineSetup, parts: Parts):
    spec = spec_config(setup)
    if spec is None:
        return None
    if spec.method == "ngram":
        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    return DraftModelProposer(setup, parts, spec)


def make_scheduler(setup: EngineSetup, parts: Parts):
    spec = spec_config(setup)
    if spec is None:
        return PHASE5.scheduler(setup, parts)
    c = setup.config
    return SpecScheduler(parts.allocator, c.max_num_seqs, max_num_batched_tokens(setup), c.enable_chunked_prefill,
                         setup.max_model_len, proposer=parts.proposer, spec=spec)


RECIPE = PHASE5.extend(
    phase=6, engine_args={"speculative_config"}, checks=(check_spec,),
    sampler=make_sampler, runner=make_runner, proposer=make_proposer, scheduler=make_scheduler,
)
