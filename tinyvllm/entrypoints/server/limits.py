"""The bounds of one request to `tinyvllm serve` (no web imports: the CLI reads the defaults)."""

from __future__ import annotations

from dataclasses import dataclass

# A token of any tokenizer we know spans far fewer characters: a prompt longer than this many
# characters per token of max_model_len cannot fit, and is refused before it is tokenized.
CHARS_PER_TOKEN = 50


@dataclass(frozen=True)
class Limits:
    """What one request may ask of the server (`tinyvllm serve --help` has a flag for each).

    Attributes:
        max_request_bytes: the body's size; beyond it, 413 before it is parsed.
        max_prompt_chars: a prompt's (or a chat's messages') characters; None: max_model_len x
            50. Checked before tokenizing.
        max_n: completions per request (`n`; OpenAI's limit is 128).
        max_prompts: prompts in one /v1/completions request.
        max_stop: stop strings per request, each at most `max_stop_chars` characters.
    """

    max_request_bytes: int = 8 * 2**20
    max_prompt_chars: int | None = None
    max_n: int = 128
    max_prompts: int = 64
    max_stop: int = 16
    max_stop_chars: int = 1024
