"""The vectorized sampler gives `tinyvllm.sampler.Sampler`'s tokens for the same seeds."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from phases.p07_cuda_graphs.batch_sampler import sample
from tinyvllm.sampler import Sampler
from tinyvllm.sampling_params import SamplingParams

PARAMS = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, top_k=5),
          SamplingParams(temperature=1.2, top_k=1), SamplingParams(temperature=0.7, top_p=0.9),
          SamplingParams(temperature=1.0, min_p=0.05), SamplingParams(temperature=0.5),
          SamplingParams(temperature=0.9, top_k=40, top_p=0.8, min_p=0.02),
          SamplingParams(temperature=1.5, top_k=300)]


def rows(params, seed):
    return [SimpleNamespace(params=p, min_tokens_pending=False,
                            generator=None if p.is_greedy else torch.Generator().manual_seed(seed + i))
            for i, p in enumerate(params)]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("mix", ["all", "greedy", "topk", "full"])
def test_vectorized_equals_sampler(seed, mix):
    g = torch.Generator().manual_seed(seed)
    pick = {"all": PARAMS, "greedy": PARAMS[:1] * 3, "topk": PARAMS[1:3] + PARAMS[7:],
            "full": PARAMS[3:7]}[mix]
    params = [pick[int(i)] for i in torch.randint(0, len(pick), (9,), generator=g)]
    logits = torch.randn(9, 257, generator=g) * 3
    ref = rows(params, 100 * seed)
    want, _ = Sampler()(logits, ref)
    mine = rows(params, 100 * seed)
    t = lambda attr, dtype: torch.tensor([getattr(p, attr) for p in params], dtype=dtype)
    got = sample(logits, t("temperature", torch.float32), t("top_k", torch.int64), t("top_p", torch.float32),
                 t("min_p", torch.float32), [r.generator for r in mine])
    assert got.tolist() == want
    # and the generators moved the same way: the next draw agrees too
    for a, b in zip(ref, mine):
        if a.generator is not None:
            assert torch.rand(1, generator=a.generator) == torch.rand(1, generator=b.generator)
