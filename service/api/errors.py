"""OpenAI-shaped errors and the one place where exceptions become responses."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from service.engine import EngineStoppedError, InvalidRequestError, QueueFullError

log = logging.getLogger(__name__)


class APIError(Exception):
    """An error to send as ``{"error": {message, type, param, code}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, dict[str, str | None]]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def error_response(error: APIError) -> JSONResponse:
    """The JSON response for ``error``."""
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def from_engine_error(exc: Exception) -> APIError:
    """Engine refusals -> API errors (429/503 carry Retry-After)."""
    if isinstance(exc, QueueFullError):
        return APIError(
            429, f"server overloaded: {exc}", type="rate_limit_error", code="queue_full", headers={"Retry-After": "1"}
        )
    if isinstance(exc, EngineStoppedError):
        return APIError(503, str(exc), type="service_unavailable", code="draining", headers={"Retry-After": "5"})
    if isinstance(exc, InvalidRequestError):
        return APIError(400, str(exc), code=exc.code, param=exc.param)
    return APIError(500, "internal error", type="server_error")


def _validation_error(exc: RequestValidationError) -> APIError:
    first = exc.errors()[0] if exc.errors() else {}
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(loc) or None
    message = first.get("msg", "invalid request").removeprefix("Value error, ")
    if first.get("type") == "extra_forbidden":
        message = f"unrecognized request argument: {param}"
    elif first.get("type") == "json_invalid":
        message, param = "request body is not valid JSON", None
    elif param:
        message = f"{param}: {message}"
    return APIError(400, message, param=param)


REFUSAL_REASONS = {
    400: "invalid",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "not_allowed",
    409: "conflict",
    413: "too_large",
    429: "queue_full",
    503: "draining",
}
"""The ``reason`` label of ``dflash_refused_requests_total`` per status."""


def refuse(request: Request, error: APIError) -> JSONResponse:
    """The response for a refused request, counted by reason."""
    reason = REFUSAL_REASONS.get(error.status, "other")
    request.app.state.metrics.refused.labels(reason).inc()
    return error_response(error)


def install_handlers(app: FastAPI) -> None:
    """Register every exception handler (validation, HTTP, API, engine, other)."""

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return refuse(request, _validation_error(exc))

    @app.exception_handler(APIError)
    async def _api(request: Request, exc: APIError) -> JSONResponse:
        return refuse(request, exc) if exc.status < 500 or exc.status == 503 else error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return refuse(request, APIError(exc.status_code, str(exc.detail), type=kind))

    for engine_error in (QueueFullError, EngineStoppedError, InvalidRequestError):

        @app.exception_handler(engine_error)
        async def _engine(request: Request, exc: Exception) -> JSONResponse:
            return refuse(request, from_engine_error(exc))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=exc)
        return error_response(APIError(500, "internal error", type="server_error"))
