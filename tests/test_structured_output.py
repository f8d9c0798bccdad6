"""Structured outputs: a request's output is constrained to a JSON schema, a regex, a list of
choices or a grammar (`SamplingParams.structured_outputs`, vLLM's name), on every phase.

The tiny random model would write anything: whatever it writes under a constraint fits it only
because the sampler never draws a token the grammar refuses. So each test checks the output
against the constraint itself (json.loads and the schema's rules, re.fullmatch, membership).
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from conftest import phase_params
from tinyvllm import SamplingParams
from tinyvllm.sampler import Sampler
from tinyvllm.sampling_params import StructuredOutputsParams
from tinyvllm.structured_output import GRAMMAR_LIMITS, StructuredOutputManager

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


# -- compiling once, limits, errors, the batch's masks ---------------------------------------------
def _manager(llm, **kwargs) -> StructuredOutputManager:
    """A manager of its own (an empty cache) for the engine's tokenizer."""
    engine = llm.llm_engine
    return StructuredOutputManager(engine.tokenizer, engine.model_config.vocab_size,
                                   engine.eos_token_ids, **kwargs)


def test_a_constraint_is_compiled_once_for_its_sequences_and_for_identical_requests(tiny_model_dir, make_llm):
    llm = make_llm(tiny_model_dir, 3)
    manager = llm.llm_engine.structured_output_manager
    schema = {"type": "object", "properties": {"id": {"type": "integer"}, "ok": {"type": "boolean"}},
              "required": ["id", "ok"], "additionalProperties": False}
    params = SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=30,
                            structured_outputs={"json": schema, "disable_any_whitespace": True})
    before = manager.num_compiled
    outs = llm.generate(PROMPTS[:1], params)
    assert manager.num_compiled == before + 1          # one compile for the request's 4 sequences
    # two identical requests (the same schema, another dict) and the first again: no compile
    again = SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=30,
                           structured_outputs={"json": json.loads(json.dumps(schema)),
                                               "disable_any_whitespace": True})
    outs += llm.generate(PROMPTS[:2], again)
    assert manager.num_compiled == before + 1
    # the sequences share the grammar, each with its own parser state: every output fits
    texts = [c.text for out in outs for c in out.outputs]
    assert len(set(texts)) > 1, texts
    for out in outs:
        for c in out.outputs:
            if c.finish_reason == "stop":
                assert set(json.loads(c.text)) == {"id", "ok"}, c.text
            else:
                assert c.finish_reason == "length" and c.text.startswith("{"), c
    assert outs[0].outputs[0].text == outs[1].outputs[0].text   # the same seed, the same output


def test_the_grammar_cache_is_shared_by_threads_and_bounded(tiny_model_dir, make_llm):
    manager = _manager(make_llm(tiny_model_dir, 3), cache_size=2)
    params = StructuredOutputsParams(regex=REGEX)
    with ThreadPoolExecutor(4) as pool:   # requests are made in worker threads (the server's)
        grammars = list(pool.map(lambda _: manager.compile(params), range(8)))
    assert manager.num_compiled == 1 and all(g is grammars[0] for g in grammars)
    manager.compile(StructuredOutputsParams(regex="x+"))
    manager.compile(StructuredOutputsParams(regex="y+"))   # the cache holds 2: REGEX leaves it
    assert manager.num_compiled == 3
    assert manager.compile(params) is not grammars[0] and manager.num_compiled == 4


def test_a_constraint_over_the_grammar_engines_limits_is_refused_when_added(tiny_model_dir, make_llm):
    """(a{1000}){1000}: llguidance's lexer spends its fuel on the first masks, then fails on the
    first token. The first step is taken when the constraint is compiled, so the request is
    refused then (a 400 in the server), before any sequence runs; the refusal is cached."""
    llm = make_llm(tiny_model_dir, 3)
    manager = llm.llm_engine.structured_output_manager
    params = SamplingParams(n=6, max_tokens=8, structured_outputs={"regex": "(a{1000}){1000}"})
    with pytest.raises(ValueError, match=re.escape("structured_outputs: the constraint goes over "
                                                   "the grammar engine's limits")):
        llm.generate(PROMPTS[:1], params)
    compiled = manager.num_compiled
    with pytest.raises(ValueError, match="structured_outputs"):
        llm.generate(PROMPTS[:1], params)
    assert manager.num_compiled == compiled
    assert len(llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4))[0].outputs[0].token_ids) == 4


def test_a_token_the_grammar_refuses_ends_the_sequence_with_the_error(tiny_model_dir, make_llm):
    """A sequence that takes a token its grammar refuses ends at once with "abort" and the
    error as stop_reason; the token stays out of its text (it never goes on unconstrained), and
    the request's other sequence goes on."""
    llm = make_llm(tiny_model_dir, 3)
    tok = llm.get_tokenizer()
    group = llm.llm_engine.make_request("refused", PROMPTS[0], SamplingParams(
        n=2, temperature=0, max_tokens=12, structured_outputs={"regex": REGEX}))
    bad, good = group.seqs
    for seq in group.seqs:
        seq.append_token(tok.encode("a", add_special_tokens=False)[0])
    bad.append_token(tok.encode("z", add_special_tokens=False)[0])
    assert (bad.finish_reason, bad.text) == ("abort", "a"), (bad.finish_reason, bad.text)
    assert bad.stop_reason.startswith("structured_outputs: ") and "doesn't satisfy" in bad.stop_reason
    good.append_token(tok.encode("b", add_special_tokens=False)[0])
    assert (good.finish_reason, good.text) == (None, "ab")


def test_a_limit_reached_during_generation_ends_the_sequence(tiny_model_dir, make_llm, monkeypatch):
    """A grammar that passes its first step but needs more lexer states than the limit after
    some tokens: the sequence ends there with the error, its text still inside the regex."""
    monkeypatch.setitem(GRAMMAR_LIMITS, "max_lexer_states", 40)
    llm = make_llm(tiny_model_dir, 3)
    constrained = SamplingParams(temperature=0, max_tokens=100, structured_outputs={"regex": "[a-z]{90}"})
    outs = llm.generate(PROMPTS[:2], [constrained, SamplingParams(temperature=0, max_tokens=30)])
    c = outs[0].outputs[0]
    assert c.finish_reason == "abort" and "too many states" in c.stop_reason, c
    assert c.stop_reason.startswith("structured_outputs: ")
    assert re.fullmatch("[a-z]{10,89}", c.text), c.text
    assert len(outs[1].outputs[0].token_ids) == 30


def test_ignore_eos_after_a_complete_output_goes_on_with_end_of_sequence(tiny_model_dir, make_llm):
    llm = make_llm(tiny_model_dir, 3)
    out = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                   structured_outputs={"regex": "ab"}))[0].outputs[0]
    eos = llm.get_tokenizer().eos_token_id
    assert (out.finish_reason, out.text) == ("length", "ab"), out
    assert out.token_ids[-1] == eos and len(out.token_ids) == 6


class _Row:
    """What the sampler reads of a sequence for the masks."""

    def __init__(self, grammar):
        self.grammar = grammar


def test_the_batch_mask_equals_each_matchers_own_mask(tiny_model_dir, make_llm):
    """One bitmask for the batch, applied in one op, against llguidance's mask of each matcher
    computed alone: a fresh one, one part-way, one complete (only end-of-sequence), one in error
    (only end-of-sequence, and the sequence ends on its next token) and a Lark grammar's, with
    an unconstrained row among them."""
    from llguidance import LLMatcher

    llm = make_llm(tiny_model_dir, 3)
    manager, tok = _manager(llm), llm.get_tokenizer()
    vocab = llm.llm_engine.model_config.vocab_size
    lark = 'start: "(" num ("+" num)* ")"\nnum: /[0-9]{1,2}/'
    rows = [({"regex": REGEX}, ""), ({"regex": REGEX}, "ab"), ({"regex": "ab"}, "ab"),
            ({"regex": REGEX}, "z"), ({"grammar": lark}, "(1")]
    grammars, want = [], []
    for structured, text in rows:
        g = manager.matcher(manager.compile(StructuredOutputsParams(**structured)))
        ref = LLMatcher(manager.lltokenizer, LLMatcher.grammar_from_regex(structured["regex"])
                        if "regex" in structured else LLMatcher.grammar_from_lark(lark), log_level=0)
        ids = tok.encode(text, add_special_tokens=False)
        for t in ids:
            g.accept(t)
        ref.consume_tokens(ids)
        grammars.append(g)
        want.append(np.unpackbits(np.frombuffer(ref.compute_bitmask(), np.uint8), bitorder="little")[:vocab])
    want = torch.from_numpy(np.stack(want).astype(bool))
    assert want[2].nonzero().flatten().tolist() == [tok.eos_token_id]   # complete: only EOS
    assert want[3].nonzero().flatten().tolist() == [tok.eos_token_id]   # in error: only EOS
    logits = torch.randn(len(rows) + 1, vocab, generator=torch.Generator().manual_seed(0))
    seqs = [_Row(g) for g in grammars[:2]] + [_Row(None)] + [_Row(g) for g in grammars[2:]]
    got = Sampler.apply_grammars(logits, seqs)
    expected = logits.clone()
    expected[[0, 1, 3, 4, 5]] = torch.where(want, logits[[0, 1, 3, 4, 5]], float("-inf"))
    assert torch.equal(got, expected)
    constrained = logits[[0, 1, 3, 4, 5]]    # every row constrained: the same masks
    assert torch.equal(Sampler.apply_grammars(constrained, [_Row(g) for g in grammars]),
                       torch.where(want, constrained, float("-inf")))
    assert [g.error is not None for g in grammars] == [False, False, False, True, False]
