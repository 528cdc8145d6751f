"""The server's Prometheus metrics (prometheus-client, in a registry of the server's own). Every series exists from
start-up, labelled ones included, so a dashboard or an alert sees zeros before the first request, not nothing."""

from __future__ import annotations

import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

ENDPOINTS = ("/embed", "/v1/embeddings")
STATUSES = ("200", "400", "401", "413", "422", "429", "499", "500", "503")  # 499: the client left before its answer
TOKEN_BUCKETS = (16, 64, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
RATE_WINDOW_S = 10.0


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "elmo_requests", "requests answered, by endpoint and status", ["endpoint", "status"], registry=r
        )
        self.latency = Histogram(
            "elmo_request_seconds",
            "time from a request's arrival to its answer",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_tokens = Gauge(
            "elmo_queue_tokens", "tokens accepted and not yet answered (waiting or computing)", registry=r
        )
        self.inflight_tokens = Gauge(
            "elmo_inflight_tokens", "tokens in batches a model process is computing", registry=r
        )
        self.batch_tokens = Histogram("elmo_batch_tokens", "tokens per forward pass", buckets=TOKEN_BUCKETS, registry=r)
        self.batch_requests = Histogram(
            "elmo_batch_requests",
            "requests sharing a forward pass",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
            registry=r,
        )
        self.queue_seconds = Histogram(
            "elmo_queue_seconds",
            "time a request waited in the queue: from its arrival to its last sentence's batch being sent",
            buckets=(0.001, 0.0025, *LATENCY_BUCKETS),
            registry=r,
        )
        self.tokens = Counter("elmo_tokens", "tokens embedded", registry=r)
        self.batch_seconds = Histogram(
            "elmo_batch_seconds", "a model process's time on one batch", buckets=LATENCY_BUCKETS, registry=r
        )
        self.words = Counter("elmo_words", "distinct words of batches", registry=r)
        self.new_words = Counter(
            "elmo_new_words", "of those, words not kept from earlier batches (char CNN run)", registry=r
        )
        self.tokens_per_second = Gauge(
            "elmo_tokens_per_second", f"tokens embedded per second over the last {RATE_WINDOW_S:.0f} s", registry=r
        )
        self.workers_ready = Gauge("elmo_workers_ready", "model processes warm and serving", registry=r)
        self.worker_restarts = Counter("elmo_worker_restarts", "model processes started again after dying", registry=r)
        for endpoint in ENDPOINTS:
            self.latency.labels(endpoint)
            for status in STATUSES:
                self.requests.labels(endpoint, status)
        self._recent: deque[tuple[float, int]] = deque()
        self._rate = 0.0

    def answered(self, endpoint: str, status: int, seconds: float) -> None:
        self.requests.labels(endpoint, str(status)).inc()
        if status == 200:
            self.latency.labels(endpoint).observe(seconds)

    def batch(self, tokens: int, requests: int, seconds: float = 0.0, words: int = 0, new_words: int = 0) -> None:
        self.batch_seconds.observe(seconds)
        self.words.inc(words)
        self.new_words.inc(new_words)
        self.batch_tokens.observe(tokens)
        self.batch_requests.observe(requests)
        self.tokens.inc(tokens)
        now = time.monotonic()
        self._recent.append((now, tokens))
        while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
            self._recent.popleft()
        self._rate = sum(t for _, t in self._recent) / RATE_WINDOW_S
        self.tokens_per_second.set(self._rate)

    def rate(self) -> float:
        """Recent tokens per second (0 before any): what Retry-After is estimated from."""
        return self._rate
