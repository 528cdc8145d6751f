"""What every request meets before and after the routes of ``elmo serve`` (ASGI middleware): its id and access-log
line (``AccessLog``, outermost), and what is refused before a body is parsed (``Gate``: a full queue, a body over
the limit), each refusal in OpenAI's error shape (``error_response``). Each is given the app's ``Server`` (its
options, metrics, queue and drain state) as ``server``."""

from __future__ import annotations

import logging
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

from fastapi.responses import JSONResponse

from elmo_core.serve.api import RequestError, TooLarge, dumps
from elmo_core.serve.metrics import ENDPOINTS

# A refused body is read and thrown away up to this many bytes before the answer, where the connection ends with the
# answer: past it, the answer goes out at once (the client may then see a reset instead of reading it).
DISCARD_BYTES = 64 << 20
ACCESS_SCOPE_KEY = "elmo.access"  # where a route leaves what the access log line says about its work
access_log = logging.getLogger("elmo_core.serve.access")


def _closes_after(scope: dict) -> bool:
    """The connection ends with this answer (``Connection: close``, which Python's urllib sends, or HTTP/1.0) and the
    client sends its body without waiting for a word (no ``Expect: 100-continue``). uvicorn then closes the socket as
    soon as the answer is written, and a socket closed with unread bytes in it sends a reset, which reaches a client
    still sending before it reads the answer: such a refusal reads the body first. On a kept-alive connection uvicorn
    reads and drops the rest of the body itself after the answer."""
    headers = dict(scope["headers"])
    if b"100-continue" in headers.get(b"expect", b"").lower():
        return False
    connection = headers.get(b"connection", b"").lower()
    return b"close" in connection or (scope.get("http_version") == "1.0" and b"keep-alive" not in connection)


async def _discard(receive: Callable, budget: int) -> None:
    while budget > 0:
        message = await receive()
        if message["type"] != "http.request":
            return
        budget -= len(message.get("body", b""))
        if not message.get("more_body", False):
            return


class Gate:
    """ASGI middleware, what is refused before a body is parsed: a POST to a full queue gets its 429 without its
    body being parsed (under overload, refusing must cost less than answering), and a body is read whole, up to
    ``--max-body-bytes``, before the app sees it; past it a 413 (the declared Content-Length is checked first, so
    an honest large upload is refused before it is read). Every refusal is in JSON, and a client that sends its
    whole body before reading reads it too (``_closes_after``)."""

    def __init__(self, app: Any, server: Any) -> None:
        self.app, self.server, self.limit = app, server, server.config.max_body_bytes

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        batcher = self.server.batcher
        declared = dict(scope["headers"]).get(b"content-length")
        size = int(declared) if declared is not None and declared.isdigit() else None
        if scope["path"] in ENDPOINTS and batcher is not None and batcher.full:
            return await self._refuse(scope, receive, send, batcher.refusal(), size)
        if size is not None and size > self.limit:
            return await self._refuse(scope, receive, send, self._too_large(f"the body has {size:,} bytes"), size)
        chunks, read = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            read += len(chunks[-1])
            more = message.get("more_body", False)
            if read > self.limit:
                error = self._too_large(f"the body passed {self.limit:,} bytes")
                return await self._refuse(scope, receive, send, error, size, read if more else None)
            if not more:
                break
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # then what the client does next: a disconnect

        await self.app(scope, replay, send)

    def _too_large(self, what: str) -> TooLarge:
        return TooLarge(f"{what}; the limit is --max-body-bytes {self.limit:,}")

    async def _refuse(
        self,
        scope: dict,
        receive: Callable,
        send: Callable,
        error: RequestError,
        size: int | None,
        read: int | None = 0,
    ) -> None:
        """Answer ``error``; first read the rest of the body (``read``: bytes read so far, None: all of it) where the
        connection closes with the answer and the body is within ``DISCARD_BYTES``."""
        if read is not None and (size is None or size <= DISCARD_BYTES) and _closes_after(scope):
            await _discard(receive, DISCARD_BYTES - read)
        if scope["path"] in ENDPOINTS:
            self.server.metrics.answered(scope["path"], error.status, 0.0)
        await error_response(error)(scope, receive, send)


def _request_id(scope: dict) -> str:
    """The client's ``X-Request-ID`` where it is a plausible one (1-128 visible ASCII characters), else a new one."""
    given = dict(scope["headers"]).get(b"x-request-id", b"")
    if 0 < len(given) <= 128 and all(0x21 <= c <= 0x7E for c in given):
        return given.decode()
    return uuid.uuid4().hex


class AccessLog:
    """ASGI middleware, outermost: every request gets its id (``X-Request-ID`` taken or made, and echoed on the
    answer) and, with ``--access-log``, one JSON line once answered: id, method, path, status, and for embeddings the
    sentences, tokens, milliseconds in the queue and in the model processes, and in all. From SIGTERM on, answers
    also say ``Connection: close``: a client holding a connection to this replica opens its next one through the
    load balancer, to another, instead of meeting this one's listener closed."""

    def __init__(self, app: Any, server: Any) -> None:
        self.app, self.server, self.enabled = app, server, server.config.access_log

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started, request_id, status = time.monotonic(), _request_id(scope), 0
        work: dict[str, Any] = {}
        scope[ACCESS_SCOPE_KEY] = work

        async def send_with_id(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
                if self.server.draining:
                    headers.append((b"connection", b"close"))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:  # answered 500 by Starlette's outermost layer, past this one's send
            status = status or 500
            raise
        finally:
            if self.enabled:
                line = {"time": round(time.time(), 3), "request_id": request_id, "method": scope["method"]}
                line |= {"path": scope["path"], "status": status or 499, **work}
                line["ms"] = round((time.monotonic() - started) * 1000, 2)
                access_log.info(dumps(line).decode())


def start_access_log() -> None:
    """The access log's lines go to stdout as they are (JSON), apart from the server's own log."""
    if not access_log.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(message)s"))
        access_log.addHandler(handler)
        access_log.setLevel(logging.INFO)
        access_log.propagate = False


def error_response(error: RequestError) -> JSONResponse:
    """OpenAI's error shape, which its clients read: {"error": {"message", "type", "param", "code"}}."""
    body = {"error": {"message": str(error), "type": type(error).__name__, "param": error.param, "code": error.status}}
    return JSONResponse(body, status_code=error.status, headers=error.headers)
