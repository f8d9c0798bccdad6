"""`tinyvllm bench accuracy` on a tiny model with a few tokens: the float engine against itself
scores zero KL and full agreement, a quantized or bfloat16 one is reported beside it, and --json
writes it."""

import json
import math

import pytest

from tinyvllm.entrypoints.bench.accuracy import TEXT_PATH, format_accuracy, load_text, run_accuracy


def test_shipped_text_is_long_enough_and_licensed():
    head = TEXT_PATH.read_text().split("=" * 72)[0]
    assert "Python Software Foundation" in head and "pydoc_data/topics.py" in head
    from tinyvllm.download import resolve_model
    from tinyvllm.tokenizer import Tokenizer
    try:
        tok = Tokenizer(resolve_model(None))
    except Exception as e:  # no default model here: count words instead
        pytest.skip(f"default model unavailable: {e}")
    assert len(tok.encode(load_text())) >= 20_000


def test_accuracy_report(tiny_model_dir):
    report = run_accuracy(str(tiny_model_dir), quantizations=(None, "int8"), kv_cache_dtypes=("auto", "int8"),
                          group_size=32, window=24, max_text_tokens=72, kl_tokens=40, num_chat=2,
                          chat_tokens=6, phase=5)
    assert {r["dtype"] for r in report["results"]} == {"float32"}   # "auto" on a CPU
    rows = {(r["quantization"], r["kv_cache_dtype"]): r for r in report["results"]}
    assert set(rows) == {(None, "auto"), (None, "int8"), ("int8", "auto"), ("int8", "int8")}
    base = rows[(None, "auto")]
    assert base["mean_kl"] == 0 and base["top1_agreement"] == 1.0
    assert base["num_text_tokens"] == 69 and base["num_answer_tokens"] == 12
    for key, r in rows.items():
        assert math.isfinite(r["perplexity"]) and r["perplexity"] > 1
        if key != (None, "auto"):
            assert r["mean_kl"] > 0  # a quantized engine's distributions differ, a little
            assert r["perplexity_change"] == pytest.approx(r["perplexity"] / base["perplexity"] - 1)


def test_accuracy_cli_json(tiny_model_dir, tmp_path):
    from tinyvllm.entrypoints.cli import main
    out = tmp_path / "acc.json"
    rc = main(["bench", "accuracy", "--model", str(tiny_model_dir), "--quantization-list", "int4",
               "--kv-cache-dtypes", "fp8", "--dtypes", "float32", "--window", "16",
               "--max-text-tokens", "32", "--kl-tokens", "8", "--num-chat", "1", "--chat-tokens", "4",
               "--json", str(out)])
    assert rc in (0, None)
    report = json.loads(out.read_text())
    assert [(r["dtype"], r["quantization"], r["kv_cache_dtype"]) for r in report["results"]] == [
        ("float32", None, "auto"), ("float32", "int4", "fp8")]
    # no group size asked: the engine's default (the tiny model's inputs 64 and 128 take 32), recorded
    assert report["group_size"] == report["results"][1]["group_size"] == 32


def test_accuracy_report_puts_bfloat16_beside_float32(tiny_model_dir):
    report = run_accuracy(str(tiny_model_dir), quantizations=(None, "int8"), kv_cache_dtypes=("auto",),
                          group_size=32, window=24, max_text_tokens=48, kl_tokens=24, num_chat=1,
                          chat_tokens=4, phase=5, dtypes=("float32", "bfloat16"))
    rows = {(r["dtype"], r["quantization"]): r for r in report["results"]}
    assert list(rows) == [("float32", None), ("float32", "int8"), ("bfloat16", None), ("bfloat16", "int8")]
    base = rows[("float32", None)]
    for key in (("bfloat16", None), ("bfloat16", "int8")):   # measured against float32, not itself
        r = rows[key]
        assert r["mean_kl"] > 0 and math.isfinite(r["perplexity"])
        assert r["perplexity_change"] == pytest.approx(r["perplexity"] / base["perplexity"] - 1)
    assert "bfloat16" in format_accuracy(report)


def test_accuracy_names_bfloat16_products_beside_float32(tiny_model_dir, monkeypatch, platform_rules):
    """dtype="auto" with bfloat16 products (forced here for this CPU's kind) is its own row,
    "float32+bf16 products", measured against float32's."""
    from tinyvllm import platform

    if not platform.current().onednn:
        pytest.skip("bfloat16 products run in oneDNN, which this kind does not use")
    platform_rules(bf16_products_from_rows=13)
    monkeypatch.delenv("TINYVLLM_BF16_PRODUCTS")
    report = run_accuracy(str(tiny_model_dir), quantizations=(None,), kv_cache_dtypes=("auto",), window=24,
                          max_text_tokens=48, kl_tokens=24, num_chat=1, chat_tokens=4, phase=7,
                          dtypes=("float32", "auto"))
    assert [r["dtype"] for r in report["results"]] == ["float32", "float32+bf16 products"]
    assert report["results"][1]["mean_kl"] > 0 and "float32+bf16 products" in format_accuracy(report)


@pytest.mark.slow
def test_bfloat16_products_keep_the_default_model_s_tokens(default_model_dir, monkeypatch):
    """Where dtype="auto" multiplies many rows in bfloat16 (the platform's `bf16_product_rows`),
    the default model's perplexity on the shipped text moves by under 1% and its greedy answers'
    tokens stay float32's top-1 choice at least 95% of the time (the whole text: +0.01%, 100%; lab
    note 7)."""
    from tinyvllm import platform

    monkeypatch.delenv("TINYVLLM_BF16_PRODUCTS")
    if not platform.current().bf16_product_rows("auto", "cpu"):
        pytest.skip("dtype='auto' keeps float32 products on this CPU's kind (bf16_products_from_rows)")
    report = run_accuracy(str(default_model_dir), quantizations=(None,), kv_cache_dtypes=("auto",), window=256,
                          max_text_tokens=512, kl_tokens=256, num_chat=2, chat_tokens=24, phase=7,
                          dtypes=("float32", "auto"))
    ref, mixed = report["results"]
    assert mixed["dtype"] == "float32+bf16 products"
    assert abs(mixed["perplexity_change"]) < 0.01 and mixed["top1_agreement"] >= 0.95 and mixed["mean_kl"] < 0.01
