"""The HTTP surface of ``elmo serve`` (FastAPI on uvicorn; FastAPI publishes the OpenAPI schema at /openapi.json).

    POST /embed           sentences (raw text or token lists) -> every layer, the scalar mix, or its mean
    POST /v1/embeddings   OpenAI's embeddings request and response: the mean of the mix per input
    GET  /health          200 while the process runs (at once, before the model is loaded)
    GET  /ready           200 once a model process is warm; 503 before
    GET  /info            the model, its shape, the precision and kernels that run, the limits
    GET  /metrics         Prometheus text

A body is read up to ``--max-body-bytes`` before anything parses it, and not at all when the queue is full
(``Gate``); with an API key every route but /health and /ready wants ``Authorization: Bearer KEY``, compared in
constant time. A request whose client disconnects leaves the queue (its sentences are skipped, answers already
computing are dropped).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from elmo_core.options import ServeConfig
from elmo_core.serve.api import (
    EmbedRequest,
    EmbedResponse,
    OpenAIEmbeddingRequest,
    OpenAIEmbeddingResponse,
    Output,
    RequestError,
    TooLarge,
    Unauthorized,
    Unprocessable,
)
from elmo_core.serve.batcher import Batcher, Limits
from elmo_core.serve.metrics import ENDPOINTS, ServerMetrics
from elmo_core.serve.workers import WorkerPlan, WorkerPool
from elmo_core.text.tokenize import get_tokenizer

ERRORS = {
    status: {"description": why} for status, why in ((413, "over a limit"), (422, "a bad body"), (429, "queue full"))
}


class Gate:
    """ASGI middleware, what is refused before a body is parsed: a POST to a full queue gets its 429 without its
    body being read (under overload, refusing must cost less than answering), and a body is read whole, up to
    ``--max-body-bytes``, before the app sees it; past it a 413 (the declared Content-Length is checked first, so
    an honest large upload is refused before it is sent)."""

    def __init__(self, app: Any, server: Server) -> None:
        self.app, self.server, self.limit = app, server, server.config.max_body_bytes

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        batcher = self.server.batcher
        if scope["path"] in ENDPOINTS and batcher is not None and batcher.full:
            return await self._refuse(scope, send, batcher.refusal())
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._refuse(scope, send, self._too_large(f"the body has {int(declared):,} bytes"))
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                return await self._refuse(scope, send, self._too_large(f"the body passed {self.limit:,} bytes"))
            if not message.get("more_body", False):
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

    async def _refuse(self, scope: dict, send: Callable, error: RequestError) -> None:
        if scope["path"] in ENDPOINTS:
            self.server.metrics.answered(scope["path"], error.status, 0.0)
        await _error_response(error)(scope, None, send)


def _error_response(error: RequestError) -> JSONResponse:
    """OpenAI's error shape, which its clients read: {"error": {"message", "type", "param", "code"}}."""
    body = {"error": {"message": str(error), "type": type(error).__name__, "param": error.param, "code": error.status}}
    return JSONResponse(body, status_code=error.status, headers=error.headers)


class Server:
    """What the routes share: the options, the metrics, the queue, the model processes, the model's facts."""

    def __init__(self, config: ServeConfig, model_dir: Callable[[], str], on_fatal: Callable[[str], None]) -> None:
        self.config, self.resolve_model_dir, self.on_fatal = config, model_dir, on_fatal
        self.metrics = ServerMetrics()
        self.tokenize = get_tokenizer(config.tokenizer)
        self.batcher: Batcher | None = None
        self.pool: WorkerPool | None = None
        self.state = "starting"
        self.model_name = config.model.rstrip("/").rsplit("/", 1)[-1] if "://" not in config.model else config.model
        self.options: dict[str, Any] = {}

    async def start(self) -> None:
        limits = Limits(
            self.config.max_batch_tokens, self.config.max_wait_ms, self.config.max_queue_tokens, self.config.batching
        )
        loop = asyncio.get_running_loop()
        self.batcher = Batcher(limits, self.metrics, self.on_fatal)
        threading.Thread(target=self._start_workers, args=(loop.call_soon_threadsafe,), daemon=True).start()

    def _start_workers(self, call: Callable[..., Any]) -> None:
        """Off the event loop: fetch the model where it is a URI (MLflow), then start the model processes."""
        try:
            self.state = "fetching the model"
            model_dir = self.resolve_model_dir()
            options = Path(model_dir) / "options.json" if Path(model_dir).is_dir() else Path(model_dir)
            self.options = json.loads(options.read_text())
        except Exception as exc:  # one line, and the server stops
            call(self.batcher.fatal, f"the model cannot be loaded: {str(exc).splitlines()[0] if str(exc) else exc!r}")
            return
        config = self.config
        plan = WorkerPlan(model_dir, config.weight_file, config.device, config.precision, config.workers)
        self.pool = WorkerPool(plan, self.batcher, call)  # type: ignore[arg-type]
        self.batcher.pool = self.pool  # type: ignore[union-attr]
        self.state = "loading the model"
        self.pool.start()

    async def stop(self) -> None:
        if self.pool is not None:
            await asyncio.to_thread(self.pool.stop)

    @property
    def layers(self) -> int | None:
        """The model's layers (L+1), from its options.json, once fetched."""
        return self.options["lstm"]["n_layers"] + 1 if self.options else None

    @property
    def ready(self) -> bool:
        return self.pool is not None and self.pool.ready_count > 0

    def worker_info(self) -> dict[str, Any]:
        return next((w.info for w in self.pool.workers if w.ready), {}) if self.pool else {}

    # --- a request's sentences ------------------------------------------------------------------------
    def sentences(self, items: list[str | list[str]], field: str) -> list[list[str]]:
        """Token lists, raw text tokenized; the limits checked (413 naming the limit, 422 naming the item)."""
        config = self.config
        if len(items) > config.max_sentences:
            raise TooLarge(f"{field} has {len(items)} sentences; the limit is --max-sentences {config.max_sentences}")
        sentences = [self.tokenize(item) if isinstance(item, str) else item for item in items]
        for i, sentence in enumerate(sentences):
            where = f"{field}[{i}]" if len(items) > 1 or field != "input" else field
            if not sentence or any(not token for token in sentence):
                raise Unprocessable(f"{where}: an empty sentence or an empty token; nothing to embed", param=where)
            if len(sentence) > config.max_sentence_tokens:
                raise TooLarge(
                    f"{where} has {len(sentence)} tokens; the limit is --max-sentence-tokens "
                    f"{config.max_sentence_tokens}"
                )
        total = sum(len(s) for s in sentences)
        if total > config.max_queue_tokens:
            raise TooLarge(
                f"the request has {total:,} tokens; the limit is --max-queue-tokens {config.max_queue_tokens:,}"
            )
        return sentences

    async def embed(self, request: Request, sentences: list[list[str]], spec: Output):  # noqa: ANN201
        """The batcher's answer, or None where the client left first (its work is then dropped)."""
        work = asyncio.ensure_future(self.batcher.embed(sentences, spec))  # type: ignore[union-attr]
        gone = asyncio.ensure_future(_disconnected(request))
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if work.done():
            gone.cancel()
            return work.result()
        work.cancel()
        return None

    def info(self) -> dict[str, Any]:
        """What /info says: the model and its shape, what runs it, the processes, the limits."""
        config, model = self.config, self.worker_info()
        workers = [
            {"slot": w.slot, "ready": w.ready, "pid": w.info.get("pid"), "threads": w.info.get("threads")}
            for w in (self.pool.workers if self.pool else [])
        ]
        limits = ("max_batch_tokens", "max_wait_ms", "max_queue_tokens", "max_sentence_tokens", "max_sentences")
        return {
            "model": self.model_name,
            "source": config.model,
            "ready": self.ready,
            "shape": {
                "layers": self.layers,
                "dim": model.get("dim"),
                "lstm": self.options.get("lstm", {}),
                "char_cnn": {k: v for k, v in self.options.get("char_cnn", {}).items() if k != "filters"},
            },
            **{key: model.get(key) for key in ("device", "precision", "precision_why", "kernels", "cpu")},
            "tokenizer": config.tokenizer,
            "workers": workers,
            "restarts": self.pool.restarts if self.pool else 0,
            "limits": {name: getattr(config, name) for name in (*limits, "max_body_bytes", "batching")},
        }


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _join(parts: list[bytes]) -> bytes:
    return b"[" + b",".join(parts) + b"]"


def _server(request: Request) -> Server:
    return request.app.state.server


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
    sentences = server.sentences(body.sentences, "sentences")
    layers = server.layers
    if body.mix_weights is not None and layers is not None and len(body.mix_weights) != layers:
        raise Unprocessable(
            f"mix_weights: {len(body.mix_weights)} values; the model has {layers} layers", param="mix_weights"
        )
    answer = await server.embed(request, sentences, body.output_spec())
    if answer is None:
        server.metrics.answered("/embed", 499, 0.0)
        return Response(status_code=499)
    items = [
        b'{"index":%d,"tokens":%s,"shape":%s,"embedding":%s}' % (i, _dumps(tokens), _dumps(list(shape)), vectors)
        for i, (tokens, shape, vectors) in enumerate(zip(sentences, answer.shapes, answer.embeddings))
    ]
    head = _dumps({"model": server.model_name, "output": body.output, "dtype": body.dtype})[:-1]
    usage = b'{"tokens":%d}' % sum(len(s) for s in sentences)
    server.metrics.answered("/embed", 200, time.monotonic() - started)
    return Response(head + b',"data":' + _join(items) + b',"usage":' + usage + b"}", media_type="application/json")


@guarded.post("/v1/embeddings", response_model=OpenAIEmbeddingResponse, responses=ERRORS)
async def openai_embeddings(body: OpenAIEmbeddingRequest, request: Request) -> Response:
    server, started = _server(request), time.monotonic()
    texts = [body.input] if isinstance(body.input, str) else body.input
    if not texts:
        raise Unprocessable("input: an empty list; nothing to embed", param="input")
    sentences = server.sentences(texts, "input")  # type: ignore[arg-type]
    dim = server.worker_info().get("dim")
    if body.dimensions is not None and dim is not None and body.dimensions != dim:
        raise Unprocessable(f"dimensions: this model's vectors have {dim}, not {body.dimensions}", param="dimensions")
    answer = await server.embed(request, sentences, Output("mean", encoding=body.encoding_format))
    if answer is None:
        server.metrics.answered("/v1/embeddings", 499, 0.0)
        return Response(status_code=499)
    items = [b'{"object":"embedding","index":%d,"embedding":%s}' % (i, v) for i, v in enumerate(answer.embeddings)]
    tokens = sum(len(s) for s in sentences)
    usage = b'{"prompt_tokens":%d,"total_tokens":%d}' % (tokens, tokens)
    model = _dumps(body.model or server.model_name)
    content = b'{"object":"list","data":' + _join(items) + b',"model":' + model + b',"usage":' + usage + b"}"
    server.metrics.answered("/v1/embeddings", 200, time.monotonic() - started)
    return Response(content, media_type="application/json")


@router.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/ready")
async def ready(request: Request) -> JSONResponse:
    server = _server(request)
    if server.ready:
        return JSONResponse({"ready": True, "workers_ready": server.pool.ready_count})  # type: ignore[union-attr]
    return JSONResponse({"ready": False, "state": server.state}, status_code=503)


@guarded.get("/info")
async def info(request: Request) -> dict[str, Any]:
    return _server(request).info()


@guarded.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(generate_latest(_server(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)


async def request_error(request: Request, error: RequestError) -> JSONResponse:
    if request.url.path in ENDPOINTS:
        _server(request).metrics.answered(request.url.path, error.status, 0.0)
    return _error_response(error)


async def bad_body(request: Request, error: RequestValidationError) -> JSONResponse:
    """A body that does not validate: 422, the fields named as dotted paths (``sentences.0``)."""
    problems = [(".".join(str(p) for p in e["loc"][1:]) or "body", e["msg"]) for e in error.errors()]
    message = "; ".join(f"{where}: {msg}" for where, msg in problems[:5])
    return await request_error(request, Unprocessable(message, param=problems[0][0] if problems else None))


def _dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def create_app(config: ServeConfig, model_dir: Callable[[], str], on_fatal: Callable[[str], None]) -> FastAPI:
    """The app: the routes above around one ``Server``, which starts the model processes with the app."""
    server = Server(config, model_dir, on_fatal)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await server.start()
        yield
        await server.stop()

    app = FastAPI(title="elmo serve", summary="ELMo vectors on request", lifespan=lifespan)
    app.state.server = server
    app.add_middleware(Gate, server=server)
    app.add_exception_handler(RequestError, request_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, bad_body)  # type: ignore[arg-type]
    app.include_router(router)
    app.include_router(guarded)
    return app
