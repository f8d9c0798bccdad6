"""The incremental detokenizer streams text that never holds half a UTF-8 character, and adds up
to the full decode."""

from tinyvllm.tokenizer import IncrementalDetokenizer, Tokenizer, render_chat


def test_stream_never_breaks_a_character(default_model_dir):
    tok = Tokenizer(default_model_dir)
    text = "Emoji 🎉🚀👩‍👩‍👧, accents é ü, CJK 日本語, code `x = 1`\n  done."
    ids = tok.encode(text)
    assert len(ids) > len(text.split())  # emoji take several byte-level tokens each
    detok = IncrementalDetokenizer(tok, prompt_token_ids=[])
    pieces = [detok.add_token(t) for t in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text == detok.text


def test_render_chat_template():
    tpl = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
    out = render_chat(tpl, [{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert out == "[user]hi[assistant]"
