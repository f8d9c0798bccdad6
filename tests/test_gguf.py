"""Any GGUF file of a registered family: `LLM(model="x.gguf")`. Each type's weights equal the gguf
package's `dequantize` (through transformers' own GGUF loader) bit for bit, its greedy tokens
equal transformers' on the same file, and a bad file is refused by name with nothing left behind."""

import struct

import numpy as np
import pytest
import torch

from tinyvllm.gguf_checkpoint import TYPES, GGUFFile
from tinyvllm.testing import make_tiny_family, make_tiny_llama, write_gguf

# K-quants' rows are super-blocks of 256 values: every matrix's input size a multiple of 256
SHAPE = dict(hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2)
PROMPTS = [[5, 77, 140, 9, 33], [200, 3, 18]]


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory):
    """A tiny Llama written as a GGUF file of every type, and the cache they convert into."""
    folder = tmp_path_factory.mktemp("gguf")
    src = make_tiny_llama(folder / "src", **SHAPE)
    for t in TYPES:
        write_gguf(src, folder / f"tiny-{t}.gguf", t)
    return folder


@pytest.fixture(autouse=True)
def own_cache(gguf_dir, monkeypatch):
    monkeypatch.setenv("TINYVLLM_CACHE", str(gguf_dir / "cache"))


def _transformers(folder, name):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=name).eval()


def _greedy(model, prompts, n=8):
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                               pad_token_id=0)[0, len(p):].tolist() for p in prompts]


@pytest.mark.parametrize("tensor_type", TYPES)
def test_each_type_decodes_to_the_reference_weights_and_tokens(gguf_dir, tensor_type):
    """tinyvllm's float32 weights of the file equal transformers' GGUF loader's (which decodes with
    gguf.quants.dequantize) bit for bit, and tinyvllm's greedy tokens (phase 5, where Q4_1/Q8_0
    layers are read from their codes) equal transformers' on the same file."""
    from safetensors.torch import load_file

    from tinyvllm import LLM, SamplingParams
    from tinyvllm.download import resolve_model

    name = f"tiny-{tensor_type}.gguf"
    ref = _transformers(gguf_dir, name)
    ours = load_file(str(resolve_model(gguf_dir / name) / "model.safetensors"))
    theirs = ref.state_dict()
    for key, w in ours.items():
        assert torch.equal(w, theirs[key].float()), f"{tensor_type}: {key} differs from transformers' GGUF loader"
    llm = LLM(str(gguf_dir / name), phase=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == _greedy(ref, PROMPTS)


def test_the_weights_are_gguf_s_dequantize_of_each_block(gguf_dir):
    """Without transformers: each tensor is `gguf.quants.dequantize` of its bytes (the q/k rows
    put back in Hugging Face's order), for a K-quant and a legacy type."""
    from gguf.quants import dequantize
    from safetensors.torch import load_file

    from tinyvllm.download import resolve_model
    from tinyvllm.gguf_checkpoint import hf_tensor_name, unpermute_qk

    for t in ("Q5_K", "Q4_0"):
        path = gguf_dir / f"tiny-{t}.gguf"
        ours = load_file(str(resolve_model(path) / "model.safetensors"))
        for tensor in GGUFFile(path).tensors:
            want = dequantize(tensor.data, tensor.tensor_type).reshape([int(d) for d in reversed(tensor.shape)])
            if ".attn_q." in tensor.name or ".attn_k." in tensor.name:
                want = unpermute_qk(want, 4 if ".attn_q." in tensor.name else 2)
            assert np.array_equal(ours[hf_tensor_name(tensor.name)].numpy(), want), tensor.name


def test_layers_on_4_and_8_bit_codes_are_read_from_them(gguf_dir):
    """Phase 5 keeps a Q4_0, Q4_1, Q8_0, Q5_0, Q4_K or Q6_K file's projections as their codes
    (`LosslessLinear`: Q5_0's 5-bit signed codes on 8 bits; Q4_K where each group of 32 has its
    minimum on code 0, as these do; Q6_K's on 8 bits with a scale per 16 columns, "6"), where this
    CPU's kind reads codes at all; Q5_1's and Q5_K's stay float32."""
    from phases.p05_quantization.lossless import LOSSLESS, LosslessLinear
    from tinyvllm import LLM, platform

    if not (LOSSLESS.available() and platform.current().rule("codes_max_rows")):
        pytest.skip("this CPU's kind keeps float32 layers (no codes_max_rows, or no AVX2 compiler)")
    for t, bits in (("Q4_0", 4), ("Q4_1", 4), ("Q8_0", 8), ("Q5_0", 8), ("Q4_K", 4), ("Q6_K", 6),
                    ("Q5_1", None), ("Q5_K", None)):
        model = LLM(str(gguf_dir / f"tiny-{t}.gguf"), phase=5).llm_engine.model
        layers = [m for m in model.modules() if isinstance(m, LosslessLinear)]
        assert len(layers) == (2 * 7 + 1 if bits else 0) and {m.bits for m in layers} <= {bits}, t


@pytest.mark.parametrize("family", ["Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_qwen_families_from_gguf(tmp_path, family):
    """Qwen2 (q/k/v biases) and Qwen3 (q/k norms), which llama.cpp does not permute: the newest
    phase's greedy tokens equal transformers' on the same Q8_0 file, and the file's chat template
    is the engine's."""
    from tinyvllm import LLM, SamplingParams

    # transformers' GGUF loader leaves a Qwen3's head_dim at its config's default, 128
    src = make_tiny_family(tmp_path / "src", family, hidden_size=256, intermediate_size=512, num_heads=2,
                           num_kv_heads=1, head_dim=128)
    path = write_gguf(src, tmp_path / "q.gguf", "Q8_0")
    ref = _transformers(tmp_path, "q.gguf")
    llm = LLM(str(path))
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == _greedy(ref, PROMPTS)
    assert "<|im_start|>" in llm.get_tokenizer().chat_template


def test_the_file_s_tokenizer_and_chat_template(gguf_dir):
    """The tokenizer rebuilt from the file encodes as the folder's own tokenizer.json does, and
    the chat template comes from the file's metadata."""
    from tinyvllm.download import resolve_model
    from tinyvllm.tokenizer import Tokenizer

    ours, src = Tokenizer(resolve_model(gguf_dir / "tiny-F32.gguf")), Tokenizer(gguf_dir / "src")
    for text in ("the tea is hot", "<|im_start|>user\nhi<|im_end|>", "Ünïcödé 123"):
        assert ours.encode(text) == src.encode(text)
    assert ours.chat_template == src.chat_template and ours.eos_token_id == src.eos_token_id


def _cache_entries(gguf_dir):
    folder = gguf_dir / "cache" / "gguf"
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


def _bad_copy(gguf_dir, tmp_path, edit):
    data = bytearray((gguf_dir / "tiny-Q4_1.gguf").read_bytes())
    path = tmp_path / "bad.gguf"
    path.write_bytes(bytes(edit(data)))
    return path


def _tensor_info_offset(data: bytearray, name: str) -> int:
    """Where tensor `name`'s info (after its name: n_dims, dims, type, offset) starts."""
    key = struct.pack("<Q", len(name)) + name.encode()
    return data.index(key) + len(key)


@pytest.mark.parametrize("case", ["truncated", "header", "unknown type", "architecture", "shape"])
def test_a_bad_file_is_refused_by_name_and_nothing_is_left(gguf_dir, tmp_path, case):
    from tinyvllm import LLM

    def edit(data):
        if case == "truncated":
            return data[:-1000]
        if case == "header":
            return data[:3000]
        if case == "architecture":
            return data.replace(b"\x05\x00\x00\x00\x00\x00\x00\x00llama", b"\x05\x00\x00\x00\x00\x00\x00\x00gemma")
        at = _tensor_info_offset(data, "blk.1.ffn_up.weight")
        n_dims = struct.unpack_from("<I", data, at)[0]
        if case == "unknown type":
            struct.pack_into("<I", data, at + 4 + 8 * n_dims, 99)
        else:   # 512 x 256 written as 256 x 512: the same bytes, a shape the metadata does not give
            struct.pack_into("<QQ", data, at + 4, 512, 256)
        return data

    want = {"truncated": r"bad.gguf is truncated: tensor '.*' needs bytes",
            "header": r"bad.gguf is truncated or corrupt inside its header",
            "unknown type": r"bad.gguf: tensor 'blk.1.ffn_up.weight' has type 99",
            "architecture": r"bad.gguf holds a 'gemma' model; GGUF architectures read: llama",
            "shape": r"bad.gguf: tensor 'blk.1.ffn_up.weight' has shape \(256, 512\), but the file's metadata "
                     r"describes a model whose model.layers.1.mlp.up_proj.weight is \(512, 256\)"}[case]
    before = _cache_entries(gguf_dir)
    with pytest.raises(ValueError, match=want):
        LLM(str(_bad_copy(gguf_dir, tmp_path, edit)), phase=1)
    assert _cache_entries(gguf_dir) == before   # no folder, no temporary one


def test_a_type_not_read_is_refused_by_name(gguf_dir, tmp_path):
    from tinyvllm.gguf_checkpoint import check_tensors, gguf_config

    src = make_tiny_llama(tmp_path / "src", **SHAPE)
    reader = GGUFFile(write_gguf(src, tmp_path / "q2.gguf", "Q2_K"))
    with pytest.raises(ValueError, match=r"q2.gguf: tensor '.*' is stored as Q2_K; the types read are F32"):
        check_tensors(reader, gguf_config(reader))


def test_tokenizer_argument_replaces_the_file_s_vocabulary(gguf_dir, tmp_path):
    """`tokenizer=` (vLLM's argument) gives a GGUF file whose vocabulary is not rebuilt here its
    tokenizer: the file's pre-tokenizer unknown, refused by name without it, read with it."""
    from tinyvllm import LLM

    data = (gguf_dir / "tiny-Q8_0.gguf").read_bytes()
    name = b"tokenizer.ggml.pre"
    at = data.index(name) + len(name) + 4            # after the key: its type (string), then the value
    n = struct.unpack_from("<Q", data, at)[0]
    path = tmp_path / "other-pre.gguf"
    path.write_bytes(data[:at] + struct.pack("<Q", 7) + b"mystery" + data[at + 8 + n:])
    with pytest.raises(ValueError, match=r"other-pre.gguf: the GGUF pre-tokenizer 'mystery' is not rebuilt "
                                         r"here .* pass tokenizer="):
        LLM(str(path), phase=1)
    llm = LLM(str(path), phase=1, tokenizer=str(gguf_dir / "src"))
    assert llm.get_tokenizer().encode("the tea") == LLM(str(gguf_dir / "tiny-Q8_0.gguf"), phase=1).get_tokenizer().encode("the tea")
    with pytest.raises(ValueError, match="tokenizer: no tokenizer.json in"):
        LLM(str(path), phase=1, tokenizer=str(tmp_path))


def test_the_command_line_takes_a_gguf_file(gguf_dir, capsys):
    from tinyvllm.entrypoints.cli import main

    assert main(["generate", "--model", str(gguf_dir / "tiny-Q4_K.gguf"), "--phase", "3", "--max-tokens", "4",
                 "--temperature", "0", "--prompt", "the tea"]) in (0, None)
    captured = capsys.readouterr()
    assert captured.out.strip() and "tiny-Q4_K.gguf: tensors" in captured.err


@pytest.mark.parametrize("pre,pieces", [
    ("llama-bpe", ["123", "45", "Ġapples", "'re", "Ġhere"]),     # Llama 3: numbers in threes
    ("qwen2", ["1", "2", "3", "4", "5", "Ġapples", "'re", "Ġhere"]),  # Qwen2: one digit at a time
    ("default", ["12345", "Ġapples", "'re", "Ġhere"]),           # GPT-2's own split
])
def test_the_pre_tokenizer_of_each_named_vocabulary(gguf_dir, pre, pieces):
    """`tokenizer.ggml.pre` chooses the split before byte-level BPE, as the family's own
    tokenizer.json makes it."""
    from tokenizers import Tokenizer

    from tinyvllm.gguf_checkpoint import _tokenizer_files

    reader = GGUFFile(gguf_dir / "tiny-F32.gguf")
    reader.fields["tokenizer.ggml.pre"] = pre
    tok = Tokenizer.from_str(_tokenizer_files(reader)["tokenizer.json"])
    assert [p for p, _ in tok.pre_tokenizer.pre_tokenize_str("12345 apples're here")] == pieces
