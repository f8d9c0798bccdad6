"""Our decoder equals transformers' on tiny random folders: Llama (grouped-query attention, tied
embeddings, Llama 3.x RoPE scaling), Qwen2 (q/k/v biases) and Qwen3 (q/k norms, head_dim apart);
its layers are `tinyvllm.layers`' plain ones. (The faster layers phases swap in are tested in
their phases: phase 4's CPU kernels in phases/p04_triton_kernels/test_p04_cpu_layers.py.)"""

import pytest
import torch

from phases.p01_naive_attention import NaiveAttention
from tinyvllm.weights import load_model


@pytest.mark.parametrize("model_fixture", ["tiny_model_dir", "tiny_model_dir_llama3", "tiny_qwen2_dir",
                                           "tiny_qwen3_dir"])
def test_logits_equal_transformers(model_fixture, request):
    transformers = pytest.importorskip("transformers")
    folder = request.getfixturevalue(model_fixture)
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    ours = load_model(folder, torch.float32, torch.device("cpu"))
    ids = torch.randint(3, 300, (200,), generator=torch.Generator().manual_seed(0))  # past llama3's 64
    with torch.no_grad():
        expected = ref(ids[None]).logits[0]
        got = ours.compute_logits(ours(ids, torch.arange(len(ids)), NaiveAttention()))
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_the_model_is_built_of_the_plain_layers(tiny_model_dir):
    """What `load_model` returns (phases 1-3 run it as it is) holds only `tinyvllm.layers`' plain
    modules: no CPU kernel, no bfloat16 product, whatever the machine."""
    from tinyvllm.layers import Linear, RMSNorm, RotaryEmbedding

    model = load_model(tiny_model_dir, torch.float32, torch.device("cpu"))
    kinds = {type(m) for m in model.modules()}
    assert {Linear, RMSNorm, RotaryEmbedding} <= kinds
    assert all(t.__module__.startswith(("torch.", "tinyvllm.")) for t in kinds)
    assert not any(hasattr(m, "bf16_rows") for m in model.modules())


def test_a_layer_carries_the_residual_stream_as_vllm_does(tiny_model_dir):
    """`LlamaDecoderLayer` returns (its MLP's output, the stream before it) and leaves each add to
    the next norm (`RMSNorm(x, residual)`): the same numbers, bit for bit, as adding each block's
    output to the stream at once, x = x + block(norm(x))."""
    model = load_model(tiny_model_dir, torch.float32, torch.device("cpu"))
    m = model.model
    ids = torch.randint(3, 300, (40,), generator=torch.Generator().manual_seed(0))
    attn = NaiveAttention()
    with torch.no_grad():
        cos, sin = m.rotary_emb(torch.arange(40), torch.float32)
        rope, x = (cos, sin, m.rotary_emb.rotate), m.embed_tokens(ids)
        for layer in m.layers:   # the textbook way
            x = x + layer.self_attn(layer.input_layernorm(x), rope, attn)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        assert torch.equal(model(ids, torch.arange(40), attn), m.norm(x))
        h = torch.randn(5, m.norm.weight.shape[0])
        normed, stream = m.norm(h, x[:5])
        assert torch.equal(stream, h + x[:5]) and torch.equal(normed, m.norm(h + x[:5]))
