"""Every registered family on every phase: folders transformers wrote itself (Qwen2: q/k/v biases;
Qwen3: per-head q/k norms, every bias, head_dim apart from hidden / heads, tied embeddings) give
transformers' greedy tokens on phases 1-8, quantized, speculative and compiled included; the
registry refuses what it does not know, by name."""

import json
import random

import pytest
import torch

from conftest import phase_params
from tinyvllm import LLM, SamplingParams

transformers = pytest.importorskip("transformers")

FAMILIES = ["tiny_qwen3_dir", "tiny_qwen2_dir"]
MAX_TOKENS = 12
_HF_TOKENS: dict = {}


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in (5, 23, 70)]  # 1, 2 and 5 blocks


def hf_greedy(folder) -> list[list[int]]:
    """transformers' greedy continuation of each prompt (its full forward at every token)."""
    if str(folder) not in _HF_TOKENS:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
        outs = []
        for ids in _prompts(model.config.vocab_size):
            ids = list(ids)
            with torch.no_grad():
                for _ in range(MAX_TOKENS):
                    ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            outs.append(ids[-MAX_TOKENS:])
        _HF_TOKENS[str(folder)] = outs
    return _HF_TOKENS[str(folder)]


def generate(llm, folder) -> list[list[int]]:
    prompts = [{"prompt_token_ids": p} for p in _prompts(llm.llm_engine.model_config.vocab_size)]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


# make test-kinds runs phases 4 on as every kind: phases 1-3 run PyTorch's products and attention,
# which no kind changes (the suite keeps bfloat16 products off)
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("phase", phase_params(kinds_from=4))
def test_every_phase_gives_transformers_greedy_tokens(phase, family, request, make_llm):
    """Phase 8 runs two ranks here (make_llm): the biases split with their columns (o_proj's added
    once), the q/k norms on every rank's heads."""
    folder = request.getfixturevalue(family)
    assert generate(make_llm(folder, phase), folder) == hf_greedy(folder)


@pytest.mark.parametrize("family", FAMILIES)
def test_speculative_decoding_with_a_draft_of_the_same_family(family, request, tmp_path):
    """A one-layer draft of the same family (its own random weights: it proposes badly, and the
    target's verification keeps transformers' tokens), and prompt lookup (ngram)."""
    from tinyvllm.testing import make_tiny_family

    folder = request.getfixturevalue(family)
    arch = json.loads((folder / "config.json").read_text())["architectures"][0]
    draft = make_tiny_family(tmp_path / "draft", arch, num_layers=1, seed=11)
    for spec in ({"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3},
                 {"method": "ngram", "num_speculative_tokens": 3}):
        llm = LLM(str(folder), phase=6, speculative_config=spec, num_kv_blocks=64)
        assert generate(llm, folder) == hf_greedy(folder), spec["method"]
        if spec["method"] == "draft_model":  # the draft proposed at every step
            assert llm.llm_engine.get_stats()["spec_num_draft_tokens"] > 0


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantization_keeps_the_biases_and_the_norms_float(tiny_qwen3_dir, quantization):
    """Phase 5 quantizes the projections' weights; their biases and Qwen3's q/k norms stay float,
    and the logits stay those of the float model with the rounded weights."""
    from phases.p01_naive_attention import NaiveAttention
    from phases.p05_quantization.quant import QuantizedLinear
    from phases.p05_quantization.quantize_layers import linear_layers

    llm = LLM(str(tiny_qwen3_dir), phase=5, quantization=quantization, quantization_group_size=32,
              num_kv_blocks=64)
    model = llm.llm_engine.model
    attn = model.model.layers[0].self_attn
    assert type(attn.q_proj) is QuantizedLinear and type(attn.o_proj) is QuantizedLinear
    assert not linear_layers(model)
    for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj):
        assert m.bias is not None and m.bias.dtype == torch.float32
    assert attn.q_norm.weight.dtype == attn.k_norm.weight.dtype == torch.float32

    ref = LLM(str(tiny_qwen3_dir), phase=5, num_kv_blocks=64)
    for name, m in linear_layers(ref.llm_engine.model):
        if name != "lm_head":  # tied: rounding it would round the embedding, which stays float
            m.weight.data = QuantizedLinear(m.weight, None, quantization, 32).dequantize()
    ids = torch.tensor(_prompts(320)[1])
    with torch.inference_mode():  # the hidden states: every projection, norm and bias
        want = ref.llm_engine.model(ids, torch.arange(len(ids)), NaiveAttention())
        got = model(ids, torch.arange(len(ids)), NaiveAttention())
    # int8's kernels keep about 15 bits of x; cpu_int4 rounds x to int8 per block of 32 (phase 5):
    # 2.5% here, where the rounding of the int4 weights themselves moves these states by 32%
    assert ((want - got).norm() / want.norm()) < {"int8": 0.02, "int4": 0.06}[quantization]


def test_compiled_decode_step_gives_transformers_greedy_tokens(tiny_qwen3_dir):
    """Phase 7's compiled decode step: Qwen3's norms inside the fused decode forward, in a graph."""
    from phases.p07_cuda_graphs.compiled import CompiledDecodeRunner

    llm = LLM(str(tiny_qwen3_dir), phase=7, compilation_mode=1, num_kv_blocks=64, max_num_seqs=1)
    assert generate(llm, tiny_qwen3_dir) == hf_greedy(tiny_qwen3_dir)
    assert isinstance(llm.llm_engine.runner.decode_runner, CompiledDecodeRunner)
    assert llm.llm_engine.runner.num_static_steps > 0


def test_the_registry_names_what_it_does_not_know():
    from tinyvllm.config import ModelConfig

    base = {"vocab_size": 32, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
            "num_attention_heads": 2}
    with pytest.raises(ValueError, match=r"architecture GPT2LMHeadModel is not supported "
                                         r"\(supported: LlamaForCausalLM \(llama\), .*Qwen3ForCausalLM"):
        ModelConfig.from_dict({**base, "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    with pytest.raises(ValueError, match="model_type 'gemma3' is not supported"):
        ModelConfig.from_dict({**base, "model_type": "gemma3"})
    # no `architectures`: the model_type finds the family; the family sets the switches
    qwen2 = ModelConfig.from_dict({**base, "model_type": "qwen2", "attention_bias": False})
    assert (qwen2.architecture, qwen2.qkv_bias, qwen2.o_bias, qwen2.qk_norm) == ("Qwen2ForCausalLM", True, False, False)
    qwen3 = ModelConfig.from_dict({**base, "architectures": ["Qwen3ForCausalLM"], "head_dim": 24})
    assert (qwen3.qkv_bias, qwen3.qk_norm, qwen3.head_dim) == (False, True, 24)
    # Qwen's sliding_window counts only with use_sliding_window (off in published checkpoints)
    assert ModelConfig.from_dict({**base, "model_type": "qwen2", "sliding_window": 8}).sliding_window is None
    assert ModelConfig.from_dict({**base, "model_type": "qwen2", "sliding_window": 8, "max_window_layers": 0,
                                  "use_sliding_window": True}).sliding_window == 8


def test_qwen3_chat_template_kwargs_reach_the_template(tiny_qwen3_dir):
    """The Qwen folder's template (ChatML) renders, and `chat_template_kwargs` reach it, as vLLM's
    `LLM.chat` passes them (Qwen3's enable_thinking=False)."""
    llm = LLM(str(tiny_qwen3_dir), phase=1)
    msgs = [{"role": "user", "content": "hi"}]
    tok = llm.get_tokenizer()
    assert tok.apply_chat_template(msgs) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    out = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False,
                   chat_template_kwargs={"enable_thinking": False})
    assert out[0].prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    with pytest.raises(ValueError, match="chat_template_kwargs: 'messages'"):
        llm.chat(msgs, chat_template_kwargs={"messages": []})
