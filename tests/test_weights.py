"""Weight loading checks every tensor by name and shape; sharded checkpoints load; errors name
the file and the tensor."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tinyvllm.config import ModelConfig
from tinyvllm.weights import load_model


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_sharded_checkpoint_loads_the_same(tiny_model_dir, tmp_path):
    ref = load_model(tiny_model_dir, torch.float32, torch.device("cpu"))
    d = _copy(tiny_model_dir, tmp_path / "sharded")
    tensors = load_file(str(d / "model.safetensors"))
    (d / "model.safetensors").unlink()
    names = sorted(tensors)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        fname = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(d / fname))
        weight_map.update({n: fname for n in part})
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    model = load_model(d, torch.float32, torch.device("cpu"))
    for (n, a), (_, b) in zip(ref.state_dict().items(), model.state_dict().items()):
        assert torch.equal(a, b), n


def test_every_weight_starts_on_a_cache_line(tiny_model_dir, tmp_path):
    """A safetensors file puts its tensors 8 + header + offset bytes in, 8-byte aligned; the
    model's parameters all start at multiples of 64 bytes (`ALIGN`) however the file lies, so a
    kernel's last bits do not depend on the file's header."""
    from tinyvllm.weights import ALIGN

    d = _copy(tiny_model_dir, tmp_path / "shifted")
    tensors, file = load_file(str(d / "model.safetensors")), d / "model.safetensors"
    for pad in range(0, 64, 8):   # a header of another length moves every tensor in the file
        save_file(tensors, str(file), metadata={"pad": "x" * pad})
        data = file.read_bytes()
        start = 8 + int.from_bytes(data[:8], "little")
        header = json.loads(data[8:start])
        if any((start + v["data_offsets"][0]) % ALIGN for k, v in header.items() if k != "__metadata__"):
            break
    else:
        pytest.fail("no header length put a tensor off a cache line")
    model = load_model(d, torch.float32, torch.device("cpu"))
    assert all(p.data_ptr() % ALIGN == 0 for p in model.parameters())


def test_missing_tensor(tiny_model_dir, tmp_path):
    d = _copy(tiny_model_dir, tmp_path / "missing")
    t = load_file(str(d / "model.safetensors"))
    del t["model.layers.1.mlp.up_proj.weight"]
    save_file(t, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
        load_model(d, torch.float32, torch.device("cpu"))


def test_wrong_shape(tiny_model_dir, tmp_path):
    d = _copy(tiny_model_dir, tmp_path / "shape")
    t = load_file(str(d / "model.safetensors"))
    t["model.norm.weight"] = torch.ones(3)
    save_file(t, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model.norm.weight.*\(3,\)"):
        load_model(d, torch.float32, torch.device("cpu"))


def test_missing_shard_named(tiny_model_dir, tmp_path):
    d = _copy(tiny_model_dir, tmp_path / "noshard")
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "gone.safetensors"}}))
    with pytest.raises(FileNotFoundError, match="gone.safetensors"):
        load_model(d, torch.float32, torch.device("cpu"))


def test_rope_parameters_and_llama3_scaling():
    base = dict(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1)
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    old = ModelConfig.from_dict({**base, "rope_theta": 500000.0, "rope_scaling": scaling})
    new = ModelConfig.from_dict({**base, "rope_parameters": {"rope_theta": 500000.0, **scaling}})
    assert old.rope_theta == new.rope_theta == 500000.0
    assert old.rope_scaling["rope_type"] == new.rope_scaling["rope_type"] == "llama3"
    plain = ModelConfig.from_dict({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})
    assert plain.rope_scaling is None and plain.head_dim == 4
    with pytest.raises(ValueError, match="yarn"):
        ModelConfig.from_dict({**base, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})
    with pytest.raises(ValueError, match="model_type"):
        ModelConfig.from_dict({**base, "model_type": "gpt2"})


def _tensor_offsets(path):
    """{name: (begin, end)} of each tensor's bytes in the file, from its header."""
    raw = path.read_bytes()
    header_len = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8: 8 + header_len])
    return {n: (8 + header_len + i["data_offsets"][0], 8 + header_len + i["data_offsets"][1])
            for n, i in header.items() if n != "__metadata__"}, header_len


def test_truncated_in_tensor_data_names_file_and_tensor(tiny_model_dir, tmp_path):
    d = _copy(tiny_model_dir, tmp_path / "cut")
    f = d / "model.safetensors"
    offsets, _ = _tensor_offsets(f)
    name = "model.layers.1.self_attn.k_proj.weight"
    begin, end = offsets[name]
    f.write_bytes(f.read_bytes()[: (begin + end) // 2])  # half of that tensor's bytes remain
    after = [n for n, (b, _) in offsets.items() if b >= end]
    with pytest.raises(ValueError) as e:
        load_model(d, torch.float32, torch.device("cpu"))
    msg = str(e.value)
    assert str(f) in msg and repr(name) in msg
    assert f"has {(end - begin) // 2} of its {end - begin} bytes" in msg
    assert f"{len(after)} more tensor(s)" in msg
    intact = [n for n, (_, stop) in offsets.items() if stop <= begin]
    assert intact and not any(n in msg for n in intact)


def test_truncated_in_header_names_file(tiny_model_dir, tmp_path):
    d = _copy(tiny_model_dir, tmp_path / "cut-header")
    f = d / "model.safetensors"
    _, header_len = _tensor_offsets(f)
    raw = f.read_bytes()
    for keep in (3, 8 + header_len // 2):  # inside the length field, inside the JSON
        f.write_bytes(raw[:keep])
        with pytest.raises(ValueError, match="model.safetensors") as e:
            load_model(d, torch.float32, torch.device("cpu"))
        assert str(f) in str(e.value) and "truncated" in str(e.value)


def test_random_like_keeps_names_shapes_and_files(tiny_model_dir, tmp_path):
    from tinyvllm.testing import make_random_like

    out = make_random_like(tiny_model_dir, tmp_path / "rand")
    want, got = load_file(tiny_model_dir / "model.safetensors"), load_file(out / "model.safetensors")
    assert {k: v.shape for k, v in want.items()} == {k: v.shape for k, v in got.items()}
    assert not torch.equal(want["model.layers.0.self_attn.q_proj.weight"], got["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(got["model.norm.weight"], torch.ones_like(got["model.norm.weight"]))
    assert (out / "tokenizer.json").read_text() == (tiny_model_dir / "tokenizer.json").read_text()
    load_model(out, torch.float32, torch.device("cpu"))  # the engine's loader takes it


@pytest.mark.parametrize("family", ["tiny_model_dir", "tiny_qwen3_dir"])
def test_random_like_from_a_config_alone(family, request, tmp_path):
    """Without the weights (config.json and the tokenizer only, what travels to a GPU machine),
    the same names and shapes as from the whole folder: tied embeddings, biases and q/k norms."""
    from tinyvllm.testing import make_random_like

    src = request.getfixturevalue(family)
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors"):
            shutil.copy(f, bare / f.name)
    whole, alone = make_random_like(src, tmp_path / "whole"), make_random_like(bare, tmp_path / "alone")
    want, got = load_file(whole / "model.safetensors"), load_file(alone / "model.safetensors")
    assert {k: v.shape for k, v in want.items()} == {k: v.shape for k, v in got.items()}
    load_model(alone, torch.float32, torch.device("cpu"))


def test_loading_does_not_import_the_compiler(tiny_model_dir):
    """The model is built on the meta device; arithmetic there (the RoPE tables, the embedding's
    random init) would import torch._dynamo and more, ~2 s of every process's first LLM(), and
    empty_like of a meta tensor (Module.to_empty) imports sympy, 0.4-0.9 s."""
    import subprocess
    import sys

    code = ("import sys; from tinyvllm.weights import load_model; import torch; "
            f"load_model({str(tiny_model_dir)!r}, torch.float32, torch.device('cpu')); "
            "print('torch._dynamo' in sys.modules, 'sympy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False False", out.stdout + out.stderr


def test_bf16_product_rows_only_for_auto_on_one_cpu_rank(monkeypatch):
    """dtype="auto" on a CPU with one rank takes the platform's `bf16_products_from_rows` for its
    kind where oneDNN runs; an explicit dtype, a GPU, several ranks (each rank's partial sum would
    be rounded) or $TINYVLLM_BF16_PRODUCTS=0 none; another value of it is refused by name."""
    from tinyvllm import platform

    p = platform.current().with_rules(bf16_products_from_rows=13)
    monkeypatch.delenv("TINYVLLM_BF16_PRODUCTS")
    assert p.bf16_product_rows("auto", "cpu") == (13 if p.onednn else 0)
    assert p.bf16_product_rows("float32", "cpu") == p.bf16_product_rows("bfloat16", "cpu") == 0
    assert p.bf16_product_rows("auto", "cuda") == p.bf16_product_rows("auto", "cpu", 2) == 0
    monkeypatch.setenv("TINYVLLM_BF16_PRODUCTS", "0")
    assert p.bf16_product_rows("auto", "cpu") == 0
    monkeypatch.setenv("TINYVLLM_BF16_PRODUCTS", "on")
    with pytest.raises(ValueError, match="TINYVLLM_BF16_PRODUCTS"):
        p.bf16_product_rows("auto", "cpu")
