"""The queue between requests and model processes: admission by tokens, packing into batches, and every request's
end (answered, failed, or dropped because its client left).

A request is admitted while the tokens accepted and not yet answered stay within ``max_queue_tokens`` (else
``QueueFull``: 429 with a Retry-After from the recent rate); one larger than that, into an empty queue. Its
sentences wait in arrival order. Whenever a model process is idle, the sentences at the head are packed into one
batch of at most ``max_batch_tokens`` tokens, across requests; a batch with room left waits up to
``max_wait_ms`` from its oldest sentence's arrival for more to join it. While every process is busy, arrivals
accumulate, so batches grow with the load by themselves. With batching off, a batch holds one request's sentences
(what serving one request per forward pass costs).

One model version answers a request: its sentences all go to the pool that took its first one (``Request.pool``),
so a reload (``versions.Versions``) that switches pools while a request is half done finishes it on its first pool.

Everything here runs in the event loop's thread; the pool's reader threads reach it through ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from elmo_core.serve.api import Answer, Batch, Output, QueueFull, RequestError, Unavailable
from elmo_core.serve.metrics import ServerMetrics
from elmo_core.serve.versions import Versions
from elmo_core.serve.workers import Worker, WorkerEvents, WorkerPool


@dataclass(frozen=True)
class Limits:
    max_batch_tokens: int
    max_wait_ms: float
    max_queue_tokens: int
    batching: bool = True
    batch_timeout: float = 60.0  # seconds a model process may hold one batch before it is killed and started again


@dataclass(eq=False)
class Request:
    """One admitted request: its sentences, the output it asked for, and the answers as they come."""

    sentences: list[list[str]]
    spec: Output
    future: asyncio.Future
    arrived: float = field(default_factory=time.monotonic)
    shapes: list[tuple[int, ...]] = field(default_factory=list)
    embeddings: list[bytes] = field(default_factory=list)
    remaining: int = 0
    unsent: int = 0  # sentences not yet handed to a model process
    over: bool = False  # answered, failed or dropped: its sentences still queued are skipped
    pool: WorkerPool | None = None  # the pool (one model version) that answers it, from its first batch on
    queue_seconds: float = 0.0  # arrival to its last sentence's batch leaving the queue (the access log's queue ms)
    compute_seconds: float = 0.0  # the model processes' time on the batches that held its sentences

    def __post_init__(self) -> None:
        n = len(self.sentences)
        self.shapes, self.embeddings, self.remaining, self.unsent = [()] * n, [b""] * n, n, n

    @property
    def tokens(self) -> int:
        return sum(len(s) for s in self.sentences)


@dataclass(eq=False)
class Pending:
    request: Request
    index: int  # which of its request's sentences

    @property
    def tokens(self) -> int:
        return len(self.request.sentences[self.index])


class Batcher(WorkerEvents):
    def __init__(self, limits: Limits, metrics: ServerMetrics, on_fatal: Callable[[str], None]) -> None:
        self.limits, self.metrics, self.on_fatal = limits, metrics, on_fatal
        self.versions: Versions | None = None  # the model versions' pools, once the model is resolved
        self.waiting: deque[Pending] = deque()
        self.waiting_tokens = 0
        self.queued_tokens = 0  # admitted and not yet over: waiting or computing
        self.inflight: dict[int, list[Pending]] = {}
        self._deadlines: dict[int, asyncio.TimerHandle] = {}  # per batch in flight: when its process is hung
        self.fatal_message: str | None = None
        self._ids = itertools.count(1)
        self._timer: asyncio.TimerHandle | None = None
        self._loop = asyncio.get_running_loop()

    @property
    def pool(self) -> WorkerPool | None:  # the pool new requests go to
        return self.versions.serving if self.versions is not None else None

    # --- requests -------------------------------------------------------------------------------------
    async def embed(self, sentences: list[list[str]], spec: Output) -> Request:
        """The request's answers, once every sentence has its own; raises ``RequestError`` (429, 503, 500)."""
        if self.fatal_message is not None:
            raise Unavailable(f"the server is stopping: {self.fatal_message}")
        request = Request(sentences, spec, self._loop.create_future())
        # a request larger than the whole queue (2,048 inputs from an OpenAI client) is admitted into an empty one:
        # its sentences then go through in batches like any others, and everything else waits for it (429)
        if self.queued_tokens + min(request.tokens, self.limits.max_queue_tokens) > self.limits.max_queue_tokens:
            raise self.refusal(request.tokens)
        self._admit(request)
        try:
            return await request.future
        finally:
            self._end(request)

    @property
    def full(self) -> bool:
        """No room for even one token: a request is refused before its body is read."""
        return self.queued_tokens >= self.limits.max_queue_tokens

    def refusal(self, tokens: int | None = None) -> QueueFull:
        more, rate = f"{tokens:,} more would pass" if tokens is not None else "it is at", self.metrics.rate()
        retry = {"Retry-After": str(max(1, math.ceil(self.queued_tokens / rate)) if rate > 0 else 1)}
        limit = f"--max-queue-tokens {self.limits.max_queue_tokens:,}"
        return QueueFull(f"the queue holds {self.queued_tokens:,} tokens; {more} {limit}; retry later", retry)

    def _admit(self, request: Request) -> None:
        self.waiting.extend(Pending(request, i) for i in range(len(request.sentences)))
        self.waiting_tokens += request.tokens
        self.queued_tokens += request.tokens
        self.metrics.queue_tokens.set(self.queued_tokens)
        self._dispatch()

    def _end(self, request: Request) -> None:
        """A request is over (answered, failed, or its client left): its tokens leave the queue; its sentences
        still waiting are skipped when reached, and answers still computing are dropped on arrival."""
        if request.over:
            return
        request.over = True
        self.queued_tokens -= request.tokens
        self.metrics.queue_tokens.set(self.queued_tokens)

    # --- batches --------------------------------------------------------------------------------------
    def _dispatch(self) -> None:
        """Hand batches to idle model processes while sentences wait."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        while self._drop_dropped_head():
            pool = self.waiting[0].request.pool or self.pool  # a request begun on a pool ends on it
            worker = pool.idle() if pool is not None else None
            if worker is None:
                return
            if self.limits.batching and self.waiting_tokens < self.limits.max_batch_tokens:
                due = self.waiting[0].request.arrived + self.limits.max_wait_ms / 1000
                delay = due - time.monotonic()
                if delay > 0:  # room left: wait for company, at most until the oldest has waited max_wait_ms
                    self._timer = self._loop.call_later(delay, self._dispatch)
                    return
            self._send(worker, self._take(pool))  # type: ignore[arg-type]

    def _drop_dropped_head(self) -> bool:
        """Skip the sentences of requests already over; True while any sentence waits."""
        while self.waiting and self.waiting[0].request.over:
            self.waiting_tokens -= self.waiting.popleft().tokens
        return bool(self.waiting)

    def _take(self, pool: WorkerPool) -> list[Pending]:
        """The head's sentences up to ``max_batch_tokens`` (at least one); with batching off, one request's; only
        those of requests that ``pool`` answers or that have not begun (which it then answers)."""
        taken: list[Pending] = []
        tokens = 0
        first = self.waiting[0].request
        while self.waiting:
            pending = self.waiting[0]
            if pending.request.over:
                self.waiting_tokens -= self.waiting.popleft().tokens
                continue
            if taken and (
                tokens + pending.tokens > self.limits.max_batch_tokens
                or (not self.limits.batching and pending.request is not first)
                or pending.request.pool not in (None, pool)
            ):
                break
            pending.request.pool = pool
            taken.append(self.waiting.popleft())
            tokens += pending.tokens
        self.waiting_tokens -= tokens
        return taken

    def _send(self, worker: Worker, pendings: list[Pending]) -> None:
        specs: dict[Output, int] = {}
        outputs = [specs.setdefault(p.request.spec, len(specs)) for p in pendings]
        batch = Batch(next(self._ids), [p.request.sentences[p.index] for p in pendings], outputs, list(specs))
        self.inflight[batch.id] = pendings
        self.metrics.inflight_tokens.inc(batch.tokens)
        now = time.monotonic()
        for pending in pendings:
            request = pending.request
            request.unsent -= 1
            if request.unsent == 0:  # its last sentence leaves the queue: the time it waited
                request.queue_seconds = now - request.arrived
                self.metrics.queue_seconds.observe(request.queue_seconds)
        worker.pool.send(worker, batch)  # type: ignore[union-attr]
        self._deadlines[batch.id] = self._loop.call_later(self.limits.batch_timeout, self._overdue, worker, batch.id)

    def _overdue(self, worker: Worker, batch_id: int) -> None:
        """A model process still on this batch after ``batch_timeout``: hung (or the batch cannot finish), so it is
        killed; its loss is reported as any death is, its requests answered 503, and it is started again."""
        computing = worker.batch is not None and worker.batch.id == batch_id
        if (computing or batch_id in worker.answering) and worker.pool is not None:
            worker.pool.kill(worker, f"was busy past --batch-timeout {self.limits.batch_timeout:g} s and was killed")

    def _finish_batch(self, batch_id: int) -> list[Pending]:
        """A batch is over: its deadline off, its tokens out of flight, and pools switched from stopped once
        nothing they began is left (``versions.Versions.retire``)."""
        if (deadline := self._deadlines.pop(batch_id, None)) is not None:
            deadline.cancel()
        pendings = self.inflight.pop(batch_id, [])
        self.metrics.inflight_tokens.dec(sum(p.tokens for p in pendings))
        self._retire()
        return pendings

    # --- what the model processes report (WorkerEvents) ----------------------------------------------------
    def worker_ready(self, worker: Worker) -> None:
        if self.versions is not None and self.versions.warm(worker):  # a reload's last process: switched
            self._retire()
        self.metrics.workers_ready.set(self.pool.ready_count if self.pool else 0)
        self._dispatch()

    def _retire(self) -> None:
        if self.versions is not None:
            self.versions.retire(lambda pool: any(p.request.pool is pool and not p.request.over for p in self.waiting))

    def batch_computed(self, worker: Worker) -> None:
        self._dispatch()  # the process is free: the next batch goes while this one's answers are encoded

    def batch_done(self, worker: Worker, answer: Answer) -> None:
        pendings = self._finish_batch(answer.id)
        requests = len({id(p.request) for p in pendings})
        self.metrics.batch(sum(p.tokens for p in pendings), requests, answer.seconds, answer.words, answer.new_words)
        for request in {id(p.request): p.request for p in pendings}.values():
            request.compute_seconds += answer.seconds
        for pending, shape, embedding in zip(pendings, answer.shapes, answer.embeddings):
            request = pending.request
            if request.over:
                continue
            request.shapes[pending.index], request.embeddings[pending.index] = shape, embedding
            request.remaining -= 1
            if request.remaining == 0 and not request.future.done():
                request.future.set_result(request)
        self._dispatch()

    def _fail(self, pendings: list[Pending], error: RequestError) -> None:
        for pending in pendings:
            if not pending.request.over and not pending.request.future.done():
                pending.request.future.set_exception(error)

    def batch_failed(self, worker: Worker, batch_id: int, message: str) -> None:
        self._fail(self._finish_batch(batch_id), RequestError(f"the model failed on this request's batch: {message}"))
        self._dispatch()

    def worker_lost(self, worker: Worker, batches: list[Batch], exitcode: int | None) -> None:
        self.metrics.workers_ready.set(self.pool.ready_count if self.pool else 0)
        if worker.pool is not None and not worker.pool.closing:
            self.metrics.worker_restarts.inc()
        why = worker.killed_why or f"died (exit code {exitcode})"
        error = f"the model process computing this request {why}; it is being started again: retry"
        for batch in batches:  # the one it computed, and those whose answers it had not sent yet
            self._fail(self._finish_batch(batch.id), Unavailable(error, {"Retry-After": "1"}))

    def fatal(self, message: str) -> None:
        """The model cannot run here: fail everything and stop the server with ``message``."""
        if self.fatal_message is None:
            self.fatal_message = message
            self._fail(list(self.waiting), Unavailable(message))
            for batch_id in list(self.inflight):
                self._fail(self._finish_batch(batch_id), Unavailable(message))
            self.on_fatal(message)
