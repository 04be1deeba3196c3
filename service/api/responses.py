"""Response bodies of the OpenAI-compatible endpoints, for the OpenAPI
document (handlers build plain dicts; tests check the two agree), and the
error responses each endpoint can send."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every error the service sends: ``{"error": {message, type, param, code}}``."""

    error: ErrorDetail


class Model(BaseModel):
    id: str
    object: str = "model"
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: str = "list"
    data: list[Model]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class Speculative(BaseModel):
    """Per-request speculative decoding figures (extension)."""

    acceptance_length: float
    verify_rounds: int
    draft_tokens: int
    accepted_tokens: int


class AssistantMessage(BaseModel):
    role: str = "assistant"
    content: str


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    """One entry per generated token: the target's log-probability (raw, before sampling settings)."""

    content: list[TokenLogprob]


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: str
    logprobs: ChatLogprobs | None = None


class ChatCompletion(BaseModel):
    """A whole chat completion; with ``stream`` the body is server-sent
    ``chat.completion.chunk`` events instead, ending with ``data: [DONE]``."""

    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    speculative: Speculative


class CompletionLogprobs(BaseModel):
    """Per generated token: its text, log-probability, top tokens and offset into the choice's text."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str
    logprobs: CompletionLogprobs | None = None


class Completion(BaseModel):
    """A whole completion; with ``stream`` the body is server-sent
    ``text_completion`` events instead, ending with ``data: [DONE]``."""

    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    speculative: Speculative


class Policy(BaseModel):
    """The block size per batch-size range (b = 1: plain decoding)."""

    min_batch: list[int]
    block_sizes: list[int]
    alternates: list[int] | None = None


ERRORS = {
    400: "invalid request (the field is named in `param`)",
    401: "missing or wrong API key",
    403: "the admin API is disabled",
    404: "unknown model",
    409: "the in-process controller sets the policy",
    429: "the waiting queue is full (Retry-After)",
    500: "the generation failed",
    503: "the server is draining (Retry-After)",
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` entries for these error statuses."""
    return {status: {"model": ErrorResponse, "description": ERRORS[status]} for status in statuses}


def install_openapi(app: FastAPI) -> None:
    """Serve an OpenAPI document without FastAPI's 422 validation responses:
    invalid requests get 400 with the OpenAI error body, documented per route."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            spec = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for operations in spec["paths"].values():
                for operation in operations.values():
                    operation.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                spec.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = spec
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to customise the schema
