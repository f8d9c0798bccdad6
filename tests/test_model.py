"""Our Llama equals transformers' LlamaForCausalLM on tiny random folders: grouped-query
attention, tied embeddings and Llama 3.x RoPE scaling."""

import pytest
import torch

from phases.p01_naive_attention import NaiveAttention
from tinyvllm.weights import load_model


@pytest.mark.parametrize("model_fixture", ["tiny_model_dir", "tiny_model_dir_llama3"])
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


@pytest.mark.parametrize("rows", [1, 2, 7, 8, 9, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_small_batch_path_equals_f_linear(rows, bias):
    """The model's Linear takes (W @ x^T)^T for 1..8 rows on a CPU (one row padded to two): the
    same numbers as F.linear."""
    from tinyvllm.model import Linear

    torch.manual_seed(rows)
    layer = Linear(48, 80, bias=bias)
    x = torch.randn(rows, 48)
    y = layer(x)
    assert y.shape == (rows, 80) and y.is_contiguous()
    torch.testing.assert_close(y, torch.nn.functional.linear(x, layer.weight, layer.bias))
