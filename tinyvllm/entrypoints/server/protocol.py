"""Request bodies of the OpenAI API (the fields tinyvllm acts on), as pydantic models.

FastAPI validates a body against these and writes them into /openapi.json. Value ranges are
checked once, by `SamplingParams`, whose errors name the field; these models check types.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from tinyvllm.sampling_params import SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: plain text, any JSON object, or JSON that fits a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class FunctionDefinition(BaseModel):
    """A tool's function: its name, what it does, and its parameters as a JSON schema."""

    model_config = ConfigDict(extra="ignore")

    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(BaseModel):
    """One entry of `tools`: {"type": "function", "function": {...}}."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str = Field(min_length=1)


class NamedToolChoice(BaseModel):
    """`tool_choice` naming the one function the model must call."""

    type: Literal["function"] = "function"
    function: NamedFunction


# OpenAI fields this server does not implement: a request that sets one is refused (400 naming
# it) rather than answered as if it had not asked. Tools are a chat field: /v1/completions
# refuses them.
UNSUPPORTED_FIELDS = ("tools", "functions", "logit_bias")


class _SamplingRequest(BaseModel):
    """The fields both endpoints share: OpenAI's, then vLLM's extras."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    # vLLM's extra sampling fields
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    # structured outputs: OpenAI's response_format, or vLLM's structured_outputs
    # ({"json": schema} | {"regex": ...} | {"choice": [...]} | {"grammar": ...} | {"json_object": true})
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    # refused when set (`unsupported`); tool_choice "none"/"auto" with no tools is harmless there
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    logit_bias: dict[str, float] | None = None

    def structured(self) -> dict | None:
        """What the request constrains its output to, as StructuredOutputsParams' fields."""
        rf = self.response_format
        if rf is None or rf.type == "text":
            return self.structured_outputs
        if self.structured_outputs is not None:
            raise ValueError("response_format: give response_format or structured_outputs, not both")
        if rf.type == "json_object":
            return {"json_object": True}
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise ValueError("response_format: type json_schema needs json_schema.schema")
        return {"json": rf.json_schema.schema_}

    # the fields of UNSUPPORTED_FIELDS this endpoint refuses
    unsupported: ClassVar[tuple[str, ...]] = UNSUPPORTED_FIELDS

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        structured: dict | None = None) -> SamplingParams:
        """The engine's SamplingParams; raises ValueError naming the field on a bad value.
        `structured`: a constraint of the server's own (a forced tool call's), in place of the
        request's response_format / structured_outputs."""
        for name in self.unsupported:
            if getattr(self, name):
                what = {"tools": "tools are a chat field: send them to /v1/chat/completions",
                        "functions": "the legacy functions field: send tools instead",
                        "logit_bias": "tinyvllm has no logit bias"}[name]
                raise ValueError(f"{name}: not supported here ({what}); leave it out")
        if "tools" in self.unsupported and self.tool_choice not in (None, "none", "auto"):
            raise ValueError("tool_choice: not supported here (tools are a chat field: send them "
                             "to /v1/chat/completions)")
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        return SamplingParams(structured_outputs=self.structured() if structured is None else structured,
            n=self.n, temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p, seed=self.seed,
            max_tokens=max_tokens, min_tokens=self.min_tokens, stop=stop or None,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, logprobs=logprobs,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty)


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions: a prompt as text, a list of texts, token ids or lists of them."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions: messages through the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    # vLLM's extra: more variables for the chat template (Qwen3's {"enable_thinking": false})
    chat_template_kwargs: dict[str, Any] | None = None
    # tools the model may call (tool_choice: "none", "auto", "required" or a NamedToolChoice;
    # left out: "auto" with tools, "none" without, as OpenAI and vLLM)
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    unsupported: ClassVar[tuple[str, ...]] = ("functions", "logit_bias")


class TokenizeRequest(BaseModel):
    """POST /tokenize: a prompt or messages -> token ids (vLLM's extra endpoint)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None      # into the chat template, as a chat request's


class DetokenizeRequest(BaseModel):
    """POST /detokenize: token ids -> text."""

    model: str | None = None
    tokens: list[int]


