"""The HTTP surface of ``elmo serve`` (FastAPI on uvicorn; FastAPI publishes the OpenAPI schema at /openapi.json).

    POST /embed           sentences (raw text or token lists) -> every layer, the scalar mix, or its mean
    POST /v1/embeddings   OpenAI's embeddings request and response: the mean of the mix per input, unit length
    GET  /v1/models       OpenAI's model list: the one model served
    GET  /health          200 while a model process can answer (or is loading); 503 when none can
    GET  /ready           200 once a model process is warm; 503 before, and from SIGTERM on
    GET  /info            the exact model (version, run, content hash), its shape, precision, kernels, limits
    POST /reload          resolve the reference again and switch to what it names now, once warm (also SIGHUP)
    GET  /metrics         Prometheus text

A body is read up to ``--max-body-bytes`` before anything parses it, and not at all when the queue is full
(``Gate``); with an API key every route but /health and /ready (and /metrics with ``--metrics-open``) wants
``Authorization: Bearer KEY``, compared in constant time. A request whose client disconnects leaves the queue (its
sentences are skipped, answers already computing are dropped). Every request has an id (``X-Request-ID``, the
client's or a new one, echoed) and one JSON line in the access log (``AccessLog``). Every answer names the exact
model that computed it (``X-Elmo-Model``: ``models:/elmo/3`` where ``models:/elmo/latest`` was served;
``X-Elmo-Model-Id``: its content hash), as do its body's ``model`` and its access-log line.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import signal
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from elmo_core.options import ServeConfig
from elmo_core.serve.api import (
    BINARY_MEDIA_TYPE,
    BadRequest,
    EmbedRequest,
    EmbedResponse,
    OpenAIEmbeddingRequest,
    OpenAIEmbeddingResponse,
    Output,
    RequestError,
    TooLarge,
    Unauthorized,
    Unprocessable,
    binary_body,
    dumps,
    embed_body,
    openai_body,
)
from elmo_core.serve.batcher import Batcher, Limits
from elmo_core.serve.batcher import Request as Admitted
from elmo_core.serve.metrics import ENDPOINTS, ServerMetrics
from elmo_core.serve.workers import WorkerPlan, WorkerPool
from elmo_core.text.tokenize import get_tokenizer

ERRORS = {
    status: {"description": why}
    for status, why in ((400, "token ids"), (413, "over a limit"), (422, "a bad body"), (429, "queue full"))
}
# A refused body is read and thrown away up to this many bytes before the answer, where the connection ends with the
# answer: past it, the answer goes out at once (the client may then see a reset instead of reading it).
DISCARD_BYTES = 64 << 20
MODEL_HEADER, MODEL_ID_HEADER = "X-Elmo-Model", "X-Elmo-Model-Id"  # on every answer: the exact model that made it
ACCESS_SCOPE_KEY = "elmo.access"  # where a route leaves what the access log line says about its work
access_log = logging.getLogger("elmo_core.serve.access")
log = logging.getLogger(__name__)


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

    def __init__(self, app: Any, server: Server) -> None:
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
        await _error_response(error)(scope, receive, send)


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

    def __init__(self, app: Any, server: Server) -> None:
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


def _start_access_log() -> None:
    """The access log's lines go to stdout as they are (JSON), apart from the server's own log."""
    if not access_log.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(message)s"))
        access_log.addHandler(handler)
        access_log.setLevel(logging.INFO)
        access_log.propagate = False


def _error_response(error: RequestError) -> JSONResponse:
    """OpenAI's error shape, which its clients read: {"error": {"message", "type", "param", "code"}}."""
    body = {"error": {"message": str(error), "type": type(error).__name__, "param": error.param, "code": error.status}}
    return JSONResponse(body, status_code=error.status, headers=error.headers)


class Server:
    """What the routes share: the options, the metrics, the queue, the model processes, the model's facts. The model
    reference is resolved once, here (``resolve_model``), to the exact model every process of the pool loads; only a
    reload (``reload``: SIGHUP or ``POST /reload``) resolves it again, and switches to another pool when it is warm."""

    def __init__(self, config: ServeConfig, resolve_model: Callable[[], Any], on_fatal: Callable[[str], None]) -> None:
        self.config, self.resolve_model, self.on_fatal = config, resolve_model, on_fatal
        self.metrics = ServerMetrics()
        self.tokenize = get_tokenizer(config.tokenizer)
        self.batcher: Batcher | None = None
        self.state = "starting"
        self.options: dict[str, Any] = {}
        self.created = int(time.time())  # /v1/models' "created"
        self.draining = False  # SIGTERM came: /ready answers 503 while requests are still served
        self.reloading: dict[str, Any] | None = None  # a reload under way: from, to, since
        self.last_reload: dict[str, Any] | None = None  # how the last one ended
        self._call: Callable[..., Any] | None = None
        self._reload_lock = threading.Lock()

    @property
    def pool(self) -> WorkerPool | None:
        """The pool that answers new requests."""
        return self.batcher.pool if self.batcher is not None else None

    @property
    def model_name(self) -> str:
        """The exact model new requests are answered with (``models:/elmo/3`` where ``latest`` was asked), once
        resolved; the reference as given before."""
        return self.pool.model.name if self.pool is not None else self.config.model

    async def start(self) -> None:
        config = self.config
        limits = Limits(
            config.max_batch_tokens, config.max_wait_ms, config.max_queue_tokens, config.batching, config.batch_timeout
        )
        loop = asyncio.get_running_loop()
        self.batcher = Batcher(limits, self.metrics, self.on_fatal, self._switched)
        self._call = loop.call_soon_threadsafe
        threading.Thread(target=self._start_workers, daemon=True).start()

    def _plan(self, model: Any) -> WorkerPlan:
        config = self.config
        return WorkerPlan(model, config.device, config.precision, config.workers, config.max_batch_tokens)

    def _start_workers(self) -> None:
        """Off the event loop: resolve the model once (a registered one lands in the download cache) and pin it with
        its content hash, then start the model processes, which all load exactly that."""
        try:
            self.state = "fetching the model"
            model = self.resolve_model().pinned()
            self.options = json.loads(model.options.read_text())
        except Exception as exc:  # one line, and the server stops
            message = str(exc).splitlines()[0] if str(exc) else repr(exc)
            self._call(self.batcher.fatal, f"the model cannot be loaded: {message}")  # type: ignore[misc, union-attr]
            return
        log.info("serving %s (id %s, %s)", model.name, model.digest, model.origin)
        pool = WorkerPool(self._plan(model), self.batcher, self._call)  # type: ignore[arg-type]
        self.batcher.pool = pool  # type: ignore[union-attr]
        self.state = "loading the model"
        pool.start()

    async def reload(self) -> dict[str, Any]:
        """Resolve the reference again; where it names another model now, load it in a new pool beside the serving
        one, which the batcher switches to once all of it is warm. What happened, as ``/reload`` answers it."""
        if self.pool is None:
            return {"reloading": False, "why": "the model is still loading"}
        if not self._reload_lock.acquire(blocking=False):
            return {"reloading": True, **(self.reloading or {}), "why": "a reload is already under way"}
        try:
            if self.reloading is not None:
                return {"reloading": True, **self.reloading, "why": "a reload is already under way"}
            current = self.pool.model
            try:
                model = (await asyncio.to_thread(self.resolve_model)).pinned()
            except Exception as exc:  # the store is away, the name is gone: the serving pool goes on
                why = str(exc).splitlines()[0] if str(exc) else repr(exc)
                log.error("reload: %s cannot be resolved (%s); still serving %s", self.config.model, why, current.name)
                self.last_reload = {"ok": False, "why": why, "time": time.time()}
                return {"reloading": False, "model": current.name, "why": f"cannot be resolved: {why}"}
            if (model.exact, model.digest) == (current.exact, current.digest):
                why = f"{self.config.model} still names {current.name} (id {current.digest})"
                log.info("reload: %s; nothing to do", why)
                return {"reloading": False, "model": current.name, "why": why}
            generation = self.pool.generation + 1
            self.reloading = {"from": current.name, "to": model.name, "to_id": model.digest, "since": time.time()}
            log.info(
                "reload: %s now names %s (id %s); loading it in new model processes beside %s",
                self.config.model,
                model.name,
                model.digest,
                current.name,
            )
            pool = WorkerPool(self._plan(model), self.batcher, self._call, generation, self._reload_failed)  # type: ignore[arg-type]
            self.batcher.begin_reload(pool)  # type: ignore[union-attr]
            return {"reloading": True, **self.reloading}
        finally:
            self._reload_lock.release()

    def _switched(self, new: WorkerPool, old: WorkerPool | None) -> None:
        self.options = json.loads(new.model.options.read_text())
        self.reloading = None
        self.last_reload = {"ok": True, "from": old.model.name if old else None, "to": new.model.name}
        self.last_reload["time"] = time.time()
        log.info("reload: switched to %s (id %s); %s finishes what it began", new.model.name, new.model.digest,
                 old.model.name if old else "nothing")

    def _reload_failed(self, message: str) -> None:
        target = (self.reloading or {}).get("to")
        log.error("reload: %s cannot run (%s); still serving %s", target, message, self.model_name)
        self.reloading = None
        self.last_reload = {"ok": False, "to": target, "why": message, "time": time.time()}
        self.batcher.reload_failed(message)  # type: ignore[union-attr]

    async def stop(self) -> None:
        if self.batcher is None:
            return
        pools = [p for p in (self.batcher.pool, self.batcher.incoming, *self.batcher.retiring) if p is not None]
        for pool in pools:
            await asyncio.to_thread(pool.stop)

    @property
    def layers(self) -> int | None:
        """The model's layers (L+1), from its options.json, once fetched."""
        return self.options["lstm"]["n_layers"] + 1 if self.options else None

    @property
    def ready(self) -> bool:
        return self.pool is not None and self.pool.ready_count > 0 and not self.draining

    def failing(self) -> str | None:
        """Why no model process can answer (all dead or being killed), or None: what /health is decided on. While
        the model is fetched or loading, nothing is failing yet: /ready says it is not warm."""
        if self.batcher is not None and self.batcher.fatal_message is not None:
            return self.batcher.fatal_message
        if self.pool is None or self.pool.able_count > 0:
            return None
        states = ", ".join(f"worker {w.slot} {w.state}" for w in self.pool.workers)
        return f"no model process can answer ({states})"

    def worker_info(self) -> dict[str, Any]:
        return next((w.info for w in self.pool.workers if w.ready), {}) if self.pool else {}

    # --- a request's sentences ------------------------------------------------------------------------
    def sentences(
        self, items: list[str] | list[str | list[str]], field: str, truncate: bool | None
    ) -> tuple[list[list[str]], int]:
        """Token lists, raw text tokenized, and how many were cut to ``--max-sentence-tokens`` (``truncate``, else
        ``--auto-truncate``); the limits checked (413 naming the limit, 422 naming the item)."""
        config = self.config
        cut = config.auto_truncate if truncate is None else truncate
        if len(items) > config.max_sentences:
            raise TooLarge(f"{field} has {len(items)} sentences; the limit is --max-sentences {config.max_sentences}")
        sentences = [self.tokenize(item) if isinstance(item, str) else item for item in items]
        truncated = 0
        for i, sentence in enumerate(sentences):
            where = f"{field}[{i}]" if len(items) > 1 or field != "input" else field
            if not sentence or any(not token for token in sentence):
                raise Unprocessable(f"{where}: an empty sentence or an empty token; nothing to embed", param=where)
            if len(sentence) > config.max_sentence_tokens:
                if not cut:
                    raise TooLarge(
                        f"{where} has {len(sentence)} tokens; the limit is --max-sentence-tokens "
                        f'{config.max_sentence_tokens} (send "truncate": true to have it cut there)'
                    )
                sentences[i], truncated = sentence[: config.max_sentence_tokens], truncated + 1
        total = sum(len(s) for s in sentences)
        if total > config.max_request_tokens:
            raise TooLarge(
                f"the request has {total:,} tokens; the limit is --max-request-tokens {config.max_request_tokens:,}"
            )
        return sentences, truncated

    def check_answer_size(self, sentences: list[list[str]], spec: Output) -> None:
        """The floats the answer would carry, within ``--max-answer-floats`` (else 413): one answer's memory, in the
        model process that encodes it and in this one that sends it, is bounded."""
        if not self.options:
            return  # the model's shape is not known before it is fetched; nothing is answered before either
        width = 2 * self.options["lstm"]["projection_dim"]
        tokens = sum(len(s) for s in sentences)
        floats = len(sentences) * width if spec.kind == "mean" else tokens * width
        floats *= self.layers if spec.kind == "layers" else 1  # type: ignore[operator]
        if floats > self.config.max_answer_floats:
            raise TooLarge(
                f"the answer would carry {floats:,} floats ({spec.kind} of {tokens:,} tokens); the limit is "
                f"--max-answer-floats {self.config.max_answer_floats:,}: send fewer sentences a request"
            )

    async def embed(self, request: Request, sentences: list[list[str]], spec: Output) -> Admitted | None:
        """The batcher's answer, or None where the client left first (its work is then dropped)."""
        request.scope[ACCESS_SCOPE_KEY].update(sentences=len(sentences), tokens=sum(len(s) for s in sentences))
        work = asyncio.ensure_future(self.batcher.embed(sentences, spec))  # type: ignore[union-attr]
        gone = asyncio.ensure_future(_disconnected(request))
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            work.cancel()
            return None
        gone.cancel()
        answer = work.result()
        request.scope[ACCESS_SCOPE_KEY].update(
            queue_ms=round(answer.queue_seconds * 1000, 2),
            compute_ms=round(answer.compute_seconds * 1000, 2),
            model=answer.pool.model.name,  # type: ignore[union-attr]
            model_id=answer.pool.model.digest,  # type: ignore[union-attr]
        )
        return answer

    def info(self) -> dict[str, Any]:
        """What /info says: the model and its shape, what runs it, the processes, the limits."""
        config, model = self.config, self.worker_info()
        workers = [
            {
                "slot": w.slot,
                "ready": w.ready,
                "state": w.state,
                "pid": w.info.get("pid"),
                "threads": w.info.get("threads"),
            }
            for w in (self.pool.workers if self.pool else [])
        ]
        limits = ("max_batch_tokens", "max_wait_ms", "max_queue_tokens", "max_sentence_tokens", "max_sentences")
        limits += ("max_request_tokens",)
        limits += ("max_answer_floats", "max_body_bytes", "batching", "batch_timeout", "drain_delay", "drain_seconds")
        serving = self.pool.model if self.pool is not None else None
        return {
            "model": self.model_name,
            "source": config.model,
            "identity": {**serving.identity(), "digest": serving.digest} if serving is not None else None,
            "generation": self.pool.generation if self.pool is not None else 0,
            "reloading": self.reloading,
            "last_reload": self.last_reload,
            "ready": self.ready,
            "shape": {
                "layers": self.layers,
                "dim": model.get("dim"),
                "lstm": self.options.get("lstm", {}),
                "char_cnn": {k: v for k, v in self.options.get("char_cnn", {}).items() if k != "filters"},
            },
            **{key: model.get(key) for key in ("device", "precision", "precision_why", "kernels", "cpu")},
            "tokenizer": config.tokenizer,
            "normalize": {"/embed": False, "/v1/embeddings": True},  # the defaults; a request's "normalize" decides
            "truncate": config.auto_truncate,  # the default; a request's "truncate" decides
            "binary_media_type": BINARY_MEDIA_TYPE,
            "metrics_open": config.metrics_open,
            "workers": workers,
            "restarts": self.pool.restarts if self.pool else 0,
            "limits": {name: getattr(config, name) for name in limits},
        }


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _server(request: Request) -> Server:
    return request.app.state.server


def _left(request: Request, endpoint: str) -> Response:
    """The client left before its answer: counted (499), and nothing is sent."""
    _server(request).metrics.answered(endpoint, 499, 0.0)
    return Response(status_code=499)


async def authorized(request: Request) -> None:
    """With an API key, the request must carry it as a Bearer token (compared in constant time). A coroutine: FastAPI
    runs a plain function dependency in a thread of its pool, a thread handoff on every request."""
    key = _server(request).config.api_key
    if key is None:
        return
    given = request.headers.get("authorization", "")
    if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
        raise Unauthorized(
            "this server wants 'Authorization: Bearer KEY' (its --api-key)", {"WWW-Authenticate": "Bearer"}
        )


router = APIRouter()
guarded = APIRouter(dependencies=[Depends(authorized)])


@guarded.post("/embed", response_model=EmbedResponse, responses=ERRORS)
async def embed(body: EmbedRequest, request: Request) -> Response:
    server, started = _server(request), time.monotonic()
    sentences, truncated = server.sentences(body.sentences, "sentences", body.truncate)
    layers = server.layers
    if body.mix_weights is not None and layers is not None and len(body.mix_weights) != layers:
        raise Unprocessable(
            f"mix_weights: {len(body.mix_weights)} values; the model has {layers} layers", param="mix_weights"
        )
    spec = body.output_spec()
    server.check_answer_size(sentences, spec)
    answer = await server.embed(request, sentences, spec)
    if answer is None:
        return _left(request, "/embed")
    model = answer.pool.model  # type: ignore[union-attr]
    head = {"model": model.name, "model_id": model.digest, "output": body.output, "dtype": body.dtype}
    usage = {"tokens": sum(len(s) for s in sentences), "truncated": truncated}
    build, media = (binary_body, BINARY_MEDIA_TYPE) if spec.encoding == "binary" else (embed_body, "application/json")
    content = build(head, sentences, answer.shapes, answer.embeddings, usage)
    server.metrics.answered("/embed", 200, time.monotonic() - started)
    return Response(content, media_type=media, headers=model_headers(answer))


@guarded.post("/v1/embeddings", response_model=OpenAIEmbeddingResponse, responses=ERRORS)
async def openai_embeddings(body: OpenAIEmbeddingRequest, request: Request) -> Response:
    server, started = _server(request), time.monotonic()
    texts = [body.input] if isinstance(body.input, str) else body.input
    if not texts:
        raise Unprocessable("input: an empty list; nothing to embed", param="input")
    if not all(isinstance(text, str) for text in texts):
        raise BadRequest(
            "input: token ids are not read here: this biLM reads characters, and ids belong to another model's "
            "vocabulary; send the texts themselves, a string or a list of strings (LangChain's OpenAIEmbeddings: "
            "check_embedding_ctx_length=False)",
            param="input",
        )
    sentences, truncated = server.sentences(texts, "input", body.truncate)  # type: ignore[arg-type]
    dim = server.worker_info().get("dim")
    if body.dimensions is not None and dim is not None and body.dimensions != dim:
        raise Unprocessable(f"dimensions: this model's vectors have {dim}, not {body.dimensions}", param="dimensions")
    answer = await server.embed(
        request, sentences, Output("mean", encoding=body.encoding_format, normalize=body.normalize)
    )
    if answer is None:
        return _left(request, "/v1/embeddings")
    tokens = sum(len(s) for s in sentences)
    usage = {"prompt_tokens": tokens, "total_tokens": tokens, "truncated": truncated}
    content = openai_body(answer.pool.model.name, answer.embeddings, usage)  # type: ignore[union-attr]
    server.metrics.answered("/v1/embeddings", 200, time.monotonic() - started)
    return Response(content, media_type="application/json", headers=model_headers(answer))


def model_headers(answer: Admitted) -> dict[str, str]:
    """Which model computed this answer, exactly: its version (``models:/elmo/3``, or the folder's name) and content
    hash. During a reload two versions answer, each request from one; the headers say which."""
    model = answer.pool.model  # type: ignore[union-attr]
    return {MODEL_HEADER: model.name, MODEL_ID_HEADER: model.digest or model.model_id}


@guarded.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    """OpenAI's model list, which clients and frameworks read to check a model before using it: the one served."""
    server = _server(request)
    card = {"id": server.model_name, "object": "model", "created": server.created, "owned_by": "elmo-pipeline"}
    return {"object": "list", "data": [card]}


@guarded.post("/reload")
async def reload(request: Request) -> JSONResponse:
    """Resolve the served reference again (``models:/elmo@champion``, ``/latest``) and, where it names another model
    now, load that in new model processes and switch to them once all are warm (what SIGHUP does). 202 while it
    loads, 200 where there is nothing to do, 409 while the model first loads."""
    server = _server(request)
    result = await server.reload()
    status = 202 if result.get("reloading") else (409 if server.pool is None else 200)
    return JSONResponse(result, status_code=status)


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """A liveness probe: 503 when no model process can answer (all dead, or killed past the batch timeout, and
    their restarts pausing), so an orchestrator restarts what restarting processes here has not cured."""
    why = _server(request).failing()
    if why is None:
        return JSONResponse({"status": "ok"})
    return JSONResponse({"status": "failing", "why": why}, status_code=503)


@router.get("/ready")
async def ready(request: Request) -> JSONResponse:
    server = _server(request)
    if server.ready:
        return JSONResponse({"ready": True, "workers_ready": server.pool.ready_count})  # type: ignore[union-attr]
    state = "stopping" if server.draining else server.state
    return JSONResponse({"ready": False, "state": state}, status_code=503)


@guarded.get("/info")
async def info(request: Request) -> dict[str, Any]:
    return _server(request).info()


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    server = _server(request)
    if not server.config.metrics_open:
        await authorized(request)
    return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)


async def request_error(request: Request, error: RequestError) -> JSONResponse:
    if request.url.path in ENDPOINTS:
        _server(request).metrics.answered(request.url.path, error.status, 0.0)
    return _error_response(error)


async def bad_body(request: Request, error: RequestValidationError) -> JSONResponse:
    """A body that does not validate: 422, the fields named as dotted paths (``sentences.0``); a field this server
    does not have is named as such (it would otherwise be ignored, and the client think it was obeyed)."""
    problems = [(".".join(str(p) for p in e["loc"][1:]) or "body", e["msg"], e["type"]) for e in error.errors()]
    unknown = [where for where, _, kind in problems if kind == "extra_forbidden"]
    if unknown:
        message = f"unknown field{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}: this server does not take it"
        return await request_error(request, Unprocessable(message, param=unknown[0]))
    message = "; ".join(f"{where}: {msg}" for where, msg, _ in problems[:5])
    return await request_error(request, Unprocessable(message, param=problems[0][0] if problems else None))


def create_app(config: ServeConfig, resolve_model: Callable[[], Any], on_fatal: Callable[[str], None]) -> FastAPI:
    """The app: the routes above around one ``Server``, which starts the model processes with the app."""
    server = Server(config, resolve_model, on_fatal)
    if config.access_log:
        _start_access_log()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await server.start()
        loop = asyncio.get_running_loop()
        try:  # SIGHUP reloads, as it does for nginx and HAProxy; not where signals cannot be set (a thread, Windows)
            loop.add_signal_handler(signal.SIGHUP, lambda: asyncio.ensure_future(server.reload()))
        except (NotImplementedError, RuntimeError, ValueError, AttributeError):
            pass
        yield
        await server.stop()

    app = FastAPI(title="elmo serve", summary="ELMo vectors on request", lifespan=lifespan)
    app.state.server = server
    app.add_middleware(Gate, server=server)
    app.add_middleware(AccessLog, server=server)  # added last: outermost, so refusals are logged and carry the id
    app.add_exception_handler(RequestError, request_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, bad_body)  # type: ignore[arg-type]
    app.include_router(router)
    app.include_router(guarded)
    return app
