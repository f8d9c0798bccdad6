"""AWQ and GPTQ int4 checkpoints, built here with each format's documented packing: phase 5 reads
every layer from its own codes (`QuantizedLinear` int4) whose dequantized weight is the format's
reference dequantization bit for bit, and the greedy tokens are the float model's with those
weights; what is not read is refused by name."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tinyvllm.testing import make_tiny_llama

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPTS = [[5, 77, 140, 9, 33], [200, 3, 18]]


def pack_awq(intweight: torch.Tensor) -> torch.Tensor:
    """AutoAWQ's GEMM packing: (R, C) codes -> (R, C/8) int32, nibble k of each holding column
    AWQ_ORDER[k] of its eight."""
    r, c = intweight.shape
    out = torch.zeros(r, c // 8, dtype=torch.int64)
    for col in range(c // 8):
        for k in range(8):
            out[:, col] |= intweight[:, col * 8 + AWQ_ORDER[k]].long() << (4 * k)
    return out.to(torch.uint32).view(torch.int32) if hasattr(torch, "uint32") else out.int()


def pack_rows(intweight: torch.Tensor) -> torch.Tensor:
    """AutoGPTQ's qweight packing: (I, O) codes -> (I/8, O) int32, nibble k of row r holding row 8r + k."""
    i, o = intweight.shape
    out = torch.zeros(i // 8, o, dtype=torch.int64)
    for k in range(8):
        out |= intweight[k::8].long() << (4 * k)
    return _int32(out)


def pack_cols(intweight: torch.Tensor) -> torch.Tensor:
    """AutoGPTQ's qzeros packing: (G, O) -> (G, O/8) int32, nibble k of column c holding column 8c + k."""
    return pack_rows(intweight.T.contiguous()).T.contiguous()


def _int32(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x >= 2 ** 31, x - 2 ** 32, x).to(torch.int32)


def make_quantized(src, folder, method: str, group_size: int, desc_act: bool = False, v2: bool = False, seed=0):
    """`src`'s tiny Llama with every projection replaced by random 4-bit codes, zero points and
    float16 scales, written as an AWQ or GPTQ checkpoint in `folder`, and the same model with the
    reference dequantization w[o, i] = (q - z[g_idx[i], o]) * s[g_idx[i], o] (float32) as plain
    weights in `folder`-float. Returns both folders and the reference weights."""
    g = torch.Generator().manual_seed(seed)
    tensors, ref = load_file(str(src / "model.safetensors")), {}
    float_tensors = dict(tensors)
    for name in [n for n in tensors if n.rsplit(".", 2)[-2] in PROJECTIONS]:
        o, i = tensors[name].shape
        groups = i // group_size
        q = torch.randint(0, 16, (o, i), generator=g)
        z = torch.randint(0, 16, (groups, o), generator=g)
        s = (torch.rand(groups, o, generator=g) * 0.02 + 0.01).half()
        g_idx = torch.arange(i) // group_size
        if desc_act:   # act-order: the columns quantized in another order, so groups are scattered
            g_idx = g_idx[torch.randperm(i, generator=g)]
        w = torch.empty(o, i)
        for col in range(i):
            w[:, col] = (q[:, col] - z[g_idx[col]]).float() * s[g_idx[col]].float()
        layer = name.removesuffix(".weight")
        del tensors[name]
        float_tensors[name] = ref[layer] = w
        tensors[f"{layer}.scales"] = s
        if method == "awq":
            tensors[f"{layer}.qweight"], tensors[f"{layer}.qzeros"] = pack_awq(q.T.contiguous()), pack_awq(z)
        else:
            tensors[f"{layer}.qweight"] = pack_rows(q.T.contiguous())
            tensors[f"{layer}.qzeros"] = pack_cols(z if v2 else (z - 1) & 15)   # v1 stores z - 1
            tensors[f"{layer}.g_idx"] = g_idx.int()
            tensors[f"{layer}.bias"] = torch.zeros(o, dtype=torch.float16)   # AutoGPTQ's, on a model without
    out = {}
    for f, t, quant in ((folder, tensors, True), (folder.with_name(folder.name + "-float"), float_tensors, False)):
        f.mkdir(parents=True)
        for extra in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(src / extra, f / extra)
        cfg = json.loads((src / "config.json").read_text())
        if quant:
            cfg["torch_dtype"] = "float16"
            cfg["quantization_config"] = (
                {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"}
                if method == "awq" else
                {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": desc_act, "sym": False,
                 **({"checkpoint_format": "gptq_v2"} if v2 else {})})
        (f / "config.json").write_text(json.dumps(cfg))
        save_file({k: v.contiguous() for k, v in t.items()}, str(f / "model.safetensors"))
        out[quant] = f
    return out[True], out[False], ref


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("src"), hidden_size=256, intermediate_size=512)


def _tokens(llm):
    from tinyvllm import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("method,group_size,desc_act,v2", [
    ("awq", 128, False, False), ("awq", 32, False, False), ("gptq", 128, False, False),
    ("gptq", 32, True, False), ("gptq", 128, False, True)])
def test_a_checkpoint_is_read_exactly_from_its_codes(src, tmp_path, method, group_size, desc_act, v2):
    """Phase 5 holds each projection as int4 codes (a GPTQ act-order checkpoint, whose groups are
    scattered, as float32 weights), each dequantizing to the format's reference bit for bit; the
    greedy tokens of phase 5 (its layers' products from those codes dequantized: `reference`; the
    C kernels round x to 8 bits, phase 5's checkpoint tests bound them) and of phase 1 (float
    weights) equal tinyvllm's on the float model with those weights."""
    from phases.p05_quantization.quant import QuantizedLinear
    from tinyvllm import LLM

    quant, plain, ref = make_quantized(src, tmp_path / "q", method, group_size, desc_act, v2)
    llm = LLM(str(quant), phase=5)
    model = llm.llm_engine.model
    for layer, w in ref.items():
        m = model.get_submodule(layer)
        if desc_act:
            assert not isinstance(m, QuantizedLinear) and torch.equal(m.weight, w), layer
        else:
            m.kernel = "reference"
            assert isinstance(m, QuantizedLinear) and m.method == "int4" and m.group_size == group_size, layer
            assert torch.equal(m.dequantize(torch.float32), w), f"{layer}: not the reference's weights"
            assert torch.equal(m.dequantize(torch.float16), w.half()), layer   # the formats' float16 one
    want = _tokens(LLM(str(plain), phase=5, quantization=None))
    assert _tokens(llm) == want
    assert _tokens(LLM(str(quant), phase=1)) == want


@pytest.mark.parametrize("edit,message", [
    ({"bits": 3}, r"quantization_config.bits=3 \(gptq\) is not supported: only 4-bit"),
    ({"bits": 8}, r"quantization_config.bits=8 \(gptq\) is not supported"),
    ({"quant_method": "bitsandbytes"}, r"quantization_config.quant_method 'bitsandbytes' is not supported"),
    ({"desc_act": True, "drop": "g_idx"}, r"model.layers.0.\w+.\w+_proj in .*: the checkpoint says desc_act \(act-order\) but has no g_idx"),
])
def test_what_is_not_read_is_refused_by_name(src, tmp_path, edit, message):
    from tinyvllm import LLM

    quant, _, _ = make_quantized(src, tmp_path / "q", "gptq", 128)
    cfg = json.loads((quant / "config.json").read_text())
    edit = dict(edit)
    drop = edit.pop("drop", None)
    cfg["quantization_config"].update(edit)
    (quant / "config.json").write_text(json.dumps(cfg))
    if drop:
        t = load_file(str(quant / "model.safetensors"))
        save_file({k: v for k, v in t.items() if not k.endswith(drop)}, str(quant / "model.safetensors"))
    with pytest.raises(ValueError, match=message):
        LLM(str(quant), phase=1)


def test_awq_unpacking_order():
    """One int32 by hand: AWQ's nibble k holds column [0, 2, 4, 6, 1, 3, 5, 7][k]."""
    from tinyvllm.quantized_checkpoint import _nibbles

    codes = torch.arange(8).reshape(1, 8)                      # column c holds code c
    packed = pack_awq(codes)
    assert _nibbles(packed, -1).tolist() == [[[0, 2, 4, 6, 1, 3, 5, 7]]]
