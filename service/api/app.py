"""The FastAPI app: OpenAI-compatible endpoints over an engine.

``build_app(settings, engine, tokenizer, metrics, controller)``: the engine (and
the in-process controller, when given) start in the lifespan and drain when the
app shuts down; everything lives on ``app.state``; every error goes through
``service.api.errors``. Routes: ``/v1/chat/completions``, ``/v1/completions``,
``/v1/models`` (and ``/v1/models/{id}``), ``/health``, ``/ready``, ``/metrics``,
and ``/admin/policy`` (the block-size policy, admin key; 409 while the
in-process controller owns it). An inference request becomes one engine
request per choice here (``_serve``, ``_admit``); ``service.api.replies``
turns their streams into the reply.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, cast

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from service.api.errors import REFUSAL_REASONS, APIError, from_engine_error, install_handlers
from service.api.limits import BodyLimit
from service.api.replies import Echo, complete, metered, sse
from service.api.responses import ChatCompletion, Completion, Model, ModelList, Policy, error_responses, install_openapi
from service.api.schemas import ChatCompletionRequest, CompletionRequest, PolicyBody, SamplingFields
from service.config import ServeSettings
from service.controller.loop import ControllerLoop
from service.engine import BlockPolicy, Delta, Engine, EngineError, GenerateRequest
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
    app.add_middleware(BodyLimit, max_bytes=settings.max_request_bytes, on_refused=_count_too_large(app))
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
        texts = body.prompts()
        prompts = [
            list(prompt)
            if isinstance(prompt, list)
            else (await asyncio.to_thread(tokenizer, prompt, add_special_tokens=False))["input_ids"]
            for prompt in texts
        ]
        echo = None
        if body.echo:  # a prompt of token ids echoes as their text
            echo = [
                Echo(text if isinstance(text, str) else tokenizer.decode(ids), ids[0])
                for text, ids in zip(texts, prompts, strict=True)
            ]
        return await _serve(request, body, prompts, body.max_tokens, "text_completion", "cmpl", echo)

    return app


async def _serve(
    request: Request,
    body: SamplingFields,
    prompts: list[list[int]],
    max_tokens: int | None,
    kind: str,
    prefix: str,
    echo: list[Echo] | None = None,
) -> Response | dict[str, Any]:
    """Run ``body.n`` choices for each prompt (choice index: prompt * n + choice)
    and answer with all of them, each after its prompt's ``echo`` when given
    (``max_tokens`` 0: the echo alone)."""
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
        min_p=body.min_p,
        seed=body.seed,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        min_tokens=body.min_tokens,
        suppressed=stop_ids,
        logprobs=body.logprob_count(),
        prompt_logprobs=body.logprob_count() if echo is not None else None,
        logit_bias=body.logit_bias_pairs(),
        grammar=body.grammar(),
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
            # max_tokens 0 (echo alone): the engine draws its first token with the prefill; it is dropped.
            max_tokens=max(budgets[p], 1),
            sampling=_nth_seed(sampling, i),
            stop_token_ids=stop_ids,
            stop=tuple(body.stop or ()),
            group=request_id,
        )
        for k, (p, i) in enumerate(choices)
    ]
    started = time.perf_counter()
    try:
        streams = await _admit(request, engine, generates)
    except APIError as error:
        if error.param == "response_format":  # the engine names the format whichever field gave it
            error.param = body.grammar_field()
        raise
    if max_tokens == 0:
        streams = [(stream, _prompt_only(first)) for stream, first in streams]
    metrics = app.state.metrics
    deltas = [
        metered(stream, first, metrics, started, len(generate.prompt_ids))
        for (stream, first), generate in zip(streams, generates, strict=True)
    ]
    meta: dict[str, Any] = {
        "id": request_id,
        "created": int(time.time()),
        "model": body.model,
        "kind": kind,
        "prompt_tokens": sum(map(len, prompts)),
        "echo": [echo[p] for p, _ in choices] if echo is not None else None,
    }
    # The tokenizer names the logprobs' tokens; None: the request asked for none.
    namer = app.state.tokenizer if sampling.logprobs is not None else None
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(sse(deltas, meta, include_usage, namer), media_type="text/event-stream")
    return await complete(request, deltas, meta, namer)


async def _admit(
    request: Request, engine: Engine, generates: list[GenerateRequest]
) -> list[tuple[AsyncGenerator[Delta, None], Delta]]:
    """Start every generation and wait for each one's first delta, all at once
    (so their prefills batch). All or nothing: when one is refused (queue full,
    draining, bad input), the others are aborted and its error is raised before
    any byte is sent; when the client goes away while they wait for a batch
    place, they are all aborted (a 499), so an abandoned request is never
    prefilled and leaves the queue."""
    # Both engines' ``generate`` are async generators (closed by ``replies.metered``, or here).
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


def _prompt_only(first: Delta) -> Delta:
    """An echo-alone choice's only delta: its prompt's log-probabilities, without the
    one token the engine drew (a final delta, so the engine's stream is closed after it)."""
    return dataclasses.replace(first, text="", token_ids=(), logprobs=(), completion_tokens=0, finish_reason="length")


def _nth_seed(sampling: SamplingParams, i: int) -> SamplingParams:
    """Choice i's sampling: the request's, with ``seed + i`` (wrapped into the seed range) when seeded."""
    if sampling.seed is None or i == 0:
        return sampling
    low, high = SEED_RANGE
    return dataclasses.replace(sampling, seed=low + (sampling.seed - low + i) % (high - low + 1))


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


def _count_too_large(app: FastAPI) -> Callable[[], None]:
    """Counts a body refused by ``BodyLimit`` (it answers before any route or handler)."""

    def count() -> None:
        app.state.metrics.refused.labels(REFUSAL_REASONS[413]).inc()

    return count
