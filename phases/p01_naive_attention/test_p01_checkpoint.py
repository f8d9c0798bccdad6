"""Phase 1 checkpoint: naive attention is right, the model's logits equal transformers', and the
engine really recomputes the whole sequence at every step."""

import pytest
import torch
import torch.nn.functional as F

from phases.p01_naive_attention import NaiveAttention, causal_attention
from tinyvllm import SamplingParams


@pytest.mark.parametrize("tq,num_past,h,kvh,d", [(1, 0, 4, 4, 16), (7, 0, 4, 2, 16), (33, 0, 9, 3, 64),
                                                 (5, 11, 8, 1, 32), (1, 40, 6, 2, 8)])
def test_causal_attention_equals_sdpa(tq, num_past, h, kvh, d):
    g = torch.Generator().manual_seed(tq * 100 + num_past)
    q = torch.randn(tq, h, d, generator=g)
    k = torch.randn(num_past + tq, kvh, d, generator=g)
    v = torch.randn(num_past + tq, kvh, d, generator=g)
    ours = causal_attention(q, k, v, num_past=num_past)
    # reference: SDPA with an explicit mask, K/V heads repeated for grouped-query attention
    mask = torch.ones(tq, num_past + tq, dtype=torch.bool).tril(diagonal=num_past)
    ref = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(h // kvh, 1).transpose(0, 1),
        v.repeat_interleave(h // kvh, 1).transpose(0, 1), attn_mask=mask).transpose(0, 1)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


def test_backend_is_causal_over_the_whole_sequence():
    q, k, v = torch.randn(6, 4, 8), torch.randn(6, 2, 8), torch.randn(6, 2, 8)
    torch.testing.assert_close(NaiveAttention()(0, q, k, v), causal_attention(q, k, v))
    # changing a later token must not change an earlier token's output
    k2 = k.clone()
    k2[5] += 1
    torch.testing.assert_close(causal_attention(q, k2, v)[:5], causal_attention(q, k, v)[:5])


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
    assert len(engine_out[0].outputs[0].token_ids) == 5
    assert lengths == [10, 11, 12, 13, 14]  # the work per token grows with the length
