"""No engine argument is silently ignored: every registered phase x every engine argument.

A value that asks a phase for a feature it lacks (`quantization="int4"` on phase 3) is a
ValueError naming the argument and the first phase that has it; a value the phase acts on is
accepted; a value that changes nothing (`enforce_eager=True` on an always-eager engine) is
accepted. A refused LLM(...) leaves an LLM built before it generating the same tokens.
"""

from __future__ import annotations

import re
from dataclasses import MISSING, fields

import pytest

import phases
from conftest import phase_params
from tinyvllm import LLM, SamplingParams
from tinyvllm.config import NEUTRAL_ENGINE_ARG_VALUES, EngineConfig

# For each engine argument: a valid value other than its default and other than a neutral one,
# i.e. one that asks for something. Arguments whose only other values are neutral (booleans whose
# feature can always be done without) are covered by the neutral test below.
ASKING_VALUES: dict = {
    "dtype": "float32", "device": "cpu", "seed": 1, "max_model_len": 256, "tokenizer": "/a/tokenizer/folder",
    "block_size": 8, "num_kv_blocks": 64, "kv_cache_memory": 1 << 22, "gpu_memory_utilization": 0.5,
    "max_num_seqs": 4, "max_num_batched_tokens": 512, "batch_invariant": True,
    "attention_backend": "triton", "quantization": "int8", "quantization_group_size": 64,
    "kv_cache_dtype": "int8", "speculative_config": {"method": "ngram", "num_speculative_tokens": 3},
    "cudagraph_capture_sizes": [1, 2], "compilation_mode": 1, "tensor_parallel_size": 2,
    "nnodes": 2, "node_rank": 1, "master_addr": "10.0.0.1", "master_port": 29600,
    "disable_log_stats": False, "async_scheduling": True,
    "kv_transfer_config": {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                           "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 22}},
}
NO_ASKING_VALUE = {"enable_chunked_prefill", "enable_prefix_caching", "enforce_eager", "check_kernels"}
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPT = {"prompt_token_ids": [5, 6, 7, 8]}


def test_every_engine_argument_has_a_test_value():
    """A new EngineConfig field must be added here (so every phase is walked through it)."""
    names = {f.name for f in fields(EngineConfig)}
    assert names == set(ASKING_VALUES) | NO_ASKING_VALUE, (
        f"add the new engine argument(s) {sorted(names - set(ASKING_VALUES) - NO_ASKING_VALUE)} to "
        f"ASKING_VALUES (a value that asks for the feature) or NO_ASKING_VALUE")
    defaults = {f.name: (f.default if f.default is not MISSING else f.default_factory()) for f in fields(EngineConfig)}
    for name, value in ASKING_VALUES.items():
        EngineConfig.from_kwargs(**{name: value})  # valid
        assert value != defaults[name] and value not in NEUTRAL_ENGINE_ARG_VALUES.get(name, ()), name
    for name in NO_ASKING_VALUE:   # a switch: each value the default or neutral, and the default not neutral
        assert all(v == defaults[name] or v in NEUTRAL_ENGINE_ARG_VALUES[name] for v in (True, False)), name
        assert defaults[name] not in NEUTRAL_ENGINE_ARG_VALUES[name], name


@pytest.fixture(scope="module")
def before(tiny_model_dir):
    """An LLM built before the refusals, and its greedy tokens."""
    llm = LLM(str(tiny_model_dir), phase=phases.latest_phase())
    return llm, llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize("name", sorted(ASKING_VALUES))
@pytest.mark.parametrize("phase", phase_params())
def test_engine_argument_accepted_or_refused(phase, name, tiny_model_dir, before):
    value = ASKING_VALUES[name]
    if name in phases.get_recipe(phase).engine_args:
        phases.check_engine_args(phase, {name: value})  # the phase acts on it: not refused
        return
    first = phases.first_phase_with(name)
    where = f"phase {first} is the first that has it" if first else "no registered phase has it yet"
    # refused before the model loads, naming the argument and where the feature is
    with pytest.raises(ValueError, match=rf"^{re.escape(name)}=.*phase {phase} does not have.*{where}"):
        LLM(str(tiny_model_dir), phase=phase, **{name: value})
    if first is not None:
        assert first > phase and name in phases.get_recipe(first).engine_args
    llm, tokens = before
    assert llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == tokens


@pytest.mark.parametrize("phase", phase_params())
def test_neutral_values_accepted(phase, tiny_model_dir):
    """Values that change nothing on a phase without the feature are accepted, and it generates."""
    neutral = {name: values[0] for name, values in NEUTRAL_ENGINE_ARG_VALUES.items()}
    honoured = phases.get_recipe(phase).engine_args
    lacking = {k: v for k, v in neutral.items() if k not in honoured}
    llm = LLM(str(tiny_model_dir), phase=phase, **lacking)
    out = llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert len(out) == GREEDY.max_tokens


@pytest.mark.parametrize("phase", phase_params())
def test_honoured_values_build_an_engine(phase, tiny_model_dir):
    """The cheap arguments a phase acts on, all at once: the engine builds and generates."""
    cheap = ("dtype", "device", "seed", "max_model_len", "block_size", "num_kv_blocks", "max_num_seqs",
             "max_num_batched_tokens")
    honoured = phases.get_recipe(phase).engine_args
    args = {k: ASKING_VALUES[k] for k in cheap if k in honoured}
    llm = LLM(str(tiny_model_dir), phase=phase, **args)
    assert len(llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == GREEDY.max_tokens
