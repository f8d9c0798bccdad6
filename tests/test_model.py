"""Our decoder equals transformers' on tiny random folders: Llama (grouped-query attention, tied
embeddings, Llama 3.x RoPE scaling), Qwen2 (q/k/v biases) and Qwen3 (q/k norms, head_dim apart)."""

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


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("vendor_rule", ["Intel", "other"])
def test_linear_fast_paths_equal_f_linear(rows, bias, vendor_rule):
    """The model's Linear takes, for a few rows, MKL's F.linear on an Intel CPU and (W @ x^T)^T
    elsewhere (one row padded to two), and oneDNN with a packed weight beyond: each vendor's
    rule, tried on this machine, gives the same numbers as F.linear."""
    from tinyvllm.model import Linear

    torch.manual_seed(rows)
    layer = Linear(48, 80, bias=bias)
    layer.small_rows, layer.small_rows_mkl = (3, True) if vendor_rule == "Intel" else (2, False)
    x = torch.randn(rows, 48)
    with torch.inference_mode():
        y = layer(x)
    assert y.shape == (rows, 80) and y.is_contiguous()
    torch.testing.assert_close(y, torch.nn.functional.linear(x, layer.weight, layer.bias))


def test_linear_packed_weight_follows_the_weight():
    """The packed copy is made again when the weight is changed in place (as loading does) or
    replaced, so the product never uses stale numbers."""
    from tinyvllm.model import Linear

    if not Linear.use_onednn:
        pytest.skip("no oneDNN on this machine: Linear uses F.linear, nothing is packed")
    layer = Linear(48, 80, bias=False)
    x = torch.randn(16, 48)
    with torch.inference_mode():
        layer(x)
        first = layer.packed_weight()
        assert layer.packed_weight() is first                 # packed once, then reused
    with torch.no_grad():
        layer.weight.mul_(2.0)                                # in place: the loader's copy_
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), x @ layer.weight.T)
        assert layer.packed_weight() is not first
    layer.weight = torch.nn.Parameter(torch.randn(80, 48))    # replaced
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), x @ layer.weight.T)


def test_linear_keeps_autograd_working():
    """With gradients on, Linear is plain F.linear, so the weight gets its gradient."""
    from tinyvllm.model import Linear

    layer = Linear(48, 80)
    layer(torch.randn(16, 48)).sum().backward()
    assert layer.weight.grad is not None and layer.weight.grad.shape == (80, 48)


def test_onednn_product_as_an_operator_equals_the_eager_one():
    """`torch.ops.tinyvllm.onednn_linear` (what a compiled graph of many rows calls) gives the
    eager many-rows product's numbers, and its fake version agrees with it."""
    from tinyvllm.model import Linear

    if not Linear.use_onednn:
        pytest.skip("no oneDNN on this CPU")
    torch.manual_seed(0)
    layer = Linear(64, 40).requires_grad_(False)
    x = torch.randn(8, 64)
    op = torch.ops.tinyvllm.onednn_linear
    assert torch.equal(op(x, layer.weight, layer.bias), layer(x))
    torch.library.opcheck(op, (x, layer.weight, layer.bias), test_utils=("test_schema", "test_faketensor"))
