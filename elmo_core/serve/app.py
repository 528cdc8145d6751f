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
import functools
import hmac
import logging
import signal
import threading
import time
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
    embed_body,
    openai_body,
)
from elmo_core.serve.batcher import Batcher, Limits
from elmo_core.serve.batcher import Request as Admitted
from elmo_core.serve.metrics import ENDPOINTS, ServerMetrics
from elmo_core.serve.middleware import ACCESS_SCOPE_KEY, AccessLog, Gate, error_response, start_access_log
from elmo_core.serve.versions import Versions
from elmo_core.serve.workers import WorkerPlan, WorkerPool
from elmo_core.text.tokenize import get_tokenizer

ERRORS = {
    status: {"description": why}
    for status, why in ((400, "token ids"), (413, "over a limit"), (422, "a bad body"), (429, "queue full"))
}
MODEL_HEADER, MODEL_ID_HEADER = "X-Elmo-Model", "X-Elmo-Model-Id"  # on every answer: the exact model that made it
log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=4)
def _options_of(model: Any) -> dict[str, Any]:
    return model.network()


class Server:
    """What the routes share: the options, the metrics, the queue, the model processes, the model's facts. The model
    reference is resolved once, here, to the exact model every process loads; only a reload (``versions``) resolves
    it again."""

    def __init__(
        self, config: ServeConfig, resolve_model: Callable[[], Any], on_fatal: Callable[[str], None], why: str
    ) -> None:
        self.config, self.resolve, self.on_fatal, self.precision_why = config, resolve_model, on_fatal, why
        self.metrics = ServerMetrics()
        self.tokenize = get_tokenizer(config.tokenizer)
        self.batcher: Batcher | None = None
        self.versions: Versions | None = None
        self.state = "starting"
        self.created = int(time.time())  # /v1/models' "created"
        self.draining = False  # SIGTERM came: /ready answers 503 while requests are still served

    @property
    def pool(self) -> WorkerPool | None:  # the pool that answers new requests
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
        self.batcher = Batcher(limits, self.metrics, self.on_fatal)
        call = asyncio.get_running_loop().call_soon_threadsafe

        def plan(model: Any) -> WorkerPlan:  # the batcher's token budget is the most a batch it sends holds
            placed = (config.device, config.precision, self.precision_why)
            return WorkerPlan(model, *placed, config.workers, config.max_batch_tokens)

        def make_pool(plan: WorkerPlan, generation: int, on_fatal: Callable[[str], None] | None) -> WorkerPool:
            return WorkerPool(plan, self.batcher, call, generation, on_fatal)  # type: ignore[arg-type]

        self.versions = Versions(config.model, self.resolve, plan, make_pool)
        threading.Thread(target=self._start_workers, args=(call,), daemon=True).start()

    def _start_workers(self, call: Callable[..., Any]) -> None:
        """Off the event loop: resolve the model once (a registered one lands in the download cache) and pin it with
        its content hash, then start the model processes, which all load exactly that."""
        try:
            self.state = "fetching the model"
            model = self.resolve().pinned()
            _options_of(model)  # read here, so a model without its options.json fails in this one line
        except Exception as exc:  # one line, and the server stops
            message = str(exc).splitlines()[0] if str(exc) else repr(exc)
            call(self.batcher.fatal, f"the model cannot be loaded: {message}")  # type: ignore[union-attr]
            return
        log.info("serving %s (id %s, %s)", model.name, model.digest, model.origin)
        self.state = "loading the model"
        call(self._first_pool, model)

    def _first_pool(self, model: Any) -> None:
        self.versions.start(model)  # type: ignore[union-attr]
        self.batcher.versions = self.versions  # type: ignore[union-attr]

    async def stop(self) -> None:
        for pool in self.versions.pools if self.versions is not None else []:
            await asyncio.to_thread(pool.stop)

    @property
    def options(self) -> dict[str, Any]:
        """The serving model's options.json, once a pool serves it."""
        return _options_of(self.pool.model) if self.pool is not None else {}

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
            "identity": serving.identity() if serving is not None else None,  # model_id: the hash it was pinned with
            "generation": self.pool.generation if self.pool is not None else 0,
            "reloading": self.versions.reloading if self.versions is not None else None,
            "last_reload": self.versions.last_reload if self.versions is not None else None,
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
    return {MODEL_HEADER: model.name, MODEL_ID_HEADER: model.identity()["model_id"]}


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
    result = await server.versions.reload()  # type: ignore[union-attr]
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
    return error_response(error)


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


async def _follow(server: Server, seconds: float) -> None:
    """``--follow-alias``: a reload every ``seconds`` (``Versions.reload``: nothing happens where the reference still
    names the served model); a store that is away is logged and asked again next time."""
    while True:
        await asyncio.sleep(seconds)
        await server.versions.reload()  # type: ignore[union-attr]


def create_app(
    config: ServeConfig, resolve_model: Callable[[], Any], on_fatal: Callable[[str], None], precision_why: str
) -> FastAPI:
    """The app: the routes above around one ``Server``, which starts the model processes with the app. ``config``'s
    device and precision are the runtime's decision (``run.place_model``), ``precision_why`` its reason."""
    server = Server(config, resolve_model, on_fatal, precision_why)
    if config.access_log:
        start_access_log()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await server.start()
        loop = asyncio.get_running_loop()
        try:  # SIGHUP reloads, as it does for nginx and HAProxy; not where signals cannot be set (a thread, Windows)
            loop.add_signal_handler(signal.SIGHUP, lambda: asyncio.ensure_future(server.versions.reload()))
        except (NotImplementedError, RuntimeError, ValueError, AttributeError):
            pass
        follow = asyncio.ensure_future(_follow(server, config.follow_alias)) if config.follow_alias else None
        yield
        if follow is not None:
            follow.cancel()
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
