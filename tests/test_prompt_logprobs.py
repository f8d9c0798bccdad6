"""`SamplingParams.prompt_logprobs` in every phase: each prompt token's log-probability given the
tokens before it, its rank and the top-k, equal to transformers' on a tiny model; computed only
when asked; whole when the prompt is prefilled in chunks."""

import pytest
import torch

from conftest import phase_params
from tinyvllm import LLM, SamplingParams

PROMPT = [5, 17, 99, 3, 42, 7, 8, 250, 31, 64, 12]


@pytest.fixture(scope="module")
def hf_logprobs(tiny_model_dir):
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0]          # (T, V)
    return torch.log_softmax(logits.float(), dim=-1)


def _check(out, hf, k):
    plp = out.prompt_logprobs
    assert plp is not None, ("prompt_logprobs=2 was asked, and the output has none: the runner returns the logits of "
                             "the prompt rows it computed (prompt_logits), which the sampler turns into logprobs")
    assert len(plp) == len(PROMPT) and plp[0] is None, (
        f"one entry per prompt token, None for the first (nothing before it): {len(plp)} entries for {len(PROMPT)} tokens "
        f"(the runner returns the logits of the prompt rows it computed, prompt_logits; the sampler makes these of them)")
    for i in range(1, len(PROMPT)):
        row, token = hf[i - 1], PROMPT[i]
        assert token in plp[i] and len(plp[i]) in (k, k + 1)
        assert plp[i][token].logprob == pytest.approx(float(row[token]), abs=1e-4)
        assert plp[i][token].rank == int((row > row[token]).sum()) + 1
        top = row.topk(k).indices.tolist()
        assert [t for t, lp in sorted(plp[i].items(), key=lambda kv: kv[1].rank) if lp.rank <= k] == top


@pytest.mark.parametrize("phase", phase_params())
def test_prompt_logprobs_equal_transformers(tiny_model_dir, make_llm, hf_logprobs, phase):
    llm = make_llm(tiny_model_dir, phase)
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2)
    plain = SamplingParams(temperature=0, max_tokens=3)
    # twice: a second run of the same prompt must not take a cached prefix and lose its rows
    for _ in range(2):
        outs = llm.generate([{"prompt_token_ids": PROMPT}, {"prompt_token_ids": PROMPT[:4]}], params)
        _check(outs[0], hf_logprobs, 2)
    other = llm.generate([{"prompt_token_ids": PROMPT}], plain)[0]
    assert other.prompt_logprobs is None
    assert other.outputs[0].token_ids == outs[0].outputs[0].token_ids


@pytest.mark.parametrize("phase", phase_params(min_phase=3))
def test_prompt_logprobs_whole_with_chunked_prefill(tiny_model_dir, make_llm, hf_logprobs, phase):
    llm = make_llm(tiny_model_dir, phase, max_num_batched_tokens=4, enable_chunked_prefill=True)
    out = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0))[0]
    _check(out, hf_logprobs, 0)


@pytest.mark.parametrize("bad", [-1, 21, 1.5, True])
def test_prompt_logprobs_bad_values(bad):
    with pytest.raises((ValueError, TypeError), match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=bad)
