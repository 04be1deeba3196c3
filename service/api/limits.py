"""The request-body limit: a body past ``max_bytes`` is refused with 413 before
the app parses it.

FastAPI reads a whole JSON body into memory and parses it before any route
runs, so without a bound one client posting a few hundred megabytes could take
the replica's memory (4 GiB on the CPU pod) and every accepted request with it.
A declared ``Content-Length`` past the limit is refused unread; a chunked body
is read up to the limit and refused once it passes it.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.api.errors import APIError, error_response


class BodyLimit:
    """ASGI middleware: HTTP request bodies of at most ``max_bytes`` (0: no limit).
    ``on_refused()`` is called for each refusal (the metrics' count)."""

    def __init__(self, app: ASGIApp, max_bytes: int, on_refused: Callable[[], None] = lambda: None) -> None:
        self.app, self.max_bytes, self.on_refused = app, max_bytes, on_refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.max_bytes:
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:
            # h11 and httptools end the body at the declared length, so it alone decides.
            if declared.isdigit() and int(declared) > self.max_bytes:
                await self._refuse(scope, receive, send)
            else:
                await self.app(scope, receive, send)
            return
        messages, size = [], 0
        while True:
            message = await receive()
            messages.append(message)
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
            if message["type"] != "http.request" or not message.get("more_body", False):
                break
        await self.app(scope, _replay(messages, receive), send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.on_refused()
        error = APIError(413, f"the request body exceeds {self.max_bytes} bytes", code="request_too_large")
        await error_response(error)(scope, receive, send)


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """A ``receive`` that hands back ``messages`` first, then the real one's."""
    pending = list(messages)

    async def replayed() -> Message:
        return pending.pop(0) if pending else await receive()

    return replayed
