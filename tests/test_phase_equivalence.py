"""Every phase gives phase 1's tokens on tiny random models, across batch sizes and prompt
lengths (greedy, and seeded sampling)."""

import random

import pytest

from conftest import phase_params
from tinyvllm import SamplingParams
from tinyvllm.testing import token_difference


_PHASE1_TOKENS: dict = {}  # (model, batch, length) -> phase 1's greedy tokens


def _prompts(batch: int, length: int, vocab: int, seed: int):
    rng = random.Random(seed)
    # lengths vary around `length` so a batch mixes short and long prompts
    return [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(max(1, length + rng.randint(-length // 2, length // 2)))]}
            for _ in range(batch)]


@pytest.mark.parametrize("model_fixture", ["tiny_model_dir", "tiny_model_dir_llama3"])
@pytest.mark.parametrize("batch,length", [(1, 1), (3, 7), (8, 40), (5, 150)])
@pytest.mark.parametrize("phase", phase_params())
def test_greedy_equals_phase1(phase, batch, length, model_fixture, request, make_llm):
    model = request.getfixturevalue(model_fixture)
    ref_llm, llm = make_llm(model, 1), make_llm(model, phase)
    prompts = _prompts(batch, length, ref_llm.llm_engine.model_config.vocab_size, seed=batch * 1000 + length)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    # phase 1 runs each prompt alone: the reference with no batching at all (made once, shared
    # by every phase's case)
    key = (model_fixture, batch, length)
    if key not in _PHASE1_TOKENS:
        _PHASE1_TOKENS[key] = [ref_llm.generate(p, params, use_tqdm=False)[0].outputs[0].token_ids
                               for p in prompts]
    ref = _PHASE1_TOKENS[key]
    outs = llm.generate(prompts, params, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    assert got == ref, token_difference(got, ref, f"phase {phase}'s greedy tokens against phase 1's (each prompt alone), "
                                   f"{batch} prompts of up to {length} tokens")


@pytest.mark.parametrize("model_fixture", ["tiny_model_dir", "tiny_qwen3_dir"])
@pytest.mark.parametrize("phase", phase_params())
def test_seeded_sampling_equals_phase1(phase, model_fixture, request, make_llm):
    model = request.getfixturevalue(model_fixture)
    prompts = _prompts(4, 12, 300, seed=7)
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i, max_tokens=20, ignore_eos=True)
              for i in range(len(prompts))]
    ref = make_llm(model, 1).generate(prompts, params, use_tqdm=False)
    outs = make_llm(model, phase).generate(prompts, params, use_tqdm=False)
    got, want = [o.outputs[0].token_ids for o in outs], [o.outputs[0].token_ids for o in ref]
    assert got == want, token_difference(got, want, f"phase {phase}'s seeded samples against phase 1's")
