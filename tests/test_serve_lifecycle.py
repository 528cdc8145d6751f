"""``elmo serve`` as an orchestrator and an operator meet it: SIGTERM's drain delay, a hung model process killed and
started again, /health, /metrics without the key, request ids and the access log. Real server processes on free
ports; a hang is a model process stopped with SIGSTOP, as a deadlocked one looks from outside."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.helpers import stop_group
from tests.test_serve import _ready, _serve, _until, _worker_pids, metric


def _access_lines(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines() if line.startswith('{"time"')]


@pytest.mark.slow
def test_metrics_open_request_ids_and_the_access_log(tmp_path: Path) -> None:
    """With an API key and --metrics-open, a scraper reads /metrics without the key (the rest still wants it); a
    request's X-Request-ID comes back on its answer (a new one where it sent none), and its access-log line says
    its id, status, sentences, tokens and times; elmo_queue_seconds counts the requests that waited."""
    proc, base = _serve(tmp_path, "--metrics-open", env={**os.environ, "ELMO_API_KEY": "k3y"})
    key = {"Authorization": "Bearer k3y"}
    try:
        _ready(base)
        assert httpx.get(f"{base}/info").status_code == 401
        assert metric(base, "elmo_queue_seconds_count") == 0
        given = httpx.post(
            f"{base}/embed", json={"sentences": ["An apple, please."]}, headers={**key, "X-Request-ID": "req-42"}
        )
        assert given.status_code == 200 and given.headers["x-request-id"] == "req-42"
        made = httpx.post(f"{base}/v1/embeddings", json={"input": ["a b", "c"]}, headers=key)
        assert made.status_code == 200 and len(made.headers["x-request-id"]) == 32
        refused = httpx.post(f"{base}/embed", json={"sentences": ["a"]}, headers={"X-Request-ID": "no-key"})
        assert refused.status_code == 401 and refused.headers["x-request-id"] == "no-key"
        assert metric(base, "elmo_queue_seconds_count") == 2
        _until(lambda: len(_access_lines(tmp_path / "serve.log")) >= 3, "three access-log lines")
        lines = {line["request_id"]: line for line in _access_lines(tmp_path / "serve.log")}
        first = lines["req-42"]
        assert (first["method"], first["path"], first["status"], first["sentences"], first["tokens"]) == (
            "POST",
            "/embed",
            200,
            1,
            5,
        )
        assert first["queue_ms"] >= 0 and first["compute_ms"] > 0 and first["ms"] >= first["compute_ms"]
        second = lines[made.headers["x-request-id"]]
        assert (second["path"], second["sentences"], second["tokens"]) == ("/v1/embeddings", 2, 3)
        assert lines["no-key"]["status"] == 401 and "tokens" not in lines["no-key"]
    finally:
        stop_group(proc)


@pytest.mark.timing
@pytest.mark.slow
def test_sigterm_turns_ready_503_serves_through_the_drain_delay_then_exits(tmp_path: Path) -> None:
    """SIGTERM: /ready answers 503 at once (the load balancer stops routing here), requests are still served for
    --drain-delay seconds (those it routed meanwhile), then the port closes, what is in flight is answered, exit 0."""
    proc, base = _serve(tmp_path, "--drain-delay", "3")
    port = int(base.rsplit(":", 1)[1])

    def closed() -> bool:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return False
        except OSError:
            return True

    try:
        _ready(base)
        pids = _worker_pids(base)
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        _until(lambda: httpx.get(f"{base}/ready").status_code == 503, "/ready 503", timeout=1)
        assert httpx.get(f"{base}/ready").json()["state"] == "stopping"
        assert httpx.get(f"{base}/health").status_code == 200
        served = httpx.post(f"{base}/embed", json={"sentences": ["still served"]})
        assert served.status_code == 200 and served.headers["connection"] == "close"  # the next one elsewhere
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        with ThreadPoolExecutor(1) as pool:
            inflight = pool.submit(httpx.post, f"{base}/embed", json={"sentences": ["in flight"]}, timeout=60)
            _until(lambda: metric(base, "elmo_queue_tokens") == 2, "a request in flight")
            assert time.monotonic() - signalled < 3 and not closed()
            _until(closed, "the port closed after the delay", timeout=10)
            assert time.monotonic() - signalled >= 3
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
            assert inflight.result().status_code == 200
        assert proc.wait(timeout=15) == 0
    finally:
        stop_group(proc)


@pytest.mark.slow
def test_a_hung_model_process_is_killed_restarted_and_health_fails_meanwhile(tmp_path: Path) -> None:
    """A model process busy past --batch-timeout (stopped: a hang) is killed; its request gets 503 with
    Retry-After, and a new process answers. Hung again before answering anything, its restart waits a second, and
    /health answers 503 then: no model process can answer."""
    proc, base = _serve(tmp_path, "--batch-timeout", "1.5")
    try:
        _ready(base)
        (pid,) = _worker_pids(base)
        os.kill(pid, signal.SIGSTOP)
        hung = httpx.post(f"{base}/embed", json={"sentences": ["a hang"]}, timeout=30)
        assert hung.status_code == 503 and hung.headers["retry-after"] == "1"
        assert "busy past --batch-timeout 1.5 s" in hung.json()["error"]["message"]
        _ready(base)
        (again,) = _worker_pids(base)
        assert again != pid and metric(base, "elmo_worker_restarts_total") == 1
        os.kill(again, signal.SIGSTOP)
        with ThreadPoolExecutor(1) as pool:
            second = pool.submit(httpx.post, f"{base}/embed", json={"sentences": ["again"]}, timeout=30)
            _until(lambda: httpx.get(f"{base}/health").status_code == 503, "/health 503", timeout=10)
            assert "no model process can answer" in httpx.get(f"{base}/health").json()["why"]
            assert second.result().status_code == 503
        _ready(base)
        assert httpx.get(f"{base}/health").status_code == 200
        assert httpx.post(f"{base}/embed", json={"sentences": ["served"]}).status_code == 200
    finally:
        stop_group(proc)
