"""Shared pytest fixtures for tests/ (the shared suite) and phases/ (the checkpoints).

- Every registered phase gets a marker: `pytest -m phase02` runs phase 2's checkpoint and its
  cases of the shared suite.
- `gpu` tests are skipped, with the reason, where no CUDA GPU is present.
- Engines are cached per session: loading the default model takes seconds, not every test.
"""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

import phases  # noqa: E402

PHASE_NUMBERS = sorted(phases.PHASES)


def phase_params(min_phase: int = 1):
    """pytest.param for each registered phase >= min_phase, marked phaseNN."""
    return [pytest.param(p, id=f"phase{p}", marks=getattr(pytest.mark, f"phase{p:02d}"))
            for p in PHASE_NUMBERS if p >= min_phase]


def pytest_collection_modifyitems(config, items):
    has_gpu = torch.cuda.is_available()
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; none is present")
    for item in items:
        parts = Path(str(item.fspath)).parts
        for part in parts:
            if part.startswith("p") and part[1:3].isdigit() and "_" in part:
                item.add_marker(getattr(pytest.mark, f"phase{part[1:3]}"))
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    from tinyvllm.download import ensure_default_model
    return ensure_default_model(quiet=True)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama with grouped-query attention (4 query heads, 2 KV heads)."""
    from tinyvllm.testing import make_tiny_llama
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-gqa"))


@pytest.fixture(scope="session")
def tiny_model_dir_llama3(tmp_path_factory) -> Path:
    """Another shape: tied embeddings, 3 layers, 8 query heads over 1 KV head, llama3 RoPE."""
    from tinyvllm.testing import make_tiny_llama
    return make_tiny_llama(
        tmp_path_factory.mktemp("tiny-llama3"), hidden_size=64, num_layers=3, num_heads=8,
        num_kv_heads=1, tie_word_embeddings=True, seed=1,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64})


_LLMS: dict = {}


@pytest.fixture(scope="session")
def make_llm():
    """make_llm(model_dir, phase, **engine_args) -> a cached LLM."""
    from tinyvllm import LLM

    def make(model, phase, **kwargs):
        key = (str(model), phase, tuple(sorted(kwargs.items())))
        if key not in _LLMS:
            _LLMS[key] = LLM(str(model), phase=phase, **kwargs)
        return _LLMS[key]

    yield make
    _LLMS.clear()


@pytest.fixture(scope="session")
def hf_gguf():
    """transformers' own loading of the default model's GGUF file: the reference.
    Returns (model, tokenizer)."""
    pytest.importorskip("transformers", reason="transformers is the test reference: pip install -e '.[dev]'")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from tinyvllm.download import ensure_default_model, ensure_gguf

    ensure_default_model(quiet=True)
    gguf = ensure_gguf(quiet=True)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                 dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    return model, tok
