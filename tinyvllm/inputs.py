"""Turning what a user passes to `generate` into validated token ids, before anything runs.

A bad prompt raises here, naming the problem, and never reaches the engine, so one bad request
cannot disturb the others.
"""

from __future__ import annotations

from typing import Any

from tinyvllm.tokenizer import Tokenizer

PromptType = str | dict[str, Any]


def parse_prompt(prompt: PromptType, tokenizer: Tokenizer, vocab_size: int,
                 max_model_len: int) -> tuple[str | None, list[int]]:
    """A prompt (text, {"prompt": text} or {"prompt_token_ids": [...]}) -> (text, token ids)."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, (list, tuple)) or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise TypeError("prompt_token_ids must be a list of ints")
            text, ids = prompt.get("prompt"), list(ids)
        elif "prompt" in prompt:
            text = prompt["prompt"]
            if not isinstance(text, str):
                raise TypeError(f"prompt must be a string, got {type(text).__name__}")
            ids = tokenizer.encode(text)
        else:
            raise ValueError("prompt: a dict prompt needs 'prompt' or 'prompt_token_ids'")
    elif isinstance(prompt, str):
        text, ids = prompt, tokenizer.encode(prompt)
    else:
        raise TypeError(f"prompt must be a str or a dict with 'prompt_token_ids', got {type(prompt).__name__}")
    if not ids:
        raise ValueError("prompt: the prompt is empty (it has no tokens)")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt_token_ids: token id {bad[0]} is outside the vocabulary "
                         f"[0, {vocab_size})")
    if len(ids) >= max_model_len:
        raise ValueError(f"prompt: the prompt has {len(ids)} tokens, but max_model_len is "
                         f"{max_model_len}: it must be shorter, to leave room for one new token")
    return text, ids
