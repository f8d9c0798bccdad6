"""Generation ends exactly where it should: max_tokens, EOS, ignore_eos, min_tokens, stop token
ids and stop strings (which stay out of the text)."""

import pytest

from conftest import phase_params
from tinyvllm import SamplingParams

PROMPT = {"prompt_token_ids": [10, 20, 30, 40, 50, 60, 70]}


def _greedy(llm, **kw):
    return llm.generate(PROMPT, SamplingParams(temperature=0, **kw), use_tqdm=False)[0].outputs[0]


@pytest.mark.parametrize("phase", phase_params())
def test_max_tokens_and_stop_token_ids(phase, tiny_model_dir, make_llm):
    llm = make_llm(tiny_model_dir, phase)
    full = _greedy(llm, max_tokens=20, ignore_eos=True)
    assert len(full.token_ids) == 20 and full.finish_reason == "length"
    # stop at the first occurrence of the 6th token's id; the stop token stays in token_ids
    target = full.token_ids[5]
    first = full.token_ids.index(target)
    out = _greedy(llm, max_tokens=20, ignore_eos=True, stop_token_ids=[target])
    assert out.token_ids == full.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == target
    # min_tokens: the stop token cannot end it before min_tokens tokens, and is not sampled then
    out = _greedy(llm, max_tokens=20, ignore_eos=True, stop_token_ids=[target], min_tokens=first + 2)
    assert len(out.token_ids) >= first + 2
    assert target not in out.token_ids[: first + 2]


@pytest.mark.parametrize("phase", phase_params())
def test_eos_and_ignore_eos(phase, tiny_model_dir, make_llm, engine_in_this_process):
    llm = make_llm(tiny_model_dir, phase)
    full = _greedy(llm, max_tokens=20, ignore_eos=True)
    # make the 4th generated token the model's EOS: re-load with that id as eos
    engine = llm.llm_engine
    eos = full.token_ids[3]
    saved = engine.eos_token_ids
    engine.eos_token_ids = frozenset({eos})
    try:
        out = _greedy(llm, max_tokens=20)
        first = full.token_ids.index(eos)
        assert out.token_ids == full.token_ids[: first + 1]
        assert out.finish_reason == "stop" and out.stop_reason is None
        assert _greedy(llm, max_tokens=20, ignore_eos=True).token_ids == full.token_ids
        out = _greedy(llm, max_tokens=20, min_tokens=first + 3)
        assert len(out.token_ids) > first + 3 and eos not in out.token_ids[: first + 3]
    finally:
        engine.eos_token_ids = saved


@pytest.mark.parametrize("phase", phase_params())
def test_stop_strings(phase, tiny_model_dir, make_llm):
    llm = make_llm(tiny_model_dir, phase)
    prompt = "the rain in spain"
    full = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    text = full.text
    k = len(text) // 3
    stop = text[k:k + 2]  # a string the model will produce a third of the way in
    cut = text.find(stop)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop, "never-there"]),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == text[:cut] and stop not in out.text
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids == full.token_ids[: len(out.token_ids)] and len(out.token_ids) < 30
    kept = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=stop,
                                               include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == text[: cut + len(stop)]


@pytest.mark.slow  # the default model
def test_stop_string_on_default_model(make_llm, default_model_dir):
    llm = make_llm(default_model_dir, 1)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    full = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0].outputs[0]
    assert "Paris" in full.text
    out = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=16, stop=" Paris"), use_tqdm=False)[0].outputs[0]
    assert out.text == full.text[: full.text.index(" Paris")] and out.finish_reason == "stop"
