"""The FastAPI app: OpenAI-compatible endpoints over an engine.

``build_app(settings, engine, tokenizer, metrics, controller)``: the engine (and
the in-process controller, when given) start in the lifespan and drain when the
app shuts down; everything lives on ``app.state``; every error goes through
``service.api.errors``. Routes: ``/v1/chat/completions``, ``/v1/completions``,
``/v1/models`` (and ``/v1/models/{id}``), ``/health``, ``/ready``, ``/metrics``,
and ``/admin/policy`` (the block-size policy, admin key; 409 while the
in-process controller owns it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, cast

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from service.api.errors import APIError, error_response, from_engine_error, install_handlers
from service.api.logprobs import chat_logprobs, completion_logprobs
from service.api.responses import ChatCompletion, Completion, Model, ModelList, Policy, error_responses, install_openapi
from service.api.schemas import ChatCompletionRequest, CompletionRequest, PolicyBody, SamplingFields
from service.config import ServeSettings
from service.controller.loop import ControllerLoop
from service.engine import BlockPolicy, Delta, Engine, EngineError, GenerateRequest, SpecStats
from service.metrics import Metrics
from speculative.chat import chat_ids, stop_token_ids
from speculative.context import max_new_tokens_within
from speculative.sampling import SEED_RANGE, SamplingParams


def build_app(
    settings: ServeSettings,
    engine: Engine,
    tokenizer: Any,  # a transformers tokenizer (the callers hold it untyped)
    metrics: Metrics | None = None,
    controller: ControllerLoop | None = None,
) -> FastAPI:
    """The service's app; ``engine`` (and ``controller``) start and stop with its
    lifespan. ``metrics`` should be the object the engine reports its steps to."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        if controller is not None:
            controller.start()
        app.state.ready = True
        try:
            yield
        finally:
            app.state.ready = False
            if controller is not None:
                await asyncio.to_thread(controller.stop)
            await asyncio.to_thread(engine.stop, True, settings.drain_timeout_s)

    app = FastAPI(title="dflash-serve", lifespan=lifespan)
    app.state.settings, app.state.engine, app.state.tokenizer = settings, engine, tokenizer
    app.state.metrics = metrics or Metrics()
    app.state.ready = False
    app.state.stop_ids = stop_token_ids(tokenizer)
    install_handlers(app)
    install_openapi(app)
    authorized = Depends(_check_api_key)

    # response_model=dict: the schema FastAPI derived from the old bare ``-> dict``.
    @app.get("/health", response_model=dict)
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    app.head("/health", include_in_schema=False, response_model=dict)(health)

    @app.get("/ready")
    async def ready() -> JSONResponse:
        ok = app.state.ready and not engine.stats().draining
        return JSONResponse({"ready": ok}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics_text() -> Response:
        stats = engine.stats()
        return Response(app.state.metrics.render(stats.running, stats.waiting), media_type=CONTENT_TYPE_LATEST)

    admin = Depends(_check_admin_key)

    @app.get(
        "/admin/policy",
        dependencies=[admin],
        response_model=Policy,
        response_model_exclude_none=True,
        responses=error_responses(401, 403),
    )
    async def get_policy() -> dict[str, list[int]]:
        policy = engine.policy
        return policy.to_dict()

    @app.post(
        "/admin/policy",
        dependencies=[admin],
        response_model=Policy,
        response_model_exclude_none=True,
        responses=error_responses(400, 401, 403, 409),
    )
    async def set_policy(body: PolicyBody) -> dict[str, list[int]]:
        if controller is not None:  # it would replace the pushed policy within seconds
            raise APIError(
                409,
                "the in-process controller sets this replica's policy (dflash-serve --controller); "
                "restart without it to push policies",
                code="controller_active",
            )
        try:
            policy = BlockPolicy(tuple(body.min_batch), tuple(body.block_sizes), tuple(body.alternates))
            await asyncio.to_thread(engine.set_policy, policy)  # SGLang's RPC blocks
        except ValueError as exc:
            raise APIError(400, str(exc), param="block_sizes") from exc
        return await get_policy()

    card: dict[str, object] = {"id": settings.model_name, "object": "model", "created": 0, "owned_by": "dflash-serve"}

    @app.get("/v1/models", dependencies=[authorized], response_model=ModelList, responses=error_responses(401))
    async def models() -> dict[str, object]:
        return {"object": "list", "data": [card]}

    @app.get(
        "/v1/models/{model_id:path}",
        dependencies=[authorized],
        response_model=Model,
        responses=error_responses(401, 404),
    )
    async def model(model_id: str) -> dict[str, object]:
        _check_model(model_id, settings)
        return card

    inference_errors = error_responses(400, 401, 404, 429, 500, 503)

    @app.post(
        "/v1/chat/completions",
        dependencies=[authorized],
        responses={200: {"model": ChatCompletion}, **inference_errors},
        response_model=None,  # the documented 200 body above; the return type is no response model
    )
    async def chat(body: ChatCompletionRequest, request: Request) -> Response | dict[str, Any]:
        _check_model(body.model, settings)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        prompt_ids = await asyncio.to_thread(chat_ids, tokenizer, messages)  # a 2 MB prompt must not stall the loop
        max_tokens = body.max_completion_tokens or body.max_tokens
        return await _serve(request, body, [prompt_ids], max_tokens, "chat.completion", "chatcmpl")

    @app.post(
        "/v1/completions",
        dependencies=[authorized],
        responses={200: {"model": Completion}, **inference_errors},
        response_model=None,  # as for chat
    )
    async def completions(body: CompletionRequest, request: Request) -> Response | dict[str, Any]:
        _check_model(body.model, settings)
        prompts = [
            list(prompt)
            if isinstance(prompt, list)
            else (await asyncio.to_thread(tokenizer, prompt, add_special_tokens=False))["input_ids"]
            for prompt in body.prompts()
        ]
        return await _serve(request, body, prompts, body.max_tokens, "text_completion", "cmpl")

    return app


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


async def _serve(
    request: Request,
    body: SamplingFields,
    prompts: list[list[int]],
    max_tokens: int | None,
    kind: str,
    prefix: str,
) -> Response | dict[str, Any]:
    """Run ``body.n`` choices for each prompt (choice index: prompt * n + choice)
    and answer with all of them."""
    app = request.app
    engine: Engine = app.state.engine
    settings: ServeSettings = app.state.settings
    if len(prompts) * body.n > settings.max_batch_size + settings.max_waiting:
        raise APIError(
            400,
            f"{len(prompts)} prompt(s) x n ({body.n}) exceeds the requests this server holds at once "
            f"({settings.max_batch_size} running + {settings.max_waiting} waiting)",
            param="n",
        )
    stop_ids = () if body.ignore_eos else app.state.stop_ids
    sampling = SamplingParams(
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=max(0, body.top_k or 0),
        seed=body.seed,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        min_tokens=body.min_tokens,
        suppressed=stop_ids,
        logprobs=body.logprob_count(),
    )
    request_id = f"{prefix}-{uuid.uuid4().hex}"
    budgets = []
    for prompt_ids in prompts:
        limit = max_new_tokens_within(engine.context_length, len(prompt_ids), engine.max_block_size)
        budgets.append(max_tokens if max_tokens is not None else max(1, limit))
        if body.min_tokens > budgets[-1]:
            raise APIError(
                400, f"min_tokens ({body.min_tokens}) exceeds max_tokens ({budgets[-1]})", param="min_tokens"
            )
    # One engine request per choice k = prompt * n + i. With a seed, choice i draws from seed + i
    # (else all n would be one): each prompt's choices are what it would get alone.
    choices = [(p, i) for p in range(len(prompts)) for i in range(body.n)]
    generates = [
        GenerateRequest(
            request_id=request_id if len(choices) == 1 else f"{request_id}-{k}",
            prompt_ids=tuple(prompts[p]),
            max_tokens=budgets[p],
            sampling=_nth_seed(sampling, i),
            stop_token_ids=stop_ids,
            stop=tuple(body.stop or ()),
            group=request_id,
        )
        for k, (p, i) in enumerate(choices)
    ]
    started = time.perf_counter()
    streams = await _admit(request, engine, generates)
    metrics = app.state.metrics
    deltas = [
        _metered(stream, first, metrics, started, len(generate.prompt_ids))
        for (stream, first), generate in zip(streams, generates, strict=True)
    ]
    meta: dict[str, Any] = {
        "id": request_id,
        "created": int(time.time()),
        "model": body.model,
        "kind": kind,
        "prompt_tokens": sum(map(len, prompts)),
    }
    # The tokenizer names the logprobs' tokens; None: the request asked for none.
    namer = app.state.tokenizer if sampling.logprobs is not None else None
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_sse(deltas, meta, include_usage, namer), media_type="text/event-stream")
    return await _complete(request, deltas, meta, namer)


async def _admit(
    request: Request, engine: Engine, generates: list[GenerateRequest]
) -> list[tuple[AsyncGenerator[Delta, None], Delta]]:
    """Start every generation and wait for each one's first delta, all at once
    (so their prefills batch). All or nothing: when one is refused (queue full,
    draining, bad input), the others are aborted and its error is raised before
    any byte is sent; when the client goes away while they wait for a batch
    place, they are all aborted (a 499), so an abandoned request is never
    prefilled and leaves the queue."""
    # Both engines' ``generate`` are async generators (closed by ``_metered``, or here).
    streams = [cast(AsyncGenerator[Delta, None], engine.generate(g)) for g in generates]
    firsts = [asyncio.ensure_future(anext(stream)) for stream in streams]
    failure: BaseException | None = None
    while failure is None:
        # A refusal comes at once; the others' first deltas may wait for a batch place.
        _, waiting = await asyncio.wait(firsts, timeout=0.5, return_when=asyncio.FIRST_EXCEPTION)
        failure = next((f.exception() for f in firsts if f.done() and not f.cancelled() and f.exception()), None)
        if failure is None and not waiting:
            return [(stream, first.result()) for stream, first in zip(streams, firsts, strict=True)]
        if failure is None and await request.is_disconnected():
            # Nobody reads it; 499 (nginx's "client closed request") keeps the access log honest.
            failure = APIError(499, "client disconnected", code="client_disconnected")
    for first in firsts:
        first.cancel()
    await asyncio.gather(*firsts, return_exceptions=True)
    for stream in streams:
        await stream.aclose()
    if isinstance(failure, EngineError):
        raise from_engine_error(failure) from failure
    raise failure


def _nth_seed(sampling: SamplingParams, i: int) -> SamplingParams:
    """Choice i's sampling: the request's, with ``seed + i`` (wrapped into the seed range) when seeded."""
    if sampling.seed is None or i == 0:
        return sampling
    low, high = SEED_RANGE
    return dataclasses.replace(sampling, seed=low + (sampling.seed - low + i) % (high - low + 1))


async def _metered(
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


async def _complete(
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
    chat = meta["kind"] == "chat.completion"
    for i, choice in enumerate(deltas):
        text = "".join(d.text for d in choice)
        body: dict[str, object] = {"index": i, "finish_reason": choice[-1].finish_reason, "logprobs": None}
        if chat:
            body["message"] = {"role": "assistant", "content": text}
        else:
            body["text"] = text
        if namer is not None:
            scores = [s for d in choice for s in d.logprobs]
            body["logprobs"] = chat_logprobs(scores, namer) if chat else completion_logprobs(scores, namer, 0)
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


async def _sse(
    streams: list[AsyncGenerator[Delta, None]], meta: dict[str, Any], include_usage: bool, namer: Any
) -> AsyncIterator[str]:
    """Server-sent events, the choices' chunks interleaved as they come (each
    names its choice ``index``); leaving early (client gone) closes every
    stream, which aborts the requests in the engine."""
    chat = meta["kind"] == "chat.completion"
    kind = "chat.completion.chunk" if chat else "text_completion"
    head = {"id": meta["id"], "object": kind, "created": meta["created"], "model": meta["model"]}

    offsets = [0] * len(streams)  # each completion choice's text so far, for ``text_offset``

    def chunk(index: int, delta: Delta, role: bool) -> str:
        text, finish = delta.text, delta.finish_reason
        logprobs: dict[str, Any] | None = None
        if chat:
            body = {"role": "assistant", "content": text} if role else ({"content": text} if text else {})
            if namer is not None:
                logprobs = chat_logprobs(delta.logprobs, namer)
            choice = {"index": index, "delta": body, "finish_reason": finish, "logprobs": logprobs}
        else:
            if namer is not None:
                logprobs = completion_logprobs(delta.logprobs, namer, offsets[index])
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
            if delta.text or role[i] or delta.finish_reason or delta.logprobs:
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


def _check_model(name: str, settings: ServeSettings) -> None:
    if name != settings.model_name:
        raise APIError(404, f"The model `{name}` does not exist", param="model", code="model_not_found")


def _check_admin_key(request: Request) -> None:
    key = request.app.state.settings.admin_key
    if not key:
        raise APIError(403, "the admin API is disabled (set --admin-key)", type="permission_error")
    if request.headers.get("authorization") != f"Bearer {key}":
        raise APIError(401, "Incorrect admin key provided", code="invalid_api_key")


def _check_api_key(request: Request) -> None:
    key = request.app.state.settings.api_key
    if key and request.headers.get("authorization") != f"Bearer {key}":
        raise APIError(401, "Incorrect API key provided", code="invalid_api_key")
