"""Sliding windows and Gemma 3 on every phase: folders transformers wrote itself (Gemma 3: five of
six layers windowed, two RoPE bases, (1 + w) norms before and after each block, a scaled
embedding, a GELU gate, query_pre_attn_scalar; Mistral: every layer windowed; Qwen2: windowed
from max_window_layers on) with a window of 8 tokens, at contexts of 4-7 windows. Each phase
either gives transformers' greedy tokens or refuses the model by name: never other tokens."""

import random

import pytest
import torch

from tinyvllm import LLM, SamplingParams

transformers = pytest.importorskip("transformers")

WINDOW = 8
FAMILIES = {
    "gemma3": ("Gemma3ForCausalLM", {"num_layers": 3, "sliding_window_pattern": 3}),  # local, local, global
    "mistral": ("MistralForCausalLM", {}),
    "qwen2": ("Qwen2ForCausalLM", {"use_sliding_window": True, "max_window_layers": 1}),  # full, windowed
}
MAX_TOKENS = 12
# each phase with the engine arguments that take its window-aware path (the block size of 4 makes
# a window span several blocks; phase 3's small pool and budget preempt and chunk the prompts)
PHASES = {1: {}, 2: {"block_size": 4, "num_kv_blocks": 64},
          3: {"block_size": 4, "num_kv_blocks": 24, "max_num_batched_tokens": 16, "max_num_seqs": 3},
          4: {}, 5: {"kv_cache_dtype": "auto"},
          6: {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}},
          7: {},   # the static decode step: the C step where it serves, else the fused forward (Gemma 3: eager)
          9: {"enforce_eager": True, "async_scheduling": True},
          10: {"enforce_eager": True,
               "kv_transfer_config": {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}},
          11: {"async_scheduling": True, "block_size": 4, "num_kv_blocks": 40, "max_num_batched_tokens": 16}}
for _args in PHASES.values():   # float32 products at every row count, as transformers' (not the kind's bfloat16)
    _args["dtype"] = "float32"
_FOLDERS: dict = {}
_HF: dict = {}


def prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, 300) for _ in range(n)] for n in (5, 23, 40)]   # up to 52 = 6.5 windows


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from tinyvllm.testing import make_tiny_family

    def make(family: str):
        if family not in _FOLDERS:
            arch, fields = FAMILIES[family]
            _FOLDERS[family] = make_tiny_family(tmp_path_factory.mktemp(family), arch, sliding_window=WINDOW,
                                                seed=5, **fields)
        return _FOLDERS[family]
    return make


def hf_greedy(folder) -> list[list[int]]:
    if str(folder) not in _HF:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
        with torch.no_grad():
            _HF[str(folder)] = [model.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                               min_new_tokens=MAX_TOKENS)[0, len(p):].tolist() for p in prompts()]
    return _HF[str(folder)]


def generate(llm) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_equal_transformers_past_the_window(family, folder):
    """The reference path (phase 1's attention with each layer's window) at 5 windows of context:
    transformers' logits within 1e-4."""
    from phases.p01_naive_attention import NaiveAttention
    from tinyvllm.config import ModelConfig
    from tinyvllm.weights import load_model

    path = folder(family)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ours = load_model(path, torch.float32, torch.device("cpu"), 512)
    windows = ModelConfig.from_pretrained(path).layer_windows(512)
    assert WINDOW in windows, windows
    ids = torch.tensor(prompts()[2])
    with torch.no_grad():
        want = hf(ids[None]).logits[0]
        got = ours.compute_logits(ours(ids, torch.arange(len(ids)), NaiveAttention(windows)))
        full = ours.compute_logits(ours(ids, torch.arange(len(ids)), NaiveAttention()))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert (full - want)[2 * WINDOW:].abs().max() > 1e-2, "the window changes nothing: the test tests nothing"


# phases 9 and 10 add no attention path of their own (a process, a step ahead, a tier): one family
CASES = [(p, f) for p in sorted(PHASES) for f in sorted(FAMILIES) if p < 9 or f == "gemma3"]


@pytest.mark.parametrize("phase, family", CASES, ids=[f"phase{p}-{f}" for p, f in CASES])
def test_every_phase_gives_transformers_tokens_past_the_window(phase, family, folder):
    """Phases 1-3 as they come (phase 3 chunking, preempting and hitting its prefix cache across
    the window), phases 4-10 with phase 4's CPU attention (its C decode kernel in each row's
    window, a windowed layer's prompts on phase 2's path; phase 7 in its static decode step, Gemma 3
    eagerly);
    phase 6 verifying n-gram drafts across the window's edge, phase 9 scheduling a step ahead,
    phase 10 saving every block to its offload tier, phase 11 scheduling a step ahead over its
    groups' tables (each step's frozen, while the next gives back what a window left), preempting."""
    path = folder(family)
    eager = {"enforce_eager": True} if phase == 7 and family == "gemma3" else {}   # not Llama's layers
    got = generate(LLM(str(path), phase=phase, **PHASES[phase], **eager))
    assert got == hf_greedy(path)
    if phase == 3:   # the same prompts again: prefix hits past the window, still transformers' tokens
        llm = LLM(str(path), phase=3, block_size=4, num_kv_blocks=64)
        assert generate(llm) == generate(llm) == hf_greedy(path)
        from phases.p03_continuous_batching.batch_invariant import KERNELS

        if KERNELS.available():   # batch_invariant=True: its C kernel reads each query's window
            llm = LLM(str(path), phase=3, block_size=4, num_kv_blocks=24, max_num_batched_tokens=16,
                      batch_invariant=True)
            assert generate(llm) == hf_greedy(path)


def test_two_ranks_give_transformers_tokens_past_the_window(folder):
    """Phase 8: each rank's share of the KV heads, each layer's window."""
    path = folder("gemma3")
    llm = LLM(str(path), phase=8, tensor_parallel_size=2, attention_backend="torch", enforce_eager=True,
              num_kv_blocks=64, dtype="float32")
    assert generate(llm) == hf_greedy(path)


@pytest.mark.parametrize("family", ["gemma3", "qwen2"])
def test_phase_11_on_two_ranks_gives_transformers_tokens(family, folder):
    """Phase 11 on two ranks: each rank's pool of its KV heads in groups, the worker built as phase
    11 (its groups' tables sent with each forward); chunked and preempted in a small pool."""
    path = folder(family)
    blocks = {"gemma3": 40, "qwen2": 24}[family]   # each preempts
    llm = LLM(str(path), phase=11, tensor_parallel_size=2, block_size=4, num_kv_blocks=blocks, max_num_batched_tokens=16,
              dtype="float32")
    assert generate(llm) == hf_greedy(path)
    assert llm.llm_engine.get_stats()["num_preemptions"] > 0


@pytest.mark.parametrize("family", ["gemma3", "mistral"])
def test_an_int8_kv_cache_attends_in_each_window_on_the_cpu_path(family, folder):
    """Phase 5's int8 KV cache on its default CPU attention (a windowed layer through phase 2's
    paged attention over the dequantized blocks, in its window) gives the tokens of its PyTorch
    attention (which reads the same dequantized blocks in each window)."""
    path = folder(family)
    args = dict(phase=5, kv_cache_dtype="int8", block_size=4, num_kv_blocks=64, dtype="float32")
    got = generate(LLM(str(path), **args))
    assert got == generate(LLM(str(path), **args, attention_backend="torch"))


@pytest.mark.parametrize("kind", ["avx2", None])
def test_the_static_decode_step_reads_each_layer_s_window(kind, folder):
    """Phase 7's static decode step on Mistral and Qwen2 with windows: as the avx2 kind (where the
    C step serves a float32 model: each layer's window in its attention row) and as this machine
    acts, transformers' tokens; the static step ran."""
    from contextlib import nullcontext

    from tinyvllm import platform

    if kind is not None and kind not in platform.acting_kinds():
        pytest.skip(f"this CPU cannot act as {kind}")
    with platform.using(platform.platform_as(kind)) if kind else nullcontext():
        _static_steps_give_transformers_tokens(folder, kind)


def _static_steps_give_transformers_tokens(folder, kind):
    for family in ("mistral", "qwen2"):
        path = folder(family)
        llm = LLM(str(path), phase=7, dtype="float32", num_kv_blocks=64)
        assert generate(llm) == hf_greedy(path)
        runner = llm.llm_engine.runner
        assert runner.num_static_steps >= len(prompts()) * (MAX_TOKENS - 1) // 3   # decodes in the static step
        if kind == "avx2":
            assert runner.decode_runner.c_step is not None and runner.decode_runner.c_step.serves(1)


def test_a_llama_folder_made_windowed_is_transformers_mistral(tmp_path):
    """`make_windowed_like` (the lesson's windowed default model): a Llama folder as a Mistral with
    a window, the same weights: transformers' tokens as a Mistral on phase 11, not the Llama's."""
    from tinyvllm.testing import make_tiny_family, make_windowed_like

    llama = make_tiny_family(tmp_path / "llama", "LlamaForCausalLM", seed=5)
    path = make_windowed_like(llama, tmp_path / "windowed", sliding_window=WINDOW)
    want = hf_greedy(path)
    assert generate(LLM(str(path), phase=11, dtype="float32", num_kv_blocks=64)) == want
    assert want != hf_greedy(llama), "the window changes no token at 6.5 windows"
    with pytest.raises(ValueError, match="not a Llama"):
        make_windowed_like(path, tmp_path / "again")


def test_gemma3_is_refused_by_the_static_decode_step(folder):
    with pytest.raises(ValueError, match=r"phase 7's static decode step runs Llama's layers, not Gemma3ForCausalLM"):
        LLM(str(folder("gemma3")), phase=7, num_kv_blocks=64, max_model_len=WINDOW)


def test_config_fields_that_disagree_are_refused_by_name():
    from tinyvllm.config import ModelConfig

    base = {"vocab_size": 32, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 4,
            "num_attention_heads": 2, "architectures": ["Gemma3ForCausalLM"], "sliding_window": 8}
    gemma = ModelConfig.from_dict({**base, "sliding_window_pattern": 2, "rope_local_base_freq": 1e4})
    assert gemma.layer_types == ("sliding_attention", "full_attention") * 2
    assert gemma.layer_windows(64) == (8, None, 8, None) and gemma.layer_windows(8) == (None,) * 4
    assert (gemma.norm_weight_offset, gemma.post_norms, gemma.hidden_act) == (1.0, True, "gelu_pytorch_tanh")
    bad = [({"layer_types": ["full_attention"] * 3}, r"layer_types must list 4 entries"),
           ({"layer_types": ["local"] * 4}, r"layer_types must list 4 entries"),
           ({"sliding_window_pattern": 2, "layer_types": ["sliding_attention"] * 4},
            r"layer_types .* disagrees with sliding_window_pattern=2"),
           ({"sliding_window_pattern": 0}, r"sliding_window_pattern must be a positive integer"),
           ({"sliding_window": None}, r"sliding_attention layers, but sliding_window is null"),
           ({"sliding_window": 0}, r"sliding_window must be a positive integer"),
           ({"sliding_window": 4096, "max_position_embeddings": 2048}, r"sliding_window=4096 is larger than the context"),
           ({"final_logit_softcapping": 30.0}, r"final_logit_softcapping=30.0 is not supported")]
    for fields, message in bad:
        with pytest.raises(ValueError, match=message):
            ModelConfig.from_dict({**base, **fields})
    mistral = {**base, "architectures": ["MistralForCausalLM"]}
    assert ModelConfig.from_dict(mistral).layer_windows(64) == (8,) * 4
    assert ModelConfig.from_dict({**mistral, "sliding_window": None}).layer_windows(64) == (None,) * 4
