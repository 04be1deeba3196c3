"""The reply to an inference request: the choices' engine streams metered,
merged as they come, and turned into one OpenAI body (``complete``) or
server-sent events (``sse``); leaving early closes every stream, which aborts
the requests in the engine."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from service.api.errors import APIError, error_response
from service.api.logprobs import chat_logprobs, completion_logprobs
from service.engine import Delta, SpecStats
from service.metrics import Metrics
from speculative.logprobs import TokenLogprob

ENDED_BY_SERVER = {
    "error": APIError(500, "generation failed", type="server_error"),
    # A listening client's request is aborted only when the drain timeout ran out.
    "abort": APIError(
        503,
        "the server shut down before the completion finished",
        type="service_unavailable",
        code="draining",
        headers={"Retry-After": "5"},
    ),
}
"""Engine finish reasons that end a request with an error (response or final event)."""


@dataclass(frozen=True)
class Echo:
    """A completion choice's echoed prompt (``echo``): its text, put before the
    choice's, and its first token, the one its log-probabilities leave unscored."""

    text: str
    first_token: int

    def lead(self, first: Delta, text: str, scores: list[TokenLogprob]) -> tuple[str, list[TokenLogprob]]:
        """The choice's ``text`` and ``scores`` from its ``first`` delta on, the prompt's before them."""
        return self.text + text, [*first.prompt_logprobs, *scores]


async def metered(
    stream: AsyncGenerator[Delta, None], first: Delta, metrics: Metrics, started: float, prompt_tokens: int
) -> AsyncGenerator[Delta, None]:
    """The request's deltas, first included, with TTFT, inter-delta latency,
    token and request metrics recorded; closing it aborts the request."""
    last = time.perf_counter()
    metrics.ttft.observe(last - started)
    delta = first
    try:
        while True:
            metrics.generation_tokens.inc(len(delta.token_ids))
            # Read before yielding: a consumer that stops at the last delta closes
            # this generator at the yield.
            finish = delta.finish_reason
            yield delta
            if finish is not None:
                break
            delta = await anext(stream)
            now = time.perf_counter()
            metrics.itl.observe(now - last)
            last = now
    finally:
        metrics.observe_request(
            prompt_tokens=prompt_tokens, finish_reason=finish or "abort", e2e=time.perf_counter() - started
        )
        await stream.aclose()


async def _merged(streams: list[AsyncGenerator[Delta, None]]) -> AsyncGenerator[tuple[int, Delta], None]:
    """The choices' deltas as they come, each with its choice index (each
    choice's in order); leaving early closes every stream, aborting them."""
    pending = {asyncio.ensure_future(anext(stream)): i for i, stream in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.__getitem__):
                i = pending.pop(task)
                try:
                    delta = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(streams[i]))] = i
                yield i, delta
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for stream in streams:
            await stream.aclose()


async def complete(
    request: Request, streams: list[AsyncGenerator[Delta, None]], meta: dict[str, Any], namer: Any
) -> dict[str, Any] | JSONResponse:
    """Collect every choice whole; abort them all if the client goes away."""
    deltas: list[list[Delta]] = [[] for _ in streams]
    merged = _merged(streams)

    async def collect() -> None:
        async for i, delta in merged:
            deltas[i].append(delta)

    task = asyncio.create_task(collect())
    while not task.done():
        done, _ = await asyncio.wait({task}, timeout=0.5)
        if not done and await request.is_disconnected():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await merged.aclose()
            # Nobody reads this; 499 (nginx's "client closed request") keeps the access log honest.
            return error_response(APIError(499, "client disconnected", code="client_disconnected"))
    task.result()
    lasts = [choice[-1] for choice in deltas]
    for last in lasts:
        if last.finish_reason in ENDED_BY_SERVER:
            raise ENDED_BY_SERVER[last.finish_reason]
    choices = []
    chat, echo = meta["kind"] == "chat.completion", meta.get("echo")
    for i, choice in enumerate(deltas):
        text = "".join(d.text for d in choice)
        scores = [s for d in choice for s in d.logprobs]
        body: dict[str, object] = {"index": i, "finish_reason": choice[-1].finish_reason, "logprobs": None}
        if chat:
            body["message"] = {"role": "assistant", "content": text}
            if namer is not None:
                body["logprobs"] = chat_logprobs(scores, namer)
        else:
            first = None
            if echo is not None:
                (text, scores), first = echo[i].lead(choice[0], text, scores), echo[i].first_token
            body["text"] = text
            if namer is not None:
                body["logprobs"] = completion_logprobs(scores, namer, 0, first)
        choices.append(body)
    return {
        "id": meta["id"],
        "object": meta["kind"],
        "created": meta["created"],
        "model": meta["model"],
        "choices": choices,
        "usage": _usage(lasts, meta["prompt_tokens"]),
        "speculative": _spec(lasts),
    }


async def sse(
    streams: list[AsyncGenerator[Delta, None]], meta: dict[str, Any], include_usage: bool, namer: Any
) -> AsyncIterator[str]:
    """Server-sent events, the choices' chunks interleaved as they come (each
    names its choice ``index``); leaving early (client gone) closes every
    stream, which aborts the requests in the engine."""
    chat = meta["kind"] == "chat.completion"
    kind = "chat.completion.chunk" if chat else "text_completion"
    head = {"id": meta["id"], "object": kind, "created": meta["created"], "model": meta["model"]}

    offsets = [0] * len(streams)  # each completion choice's text so far, for ``text_offset``
    echo = meta.get("echo")
    echoing = [echo is not None] * len(streams)  # a completion choice's first chunk leads with its prompt

    def chunk(index: int, delta: Delta, role: bool) -> str:
        text, finish, scores = delta.text, delta.finish_reason, list(delta.logprobs)
        logprobs: dict[str, Any] | None = None
        if chat:
            body = {"role": "assistant", "content": text} if role else ({"content": text} if text else {})
            if namer is not None:
                logprobs = chat_logprobs(scores, namer)
            choice = {"index": index, "delta": body, "finish_reason": finish, "logprobs": logprobs}
        else:
            first = None
            if echo is not None and echoing[index]:
                (text, scores), first = echo[index].lead(delta, text, scores), echo[index].first_token
                echoing[index] = False
            if namer is not None:
                logprobs = completion_logprobs(scores, namer, offsets[index], first)
                offsets[index] += sum(map(len, logprobs["tokens"]))
            choice = {"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}
        return _event({**head, "choices": [choice]})

    merged = _merged(streams)
    try:
        role = [chat] * len(streams)
        lasts: list[Delta] = []
        async for i, delta in merged:
            if delta.finish_reason in ENDED_BY_SERVER:
                yield _event(ENDED_BY_SERVER[delta.finish_reason].body())
                break
            if delta.text or role[i] or echoing[i] or delta.finish_reason or delta.logprobs:
                yield chunk(i, delta, role[i])
                role[i] = False
            if delta.finish_reason is not None:
                lasts.append(delta)
        else:
            if include_usage:
                yield _event(
                    {**head, "choices": [], "usage": _usage(lasts, meta["prompt_tokens"]), "speculative": _spec(lasts)}
                )
        yield "data: [DONE]\n\n"
    finally:
        await merged.aclose()


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def _usage(lasts: list[Delta], prompt_tokens: int) -> dict[str, int]:
    """Token counts: each prompt once, every choice's completion (from its last delta)."""
    completion = sum(last.completion_tokens for last in lasts)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


def _spec(lasts: list[Delta]) -> dict[str, float]:
    """Per-request speculative decoding figures over the choices (vLLM/SGLang-style extension)."""
    stats = SpecStats(
        rounds=sum(last.spec.rounds for last in lasts),
        drafted=sum(last.spec.drafted for last in lasts),
        accepted=sum(last.spec.accepted for last in lasts),
    )
    return {
        "acceptance_length": round(stats.acceptance_length, 4),
        "verify_rounds": stats.rounds,
        "draft_tokens": stats.drafted,
        "accepted_tokens": stats.accepted,
    }
