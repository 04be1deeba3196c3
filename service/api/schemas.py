"""Request bodies of the OpenAI-compatible endpoints.

Unknown fields are rejected (400 naming the field) and fields the engine does
not honour are accepted only at their neutral value, so nothing a client asks
for is silently ignored. ``user`` is accepted and only logged.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from speculative.sampling import MIN_TEMPERATURE, REPETITION_PENALTY_RANGE, SEED_RANGE

MAX_STOP_SEQUENCES = 4


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        """The message content as one string."""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class SamplingFields(BaseModel):
    """Fields shared by both endpoints."""

    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, description=f"0 (greedy) or in [{MIN_TEMPERATURE}, 2]")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, description="extension: 0 or -1 disables")
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    n: int = Field(default=1, ge=1)
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
    user: str | None = None

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
        return stops

    @model_validator(mode="after")
    def _supported(self) -> SamplingFields:
        if self.n != 1:
            raise ValueError("n > 1 is not supported; send one request per completion")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None

    @model_validator(mode="after")
    def _no_logprobs(self) -> ChatCompletionRequest:
        if self.logprobs or self.top_logprobs:
            raise ValueError("logprobs are not supported")
        return self


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``: a text prompt or one list of token ids."""

    prompt: str | list[int] | list[str]
    max_tokens: int | None = Field(default=16, ge=1)
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _single_prompt(self) -> CompletionRequest:
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str):
            if len(self.prompt) != 1:
                raise ValueError("batched prompts are not supported; send one request per prompt")
            self.prompt = self.prompt[0]
        if not self.prompt:
            raise ValueError("prompt must not be empty")
        if self.echo or self.logprobs is not None or self.suffix is not None:
            raise ValueError("echo, logprobs and suffix are not supported")
        return self


class PolicyBody(BaseModel):
    """``POST /admin/policy``: block size per batch-size range (b = 1: plain decoding)."""

    model_config = ConfigDict(extra="forbid")
    min_batch: list[int] = Field(min_length=1)
    block_sizes: list[int] = Field(min_length=1)
    alternates: list[int] = Field(default=[], description="per range, a block taking turns step by step (optional)")
