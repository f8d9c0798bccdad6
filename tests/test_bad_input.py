"""Bad input raises a clear error naming the problem, and the same LLM then still generates
correctly: nothing is lost, nothing is left half-queued."""

import shutil

import pytest

import phases
from conftest import phase_params
from tinyvllm import LLM, SamplingParams

GOOD = {"prompt_token_ids": [11, 22, 33, 44]}
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _bad_requests(vocab, max_len):
    return [
        ("", GREEDY, ValueError, "empty"),
        ({"prompt_token_ids": []}, GREEDY, ValueError, "empty"),
        ({"prompt_token_ids": [1] * (max_len + 5)}, GREEDY, ValueError, "max_model_len"),
        ({"prompt_token_ids": [1, vocab + 7]}, GREEDY, ValueError, "vocabulary"),
        ({"prompt_token_ids": [1, -3]}, GREEDY, ValueError, "vocabulary"),
        ({"prompt_token_ids": "abc"}, GREEDY, TypeError, "prompt_token_ids"),
        (12345, GREEDY, TypeError, "prompt"),
        ({"text": "hi"}, GREEDY, ValueError, "prompt"),
        ("hello", "not params", TypeError, "sampling_params"),
    ]


@pytest.mark.parametrize("phase", phase_params())
def test_bad_prompts_raise_and_engine_goes_on(phase, tiny_model_dir, make_llm):
    llm = make_llm(tiny_model_dir, phase)
    expected = llm.generate(GOOD, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    engine = llm.llm_engine
    for prompt, params, exc, words in _bad_requests(engine.model_config.vocab_size, engine.max_model_len):
        with pytest.raises(exc, match=words):
            llm.generate([GOOD, prompt], params, use_tqdm=False)
        assert not engine.has_unfinished_requests()
        assert llm.generate(GOOD, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == expected


@pytest.mark.parametrize("phase", phase_params())
def test_bad_sampling_params_raise_and_engine_goes_on(phase, tiny_model_dir, make_llm):
    llm = make_llm(tiny_model_dir, phase)
    expected = llm.generate(GOOD, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    for kwargs, field in [(dict(max_tokens=0), "max_tokens"), (dict(temperature=-1.0), "temperature"),
                          (dict(temperature=float("nan")), "temperature"), (dict(top_p=0.0), "top_p"),
                          (dict(top_p=1.01), "top_p"), (dict(top_k=-5), "top_k")]:
        with pytest.raises(ValueError, match=field):
            llm.generate(GOOD, SamplingParams(**kwargs), use_tqdm=False)
        assert llm.generate(GOOD, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == expected


def _llm_made_before(tiny_model_dir, make_llm):
    """An LLM made before a constructor fails, and its greedy tokens: a failed LLM(...) must not
    disturb it (shared state such as the phase registry, the tokenizer, torch's defaults)."""
    llm = make_llm(tiny_model_dir, phases.latest_phase())
    return llm, _greedy(llm)


def _greedy(llm) -> list[int]:
    return llm.generate(GOOD, GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_unknown_model_path(tiny_model_dir, make_llm):
    llm, expected = _llm_made_before(tiny_model_dir, make_llm)
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        LLM("/nonexistent/no-such-model", phase=1)
    assert _greedy(llm) == expected


def test_unknown_phase(tiny_model_dir, make_llm):
    llm, expected = _llm_made_before(tiny_model_dir, make_llm)
    with pytest.raises(ValueError, match="phase"):
        LLM(str(tiny_model_dir), phase=99)
    with pytest.raises(TypeError, match="phase"):
        LLM(str(tiny_model_dir), phase="one")
    assert _greedy(llm) == expected


def test_unknown_engine_argument(tiny_model_dir, make_llm):
    llm, expected = _llm_made_before(tiny_model_dir, make_llm)
    with pytest.raises(TypeError, match="block_sise"):
        LLM(str(tiny_model_dir), phase=1, block_sise=16)
    with pytest.raises(ValueError, match="block_size"):
        LLM(str(tiny_model_dir), phase=1, block_size=0)
    assert _greedy(llm) == expected


def test_truncated_safetensors(tiny_model_dir, tmp_path, make_llm):
    llm, expected = _llm_made_before(tiny_model_dir, make_llm)
    bad = tmp_path / "truncated"
    shutil.copytree(tiny_model_dir, bad)
    f = bad / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"model\.safetensors is truncated.*Tensor '"):
        LLM(str(bad), phase=1)
    assert _greedy(llm) == expected
