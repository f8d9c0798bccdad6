"""Phase 1 checkpoint: naive attention is right, the model's logits equal transformers', and the
engine really recomputes the whole sequence at every step."""

import pytest
import torch
import torch.nn.functional as F

from phases.p01_naive_attention import NaiveAttention, causal_attention
from tinyvllm import SamplingParams


def _sdpa(q, k, v, num_past: int) -> torch.Tensor:
    """SDPA with an explicit mask (query i sees keys 0 .. num_past + i), K/V heads repeated for
    grouped-query attention."""
    tq, h, kvh = q.shape[0], q.shape[1], k.shape[1]
    mask = torch.ones(tq, k.shape[0], dtype=torch.bool).tril(diagonal=num_past)
    return F.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(h // kvh, 1).transpose(0, 1),
        v.repeat_interleave(h // kvh, 1).transpose(0, 1), attn_mask=mask).transpose(0, 1)


def _attention(q, k, v, diagonal: int, scale: float) -> torch.Tensor:
    """Attention written out, query i seeing keys 0 .. diagonal + i, scores times `scale` (a row
    that sees no key gives NaN, as softmax over -inf does)."""
    h, kvh = q.shape[1], k.shape[1]
    k, v = k.repeat_interleave(h // kvh, 1), v.repeat_interleave(h // kvh, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    hidden = ~torch.ones(q.shape[0], k.shape[0], dtype=torch.bool).tril(diagonal=diagonal)
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1), v)


def _what_it_equals(q, k, v, num_past: int, ours: torch.Tensor) -> str:
    """The common mistake whose attention `ours` is, if it is one of them ('' otherwise)."""
    d = q.shape[-1]
    mistakes = {"queries at positions 0..Tq-1, as if num_past were 0 (query i sits at num_past + i)": (0, d ** -0.5),
                "each query blind to its own key (it sees keys up to and including its position)":
                    (num_past - 1, d ** -0.5),
                "scores scaled by 1/d (the scale is 1/sqrt(d))": (num_past, 1 / d),
                "scores not scaled (the scale is 1/sqrt(d))": (num_past, 1.0)}
    for why, (diagonal, scale) in mistakes.items():
        if torch.allclose(ours, _attention(q, k, v, diagonal, scale), atol=1e-5, rtol=1e-5, equal_nan=True):
            return f"; it is what {why} gives"
    return ""


CASES = [(1, 0, 4, 4, 16), (7, 0, 4, 2, 16), (33, 0, 9, 3, 64), (5, 11, 8, 1, 32), (1, 40, 6, 2, 8)]


@pytest.mark.parametrize("tq,num_past,h,kvh,d", CASES,
                         ids=[f"tq={tq}-num_past={p}-h={h}-kvh={kvh}-d={d}" for tq, p, h, kvh, d in CASES])
def test_causal_attention_equals_sdpa(tq, num_past, h, kvh, d):
    g = torch.Generator().manual_seed(tq * 100 + num_past)
    q = torch.randn(tq, h, d, generator=g)
    k = torch.randn(num_past + tq, kvh, d, generator=g)
    v = torch.randn(num_past + tq, kvh, d, generator=g)
    ours = causal_attention(q, k, v, num_past=num_past)
    assert ours.shape == q.shape, f"the output has the queries' shape (Tq, H, d) = {tuple(q.shape)}, got {tuple(ours.shape)}"
    ref = _sdpa(q, k, v, num_past)   # the reference: SDPA with an explicit mask
    err = (ours - ref).abs().nan_to_num(float("inf")).max().item()
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5, msg=lambda _: (
        f"{tq} queries after {num_past} past keys, {h} query heads over {kvh} KV heads, d={d}: largest error "
        f"{err:.3g} against SDPA with query i seeing keys 0..num_past + i{_what_it_equals(q, k, v, num_past, ours)}"))


def test_backend_is_causal_over_the_whole_sequence():
    q, k, v = torch.randn(6, 4, 8), torch.randn(6, 2, 8), torch.randn(6, 2, 8)
    torch.testing.assert_close(NaiveAttention()(0, q, k, v), causal_attention(q, k, v),
                               msg="NaiveAttention attends a whole sequence: causal_attention(q, k, v)")
    # changing a later token must not change an earlier token's output
    k2 = k.clone()
    k2[5] += 1
    torch.testing.assert_close(causal_attention(q, k2, v)[:5], causal_attention(q, k, v)[:5], msg=(
        "changing the last key changed an earlier query's output: a query must not see keys after its position"))


def hf_logits(model, tokenizer, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0]  # (T, vocab)


@pytest.mark.slow
def test_logits_equal_transformers(hf_reference, make_llm, default_model_dir):
    engine = make_llm(default_model_dir, 1).llm_engine
    tok = engine.tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Name three colors."}]),
                     add_special_tokens=False)
    ref = hf_reference(hf_logits, ids)
    with torch.no_grad():
        ours = engine.model.compute_logits(engine.model(torch.tensor(ids), torch.arange(len(ids)), NaiveAttention()))
    # float32 rounding only: the logits span about +-40
    torch.testing.assert_close(ours, ref, atol=5e-4, rtol=1e-4)
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_every_step_recomputes_the_whole_sequence(tiny_model_dir, make_llm):
    engine = make_llm(tiny_model_dir, 1).llm_engine
    lengths = []
    hook = engine.model.register_forward_pre_hook(lambda mod, args: lengths.append(len(args[0])))
    try:
        prompt = {"prompt_token_ids": list(range(3, 13))}  # 10 tokens
        engine_out = make_llm(tiny_model_dir, 1).generate(
            prompt, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    finally:
        hook.remove()
    tokens = engine_out[0].outputs[0].token_ids
    assert len(tokens) == 5, f"max_tokens=5 with ignore_eos: 5 tokens, got {len(tokens)}"
    assert lengths == [10, 11, 12, 13, 14], (   # the work per token grows with the length
        f"each step runs the model over the whole sequence so far (10 prompt tokens, then one more a step): "
        f"the model saw {lengths} tokens")
    # each token is the argmax of the logits at the last position of the model over everything so far
    model, ids = engine.model, prompt["prompt_token_ids"]
    with torch.no_grad():
        for step, token in enumerate(tokens):
            logits = model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), NaiveAttention()))
            want = int(logits[-1].argmax())
            assert token == want, (
                f"step {step}: token {token}, but the logits of the last of the {len(ids)} tokens (positions "
                f"0..{len(ids) - 1}) have their largest value at {want}")
            ids = ids + [token]
