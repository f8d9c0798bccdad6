"""Bad input raises a clear error naming the problem, and the same LLM then still generates
correctly: nothing is lost, nothing is left half-queued."""

import re
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


# -- values a request may carry: none stops the engine -------------------------------------------

EXTREME = [
    SamplingParams(temperature=0.8, repetition_penalty=1e-300, seed=1, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=0.8, repetition_penalty=3e38, seed=2, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=1e-30, seed=3, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=3e38, top_k=3, seed=4, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=5e-5, top_p=1e-9, min_p=1.0, seed=5, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=0.5, presence_penalty=2, frequency_penalty=-2, repetition_penalty=1e-300,
                   top_k=2, seed=2**63 - 1, n=2, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=0, repetition_penalty=1e-300, max_tokens=12, ignore_eos=True),
]


@pytest.mark.parametrize("phase", phase_params())
def test_extreme_sampling_values_give_valid_tokens_and_the_engine_goes_on(phase, tiny_model_dir, make_llm):
    """Penalties and temperatures at the edge of their ranges push logits to inf, whose softmax
    is NaN: each request still gets tokens of the vocabulary, alone and batched together, and
    the engine serves a plain request exactly as before."""
    llm = make_llm(tiny_model_dir, phase)
    expected = llm.generate(GOOD, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    vocab = llm.llm_engine.model_config.vocab_size
    outs = llm.generate([GOOD] * len(EXTREME), EXTREME, use_tqdm=False)
    for o in outs:
        for c in o.outputs:
            assert len(c.token_ids) == 12 and all(0 <= t < vocab for t in c.token_ids)
    assert llm.generate(GOOD, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == expected


def test_sampling_values_are_bounded_as_vllm_bounds_them():
    assert SamplingParams(temperature=1e-30).temperature == 0.01     # vLLM's _MAX_TEMP
    assert not SamplingParams(temperature=1e-6).is_greedy and SamplingParams(temperature=0).is_greedy
    assert SamplingParams(seed=-(2**63)).seed == -(2**63)
    for seed in (2**63, -(2**63) - 1, 10**30):
        with pytest.raises(ValueError, match="seed must be a 64-bit integer"):
            SamplingParams(seed=seed)


class _StepFails(Exception):
    pass


@pytest.mark.parametrize("phase", phase_params())
def test_a_failed_forward_aborts_the_call_and_the_next_gets_the_same_tokens(phase, tiny_model_dir, monkeypatch,
                                                                            engine_in_this_process):
    """An error inside a step (here the model's forward, once) reaches the caller; every request
    of the call is aborted and its blocks freed, and the next call gets the same tokens as
    before."""
    llm = LLM(str(tiny_model_dir), phase=phase)
    expected = llm.generate(GOOD, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    engine, model = llm.llm_engine, llm.llm_engine.model
    forward = model.forward
    calls = {"n": 0}

    def fails_once(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise _StepFails("the forward pass failed")
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", fails_once)
    with pytest.raises(Exception, match="the forward pass failed"):
        llm.generate([GOOD, {"prompt_token_ids": [7, 8, 9]}], GREEDY, use_tqdm=False)
    assert not engine.has_unfinished_requests()
    if engine.allocator is not None:
        a = engine.allocator
        assert a.num_free_blocks == a.num_blocks, (
            f"{a.num_blocks - a.num_free_blocks} KV blocks of the failed step's requests were not given back")
    assert llm.generate(GOOD, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == expected


@pytest.mark.parametrize("phase", phase_params())
def test_a_failed_step_aborts_its_requests_and_the_engine_goes_on(phase, tiny_model_dir, monkeypatch,
                                                                   engine_in_this_process):
    """A step's failure, in the one loop every phase runs, is a StepError listing the requests it
    was running (its message names none: a server shows it to their clients), which are aborted;
    a request that was only waiting is left to run."""
    from tinyvllm.errors import StepError

    seats = {"max_num_seqs": 1} if phase >= 2 else {}
    engine = LLM(str(tiny_model_dir), phase=phase, **seats).llm_engine
    engine.add_request("a", GOOD, GREEDY)
    engine.add_request("b", {"prompt_token_ids": [7, 8, 9]}, GREEDY)
    execute = engine.runner.execute

    def fails(plan):
        raise _StepFails("the batch failed")

    monkeypatch.setattr(engine.runner, "execute", fails)
    try:
        engine.step()
    except StepError as e:
        error = e
    except _StepFails:
        raise AssertionError("expected a StepError, the runner's exception escaped the step: step() must catch "
                             "what execute, sample or update raise, abort the plan's requests and raise "
                             "StepError(their ids, e) from e") from None
    else:
        raise AssertionError("the runner raised, and step() returned: expected a StepError")
    assert re.search(r"the batch failed.*1 request\(s\) were aborted", str(error)), (
        f"a StepError says what failed and how many requests were aborted: {error}")
    assert error.request_ids == ["a"] and isinstance(error.__cause__, _StepFails), (
        f"the StepError names the requests of the failed step, ['a'] (b only waited), and is raised from the "
        f"runner's exception: request_ids {error.request_ids}, cause {error.__cause__!r}")
    assert "'a'" not in str(error) and " a " not in str(error)
    assert "a" not in engine.groups, "a failed step's requests are aborted: 'a' is still in the engine"
    monkeypatch.setattr(engine.runner, "execute", execute)
    while engine.has_unfinished_requests():
        outs = engine.step()
    assert [o.request_id for o in outs] == ["b"] and len(outs[0].outputs[0].token_ids) == GREEDY.max_tokens, (
        f"after the failed step, b (only waiting then) runs to the end: the last outputs are "
        f"{[(o.request_id, len(o.outputs[0].token_ids)) for o in outs]}")
    if engine.allocator is not None:
        a = engine.allocator
        assert a.num_free_blocks == a.num_blocks, (
            f"{a.num_blocks - a.num_free_blocks} KV blocks are still held after the failed step and b's end")
