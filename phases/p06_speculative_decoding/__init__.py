"""Phase 6: speculative decoding with exact rejection sampling."""

from .draft_proposer import DraftModelProposer
from .model_runner import SpecModelRunner
from .ngram_proposer import NgramProposer
from .recipe import RECIPE
from .rejection_sampler import RejectionSampler, rejection_sample
from .rollback import truncate_table
from .scheduler import SpecScheduler
from .spec_config import SpeculativeConfig

__all__ = ["RECIPE", "DraftModelProposer", "NgramProposer", "RejectionSampler", "SpecModelRunner",
           "SpecScheduler", "SpeculativeConfig", "rejection_sample", "truncate_table"]
