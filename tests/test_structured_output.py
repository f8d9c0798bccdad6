"""Structured outputs: a request's output is constrained to a JSON schema, a regex, a list of
choices or a grammar (`SamplingParams.structured_outputs`, vLLM's name), on every phase.

The tiny random model would write anything: whatever it writes under a constraint fits it only
because the sampler never draws a token the grammar refuses. So each test checks the output
against the constraint itself (json.loads and the schema's rules, re.fullmatch, membership).
"""

from __future__ import annotations

import json
import re

import pytest

from conftest import phase_params
from tinyvllm import SamplingParams
from tinyvllm.sampling_params import StructuredOutputsParams

PROMPTS = ["hello there", "the quick brown fox", "1 2 3"]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "pet": {"enum": ["cat", "dog"]}},
    "required": ["name", "age", "pet"],
    "additionalProperties": False,
}
REGEX = r"[a-c]{2,4}-[0-9]{3}"
CHOICES = ["yes", "no", "maybe later"]


def _params(**structured) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=80, structured_outputs=structured)


def _fits_schema(text: str) -> None:
    value = json.loads(text)
    assert set(value) == {"name", "age", "pet"}, value
    assert isinstance(value["name"], str) and len(value["name"]) <= 8, value
    assert isinstance(value["age"], int) and 0 <= value["age"] <= 120, value
    assert value["pet"] in ("cat", "dog"), value


@pytest.mark.parametrize("phase", phase_params())
def test_every_phase_keeps_the_output_inside_the_constraint(phase, tiny_model_dir, make_llm):
    llm = make_llm(tiny_model_dir, phase)
    schema = _params(json=SCHEMA, disable_any_whitespace=True)
    for out in llm.generate(PROMPTS, schema):
        assert out.outputs[0].finish_reason == "stop", out.outputs[0]
        _fits_schema(out.outputs[0].text)
    for out in llm.generate(PROMPTS, _params(regex=REGEX)):
        assert re.fullmatch(REGEX, out.outputs[0].text), out.outputs[0].text
    sampled = SamplingParams(max_tokens=20, temperature=1.0, seed=7, n=2,
                             structured_outputs={"choice": CHOICES})
    for out in llm.generate(PROMPTS, sampled):
        assert [c.text for c in out.outputs if c.text not in CHOICES] == []
    # the same request without the constraint is free text, so the mask is what made it fit
    free = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=20))[0].outputs[0].text
    assert not re.fullmatch(REGEX, free)


def test_json_object_and_a_lark_grammar(tiny_model_dir, make_llm):
    llm = make_llm(tiny_model_dir, 3)
    for out in llm.generate(PROMPTS, _params(json_object=True, disable_any_whitespace=True)):
        # any object: the random model may still be inside its first key after 80 tokens
        text = out.outputs[0].text
        assert text.startswith(("{}", '{"')), text
        if out.outputs[0].finish_reason == "stop":
            assert isinstance(json.loads(text), dict), text
    grammar = 'start: "(" num ("+" num)* ")"\nnum: /[0-9]{1,2}/'
    for out in llm.generate(PROMPTS, _params(grammar=grammar)):
        assert re.fullmatch(r"\([0-9]{1,2}(\+[0-9]{1,2})*\)", out.outputs[0].text), out.outputs[0].text


def test_a_seeded_constrained_request_repeats_and_mixes_with_free_ones(tiny_model_dir, make_llm):
    """A constrained row in a batch with unconstrained ones: each keeps its own rules, and a
    seed gives the same output in any batch."""
    llm = make_llm(tiny_model_dir, 7)
    constrained = SamplingParams(max_tokens=40, temperature=0.9, seed=3,
                                 structured_outputs={"json": SCHEMA, "disable_any_whitespace": True})
    alone = llm.generate(PROMPTS[:1], constrained)[0].outputs[0].text
    mixed = llm.generate(PROMPTS, [constrained, SamplingParams(max_tokens=12, temperature=0.9, seed=1),
                                   SamplingParams(temperature=0, max_tokens=12)])
    assert mixed[0].outputs[0].text == alone
    _fits_schema(alone)
    assert len(mixed[1].outputs[0].token_ids) == 12   # the free rows ran to max_tokens


def test_speculative_decoding_under_a_grammar_gives_phase_5s_tokens(tiny_model_dir, make_llm):
    """Phase 6 verifies a run of drafts in one pass: position j is masked by the grammar's state
    after drafts[:j], so greedy tokens equal the non-speculative engine's."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3}
    params = _params(json=SCHEMA, disable_any_whitespace=True)
    want = [o.outputs[0].token_ids for o in make_llm(tiny_model_dir, 5).generate(PROMPTS, params)]
    got = make_llm(tiny_model_dir, 6, speculative_config=spec).generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in got] == want
    drafted = sum(o.metrics.spec_num_draft_tokens for o in got)
    accepted = sum(o.metrics.spec_num_accepted_tokens for o in got)
    assert 0 < accepted < drafted, (accepted, drafted)   # drafts were verified, some refused
    for out in got:
        _fits_schema(out.outputs[0].text)


def test_a_request_cut_by_max_tokens_ends_with_length(tiny_model_dir, make_llm):
    out = make_llm(tiny_model_dir, 3).generate(
        PROMPTS[:1], SamplingParams(temperature=0, max_tokens=3, structured_outputs={"json": SCHEMA}))[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3
    assert out.text.startswith("{")


@pytest.mark.parametrize("structured, message", [
    ({"regex": "(unclosed"}, "structured_outputs"),
    ({"json": "{not json"}, "structured_outputs.json is not valid JSON"),
    ({"json": [1, 2]}, "structured_outputs.json must be a JSON schema"),
    ({"grammar": "start: missing_rule"}, "structured_outputs"),
    ({"regex": "a", "choice": ["b"]}, "exactly one of"),
    ({}, "exactly one of"),
    ({"choice": []}, "structured_outputs.choice"),
    ({"choice": "yes"}, "structured_outputs.choice"),
    ({"shema": {}}, "unknown field"),
])
def test_a_bad_constraint_is_refused_naming_it_and_the_engine_goes_on(structured, message,
                                                                       tiny_model_dir, make_llm):
    llm = make_llm(tiny_model_dir, 3)
    with pytest.raises((ValueError, TypeError), match=re.escape(message)):
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4, structured_outputs=structured))
    assert len(llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4))[0].outputs[0].token_ids) == 4


def test_structured_outputs_params_takes_exactly_one_constraint():
    assert StructuredOutputsParams(regex="a+").regex == "a+"
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(json_object=False)
    with pytest.raises(TypeError, match="structured_outputs must be"):
        SamplingParams(structured_outputs="json")
