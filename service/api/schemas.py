"""Request bodies of the OpenAI-compatible endpoints.

Unknown fields are rejected (400 naming the field) and fields the engine does
not honour are accepted only at their neutral value, so nothing a client asks
for is silently ignored. ``user`` is accepted and only logged. Types are
strict (``"stream": "yes"`` or ``"max_tokens": true`` are 400, not coerced),
and text must be valid Unicode (a lone surrogate is 400, not a tokenizer crash).
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar, cast

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from speculative.grammar import Grammar
from speculative.sampling import (
    LOGIT_BIAS_LIMIT,
    MAX_TOP_LOGPROBS,
    MIN_TEMPERATURE,
    REPETITION_PENALTY_RANGE,
    SEED_RANGE,
)

MAX_STOP_SEQUENCES = 4
MAX_CHOICES = 128  # OpenAI's limit on n
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit for /v1/completions
MAX_LOGIT_BIAS_TOKENS = 1024  # tokens one request may bias (a banned word list fits)

_Value = TypeVar("_Value")


def encodable(value: _Value) -> _Value:
    """Refuse text the tokenizer cannot encode (a lone surrogate sent as a JSON
    escape) in a string or a list of strings; other values pass."""
    for text in [value] if isinstance(value, str) else value if isinstance(value, list) else []:
        if isinstance(text, str):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise ValueError(f"text is not valid Unicode: {exc.reason} at index {exc.start}") from exc
    return value


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str

    _text = field_validator("text")(encodable)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    _text = field_validator("content", "name")(encodable)

    @model_validator(mode="after")
    def _content(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"content is required for {self.role} messages (only assistant messages may be null)")
        return self

    def text(self) -> str:
        """The message content as one string (a null assistant content is empty)."""
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``: a named JSON schema (``strict`` is
    accepted; output always follows the schema)."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    json_schema: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: plain text, any JSON object, or JSON that
    follows a schema."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type json_schema, and only there")
        return self

    def grammar(self) -> Grammar | None:
        """The grammar the output must match (None for plain text)."""
        if self.type == "json_object":
            return Grammar.json_schema({"type": "object"})
        if self.json_schema is not None:
            return Grammar.json_schema(self.json_schema.json_schema)
        return None


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs`` extension: exactly one of a JSON schema
    (``json``), a regular expression (``regex``) or a list of strings the
    output must be one of (``choice``)."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    json_schema: dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = Field(default=None, min_length=1)
    choice: list[str] | None = Field(default=None, min_length=1)

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        if sum(field is not None for field in (self.json_schema, self.regex, self.choice)) != 1:
            raise ValueError("structured_outputs takes exactly one of json, regex and choice")
        if self.choice is not None and not all(self.choice):
            raise ValueError("structured_outputs choices must not be empty")
        return self

    def grammar(self) -> Grammar:
        if self.json_schema is not None:
            return Grammar.json_schema(self.json_schema)
        if self.regex is not None:
            return Grammar("regex", self.regex)
        return Grammar.choice(self.choice or [])


class SamplingFields(BaseModel):
    """Fields shared by both endpoints."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, description=f"0 (greedy) or in [{MIN_TEMPERATURE}, 2]")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, description="extension: 0 or -1 disables")
    min_p: float = Field(
        default=0.0, ge=0.0, le=1.0, description="extension (vLLM, SGLang): drop tokens below min_p x the top one's p"
    )
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    n: int = Field(default=1, ge=1, le=MAX_CHOICES, description="choices, each its own request in the engine")
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(
        default=1.0,
        ge=REPETITION_PENALTY_RANGE[0],
        le=REPETITION_PENALTY_RANGE[1],
        description="extension (vLLM): 1 disables",
    )
    ignore_eos: bool = Field(default=False, description="extension (vLLM, SGLang): run to max_tokens past end of text")
    min_tokens: int = Field(default=0, ge=0, description="extension (vLLM, SGLang): no end of text before this many")
    logit_bias: dict[str, float] | None = Field(
        default=None, description="token id (a string, as JSON keys are) -> bias in [-100, 100] added to its logit"
    )
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = Field(
        default=None, description="extension (vLLM): a JSON schema, a regex or choices the output must match"
    )
    user: str | None = None

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value is None:
            return None
        if len(value) > MAX_LOGIT_BIAS_TOKENS:
            raise ValueError(f"logit_bias may name at most {MAX_LOGIT_BIAS_TOKENS} tokens")
        for key, bias in value.items():
            if not (key.isascii() and key.isdigit()):
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
            if not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias} for token {key}")
        return value

    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` as the engine takes it: (token id, bias) pairs."""
        return tuple((int(key), bias) for key, bias in (self.logit_bias or {}).items())

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, value: float) -> float:
        if 0 < value < MIN_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> list[str] | None:
        if value is None:
            return None
        stops = [value] if isinstance(value, str) else value
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed")
        if not all(stops):
            raise ValueError("stop sequences must not be empty")
        encodable(stops)
        return stops

    def logprob_count(self) -> int | None:
        """How many top tokens each generated token's logprob comes with (None: no logprobs)."""
        return None

    @model_validator(mode="after")
    def _supported(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        formats = (self.response_format and self.response_format.grammar(), self.structured_outputs)
        if all(formats):
            raise ValueError("give either a JSON response_format or structured_outputs, not both")
        if self.min_tokens and self.grammar() is not None:
            raise ValueError("min_tokens cannot be combined with structured output (it would mask the end)")
        return self

    def grammar_field(self) -> str:
        """The field the output's grammar came from (for errors about it)."""
        return "structured_outputs" if self.structured_outputs is not None else "response_format"

    def grammar(self) -> Grammar | None:
        """What the output must match, from ``response_format`` or ``structured_outputs``."""
        if self.structured_outputs is not None:
            return self.structured_outputs.grammar()
        return None if self.response_format is None else self.response_format.grammar()


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``: a text prompt, a list of token ids, or a batch
    of either (each prompt gets its own ``n`` choices). ``echo`` puts the prompt
    before each choice's text, and with ``logprobs`` its tokens' log-probabilities
    before the completion's; ``max_tokens`` 0 (with ``echo`` only) scores the prompt
    alone, as lm-evaluation-harness's loglikelihood tasks ask."""

    prompt: str | list[int] | list[str] | list[list[int]]

    _text = field_validator("prompt")(encodable)
    max_tokens: int | None = Field(default=16, ge=0)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _no_empty_prompt(cls, value: str | list[int] | list[str] | list[list[int]]) -> object:
        if not all(_batch(value)):
            raise ValueError("prompt must not be empty")
        return value

    def prompts(self) -> list[str | list[int]]:
        """The batch: each prompt as text or token ids."""
        return _batch(self.prompt)

    @model_validator(mode="after")
    def _supported_completion(self) -> CompletionRequest:
        if self.suffix is not None:
            raise ValueError("suffix is not supported")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens 0 needs echo: true (the prompt's log-probabilities alone)")
        return self

    def logprob_count(self) -> int | None:
        return self.logprobs


def _batch(prompt: str | list[int] | list[str] | list[list[int]]) -> list[str | list[int]]:
    """A completion request's prompts: one text, one list of token ids, or a list of either."""
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        return [cast(str | list[int], prompt)]
    return list(prompt)


class PolicyBody(BaseModel):
    """``POST /admin/policy``: block size per batch-size range (b = 1: plain decoding)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    min_batch: list[int] = Field(min_length=1)
    block_sizes: list[int] = Field(min_length=1)
    alternates: list[int] = Field(default=[], description="per range, a block taking turns step by step (optional)")
