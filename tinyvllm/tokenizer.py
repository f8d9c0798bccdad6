"""Tokenizer, chat template and incremental detokenizer.

- `Tokenizer` wraps the `tokenizers` library's fast tokenizer from tokenizer.json and reads the
  chat template and special tokens from tokenizer_config.json (or chat_template.jinja).
- `render_chat` renders a chat template with jinja2, in a sandbox, the way transformers does.
- `IncrementalDetokenizer` turns a stream of token ids into a stream of text pieces, never
  emitting half of a multi-byte UTF-8 character (an emoji can take several byte-level tokens).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as FastTokenizer


class Tokenizer:
    """Text <-> token ids for one model folder."""

    def __init__(self, folder: str | os.PathLike):
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"model: no tokenizer.json in {folder}")
        self._tok = FastTokenizer.from_file(str(path))
        cfg_path = folder / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.chat_template: str | None = cfg.get("chat_template")
        jinja_path = folder / "chat_template.jinja"
        if self.chat_template is None and jinja_path.is_file():
            self.chat_template = jinja_path.read_text()
        self.bos_token = _token_str(cfg.get("bos_token"))
        self.eos_token = _token_str(cfg.get("eos_token"))
        self.add_bos_token = bool(cfg.get("add_bos_token", False))
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.all_special_ids = sorted(
            i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if (add_special_tokens and self.add_bos_token and self.bos_token_id is not None
                and (not ids or ids[0] != self.bos_token_id)):
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def to_json(self) -> str:
        """The tokenizer as `tokenizer.json` text (what a grammar engine builds its own from)."""
        return self._tok.to_str()

    def get_vocab(self) -> dict[str, int]:
        """Every token's string and id, added tokens included (two tokenizers with the same
        vocabulary map text to the same ids)."""
        return self._tok.get_vocab(with_added_tokens=True)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """The prompt text for a conversation, as the model was trained to see it."""
        if self.chat_template is None:
            raise ValueError("messages: this model has no chat template; use generate() with a "
                             "plain prompt instead")
        return render_chat(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                           bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)


# What the engine itself gives a chat template; `chat_template_kwargs` may not replace them.
RESERVED_TEMPLATE_VARIABLES = ("messages", "add_generation_prompt", "bos_token", "eos_token",
                               "raise_exception")


def check_chat_template_kwargs(kwargs: Any) -> dict[str, Any]:
    """`chat_template_kwargs` (vLLM's name), checked: more variables for the template, such as
    Qwen3's `enable_thinking`. None gives {}."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise TypeError(f"chat_template_kwargs must be a dict of names to values, got {kwargs!r:.100}")
    for name in kwargs:
        if name in RESERVED_TEMPLATE_VARIABLES:
            raise ValueError(f"chat_template_kwargs: {name!r} is set by the engine itself "
                             f"(reserved: {', '.join(RESERVED_TEMPLATE_VARIABLES)})")
    return dict(kwargs)


def _token_str(tok: Any) -> str | None:
    # tokenizer_config.json writes special tokens as a string or as {"content": ...}
    return tok.get("content") if isinstance(tok, dict) else tok


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def render_chat(template: str, messages: list[dict[str, Any]], **variables: Any) -> str:
    """Render a Hugging Face chat template (jinja2, trim_blocks and lstrip_blocks on)."""
    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and "role" in m and "content" in m for m in messages):
        raise TypeError("messages must be a list of {'role': ..., 'content': ...} dicts")
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = _raise
    return env.from_string(template).render(messages=messages, **variables)


class IncrementalDetokenizer:
    """Streams text for a growing list of output tokens.

    Decoding one token alone is wrong in two ways: a byte-level token may hold half of a UTF-8
    character (decoded, it shows as U+FFFD), and sentencepiece tokenizers drop a leading space
    when decoding from the start of a list. So, like vLLM, we keep two offsets into the tokens:
    text up to `read_offset` has been emitted; decoding starts a few tokens earlier, at
    `prefix_offset`, so the decoder sees context. New text is emitted only once it no longer
    ends in U+FFFD.
    """

    # Prompt tokens kept as context for the first output token's decode.
    CONTEXT_TOKENS = 5

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int],
                 skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_token_ids[-self.CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def add_token(self, token_id: int) -> str:
        """Add one token; return the text it completes (maybe '')."""
        self.ids.append(token_id)
        return self._emit(final=False)

    def flush(self) -> str:
        """At the end of generation: emit whatever is pending, even an incomplete character."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
        prefix_text = decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = decode(self.ids[self.prefix_offset:])
        if len(new_text) <= len(prefix_text) or (new_text.endswith("\ufffd") and not final):
            return ""
        delta = new_text[len(prefix_text):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta
