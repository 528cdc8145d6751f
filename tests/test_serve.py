"""``elmo serve`` as clients meet it: a real server process on a free port, real HTTP, the fixture biLM.

Where a test needs a moment to hold still (requests waiting, a batch in flight), it stops the model process with
SIGSTOP and reads /metrics until the server shows that state, instead of sleeping and hoping."""

from __future__ import annotations

import base64
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
import pytest

from elmo_core import BiLM
from tests.helpers import ROOT, free_port, start_server, stop_group

MODEL = ROOT / "tests" / "fixtures" / "allennlp_elmo"
PROBES = [line for line in (ROOT / "data" / "probes" / "apple.txt").read_text(encoding="utf-8").splitlines() if line]
LIMITS = ["--max-queue-tokens", "1000", "--max-sentence-tokens", "40", "--max-sentences", "16"]


def _serve(tmp: Path, *args: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    model = [str(MODEL)] if not args or args[0].startswith("--") else []  # the fixture unless files are given
    quick = [] if "--drain-delay" in args else ["--drain-delay", "0"]  # the tests' SIGTERMs stop at once
    command = [sys.executable, "-m", "elmo_core.cli", "serve", *model, "--port", str(port), *quick, *args]
    server = start_server(command, f"http://127.0.0.1:{port}/health", tmp / "serve.log", env=env)
    return server, f"http://127.0.0.1:{port}"


def _until(condition: Callable[[], bool], what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _ready(base: str) -> None:
    _until(lambda: httpx.get(f"{base}/ready").status_code == 200, "/ready")


def metric(base: str, name: str, labels: str = "") -> float:
    text = httpx.get(f"{base}/metrics").text
    found = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
    assert found, f"{name}{labels} not in /metrics"
    return float(found.group(1))


def _worker_pids(base: str) -> list[int]:
    return [w["pid"] for w in httpx.get(f"{base}/info").json()["workers"] if w["pid"]]


@contextmanager
def stopped_workers(base: str) -> Iterator[list[int]]:
    """The model processes stopped (SIGSTOP) while the block runs: whatever is sent waits, in the queue or in flight."""
    pids = _worker_pids(base)
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield pids
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass


def decode(item: dict, dtype: str = "float32") -> np.ndarray:
    raw = base64.b64decode(item["embedding"])
    return np.frombuffer(raw, dtype="<f2" if dtype == "float16" else "<f4").reshape(item["shape"])


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    proc, base = _serve(tmp_path_factory.mktemp("serve"), *LIMITS, "--max-body-bytes", "20000")
    try:
        _ready(base)
        yield base
    finally:
        stop_group(proc)


@pytest.fixture(scope="module")
def bilm() -> BiLM:
    return BiLM.from_pretrained(str(MODEL))


def test_answers_equal_lone_calls_under_64_concurrent_clients(server: str, bilm: BiLM) -> None:
    """64 clients at once, each its own sentence (raw text or tokens, 1-33 tokens): every answer is the sentence's
    lone ``embed_sentences`` within 1e-6, though the requests shared forward passes (the batch sizes say so)."""
    sentences = [line.split()[: 1 + (i * 7) % 33] for i, line in enumerate(PROBES * 64)][:64]
    assert len(sentences) == 64
    batches_before = metric(server, "elmo_batch_requests_count")
    requests_before = metric(server, "elmo_batch_requests_sum")

    def ask(i: int) -> dict:
        item = " ".join(sentences[i]) if i % 2 else sentences[i]
        body = {"sentences": [item], "output": "layers", "encoding": "base64"}
        return httpx.post(f"{server}/embed", json=body, timeout=60).json()

    with ThreadPoolExecutor(64) as pool, stopped_workers(server):
        answers = pool.map(ask, range(64))
        _until(lambda: metric(server, "elmo_queue_tokens") == sum(map(len, sentences)), "all 64 requests queued")
    for sentence, answer in zip(sentences, answers):
        (item,) = answer["data"]
        assert item["tokens"] == sentence
        np.testing.assert_allclose(decode(item), bilm.embed_sentences([sentence])[0], atol=1e-6, rtol=0)
    batches = metric(server, "elmo_batch_requests_count") - batches_before
    assert metric(server, "elmo_batch_requests_sum") - requests_before == 64
    assert batches < 64 / 4, f"64 waiting requests went through {batches:.0f} forward passes: not batched"


def test_layers_mix_mean_and_both_encodings(server: str, bilm: BiLM) -> None:
    sentences = [["I", "ate", "an", "apple", "."], ["Apple", "shares", "rose", "."]]
    layers = bilm.embed_sentences(sentences)
    weights, gamma = [0.5, -1.0, 2.0], 0.7
    factors = gamma * np.exp(weights) / np.exp(weights).sum()
    expected = {
        "layers": layers,
        "mix": [(factors[:, None, None] * x).sum(0) for x in layers],
        "mean": [(factors[:, None, None] * x).sum(0).mean(0) for x in layers],
    }
    for output, wanted in expected.items():
        for encoding, dtype in (("float", "float32"), ("base64", "float32"), ("base64", "float16")):
            body = {"sentences": sentences, "output": output, "mix_weights": weights, "gamma": gamma}
            answer = httpx.post(f"{server}/embed", json={**body, "encoding": encoding, "dtype": dtype}).json()
            assert answer["output"] == output and answer["usage"] == {"tokens": 9, "truncated": 0}
            for item, want in zip(answer["data"], wanted):
                assert item["shape"] == list(want.shape)
                got = decode(item, dtype) if encoding == "base64" else np.array(item["embedding"])
                np.testing.assert_allclose(got, want, atol=1e-6 if dtype == "float32" else 2e-3, rtol=1e-3)
    plain = httpx.post(f"{server}/embed", json={"sentences": ["I ate an apple ."]}).json()["data"][0]
    np.testing.assert_allclose(np.array(plain["embedding"]), layers[0].mean(0), atol=1e-6)  # default: equal mix


def test_openai_embeddings_schema(server: str, bilm: BiLM) -> None:
    texts = ["I ate an apple .", "Apple shares rose ."]
    response = httpx.post(f"{server}/v1/embeddings", json={"input": texts, "model": "elmo"})
    answer = response.json()
    # the model that made the vectors, exactly, whatever name the client sent (OpenAI's answers name theirs too)
    assert answer["object"] == "list" and answer["model"] == "allennlp_elmo" == response.headers["x-elmo-model"]
    assert response.headers["x-elmo-model-id"] == httpx.get(f"{server}/info").json()["identity"]["model_id"]
    assert answer["usage"] == {"prompt_tokens": 9, "total_tokens": 9, "truncated": 0}
    means = [x.mean(0).mean(0) for x in bilm.embed_sentences([t.split() for t in texts])]
    want = [m / np.linalg.norm(m) for m in means]  # unit length by default, as OpenAI's vectors are
    for i, item in enumerate(answer["data"]):
        assert item["object"] == "embedding" and item["index"] == i
        np.testing.assert_allclose(item["embedding"], want[i], atol=1e-6)
    one = httpx.post(f"{server}/v1/embeddings", json={"input": texts[1], "encoding_format": "base64"}).json()
    vector = np.frombuffer(base64.b64decode(one["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(vector, want[1], atol=1e-6)
    wrong = httpx.post(f"{server}/v1/embeddings", json={"input": "a b", "dimensions": 7})
    assert wrong.status_code == 422 and wrong.json()["error"]["param"] == "dimensions"
    schema = httpx.get(f"{server}/openapi.json").json()
    assert {"/embed", "/v1/embeddings", "/health", "/ready", "/info", "/metrics"} <= set(schema["paths"])


def test_limits_413_and_bad_bodies_422(server: str) -> None:
    long = httpx.post(f"{server}/embed", json={"sentences": [["w"] * 41]})
    assert long.status_code == 413 and "--max-sentence-tokens 40" in long.json()["error"]["message"]
    many = httpx.post(f"{server}/embed", json={"sentences": ["a"] * 17})
    assert many.status_code == 413 and "--max-sentences 16" in many.json()["error"]["message"]
    body = httpx.post(f"{server}/embed", content=b'{"sentences": ["' + b"a " * 15_000 + b'"]}')
    assert body.status_code == 413 and "--max-body-bytes" in body.json()["error"]["message"]
    for bad, field in (
        ({"sentences": [["a"], 3]}, "sentences.1"),
        ({"sentences": ["a"], "output": "all"}, "output"),
        ({"sentences": ["a"], "colour": 1}, "colour"),
        ({"sentences": ["a", "  "]}, "sentences[1]"),
        ({"sentences": ["a"], "mix_weights": [1, 2]}, "mix_weights"),
    ):
        answer = httpx.post(f"{server}/embed", json=bad)
        assert answer.status_code == 422, bad
        assert answer.json()["error"]["param"].startswith(field) and field in answer.json()["error"]["message"]
    assert httpx.post(f"{server}/embed", content=b"{not json").status_code == 422


def test_full_queue_429_with_retry_after_then_served(server: str) -> None:
    first = ["w"] * 40
    with ThreadPoolExecutor(25) as pool, stopped_workers(server):
        waiting = [
            pool.submit(httpx.post, f"{server}/embed", json={"sentences": [first]}, timeout=60) for _ in range(25)
        ]
        _until(lambda: metric(server, "elmo_queue_tokens") == 1000, "the queue full")
        refused = httpx.post(f"{server}/embed", json={"sentences": [["one"]]})
        assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
        assert "--max-queue-tokens 1,000" in refused.json()["error"]["message"]
        assert metric(server, "elmo_requests_total", '{endpoint="/embed",status="429"}') >= 1
        # urllib sends its whole body (24 MB here) before it reads, and asks for the connection to close
        big = urllib.request.Request(f"{server}/embed", data=b"x" * (24 << 20), headers={"Connection": "close"})
        with pytest.raises(urllib.error.HTTPError) as by_urllib:
            urllib.request.urlopen(big, timeout=60)
        assert by_urllib.value.code == 429 and "--max-queue-tokens" in by_urllib.value.read().decode()
    assert [w.result().status_code for w in waiting] == [200] * 25
    assert httpx.post(f"{server}/embed", json={"sentences": [["one"]]}).status_code == 200


def test_a_client_that_leaves_has_its_work_dropped(server: str) -> None:
    """A request waiting behind a busy model process, whose client disconnects, leaves the queue and never runs."""
    body = b'{"sentences": [["left", "before", "its", "answer"]]}'
    left = metric(server, "elmo_requests_total", '{endpoint="/embed",status="499"}')
    served = metric(server, "elmo_tokens_total")
    with ThreadPoolExecutor(1) as pool, stopped_workers(server):
        busy = pool.submit(httpx.post, f"{server}/embed", json={"sentences": [["first"]]}, timeout=60)
        _until(lambda: metric(server, "elmo_inflight_tokens") == 1, "the first request in flight")
        request = b"POST /embed HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
        client = socket.create_connection(server.removeprefix("http://").split(":"), timeout=10)
        client.sendall(request % len(body) + body)
        _until(lambda: metric(server, "elmo_queue_tokens") == 5, "the second request queued")
        client.close()
        _until(lambda: metric(server, "elmo_queue_tokens") == 1, "the second request dropped")
    assert busy.result().status_code == 200
    assert metric(server, "elmo_requests_total", '{endpoint="/embed",status="499"}') == left + 1
    assert metric(server, "elmo_tokens_total") == served + 1  # the first request's token; the left one never ran


def test_metrics_count_what_was_served(server: str) -> None:
    ok = metric(server, "elmo_requests_total", '{endpoint="/v1/embeddings",status="200"}')
    tokens = metric(server, "elmo_tokens_total")
    for _ in range(3):
        httpx.post(f"{server}/v1/embeddings", json={"input": ["a b c", "d e"]})
    assert metric(server, "elmo_requests_total", '{endpoint="/v1/embeddings",status="200"}') == ok + 3
    assert metric(server, "elmo_tokens_total") == tokens + 15
    assert metric(server, "elmo_workers_ready") == 1
    info = httpx.get(f"{server}/info").json()
    assert info["precision"] == "fp32" and info["shape"]["dim"] == 32 and info["limits"]["max_sentences"] == 16


def test_a_worker_that_dies_is_restarted_and_its_requests_get_503(server: str) -> None:
    with ThreadPoolExecutor(1) as pool, stopped_workers(server) as (pid,):
        lost = pool.submit(httpx.post, f"{server}/embed", json={"sentences": [["in", "flight"]]}, timeout=60)
        _until(lambda: metric(server, "elmo_inflight_tokens") == 2, "the batch in flight")
        os.kill(pid, signal.SIGKILL)
        answer = lost.result()
    assert answer.status_code == 503 and "died" in answer.json()["error"]["message"]
    _ready(server)
    assert _worker_pids(server) != [pid]
    assert metric(server, "elmo_worker_restarts_total") == 1
    assert httpx.post(f"{server}/embed", json={"sentences": [["again"]]}).status_code == 200


@pytest.mark.slow
def test_ready_after_warm_up_api_key_and_sigterm_drains(tmp_path: Path) -> None:
    """/health at once and /ready only once warm; the API key; SIGTERM answers what is in flight, then exits."""
    proc, base = _serve(tmp_path, env={**os.environ, "ELMO_API_KEY": "s3cret"})
    try:
        import psutil

        children = psutil.Process(proc.pid).children()
        for child in children:
            child.suspend()
        assert httpx.get(f"{base}/health").status_code == 200
        assert httpx.get(f"{base}/ready").status_code == 503  # the model process cannot be warm: it is stopped
        for child in children:
            child.resume()
        _ready(base)
        key = {"Authorization": "Bearer s3cret"}
        assert httpx.post(f"{base}/embed", json={"sentences": ["a"]}).status_code == 401
        assert (
            httpx.post(
                f"{base}/embed", json={"sentences": ["a"]}, headers={"Authorization": "Bearer s3cre"}
            ).status_code
            == 401
        )
        assert httpx.get(f"{base}/metrics").status_code == 401
        assert httpx.post(f"{base}/embed", json={"sentences": ["a"]}, headers=key).status_code == 200

        pids = [w["pid"] for w in httpx.get(f"{base}/info", headers=key).json()["workers"]]
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        with ThreadPoolExecutor(3) as pool:
            body = {"sentences": [["drained", "on", "exit"]]}
            inflight = [pool.submit(httpx.post, f"{base}/embed", json=body, headers=key, timeout=60) for _ in range(3)]
            _until(lambda: "elmo_queue_tokens 9.0" in httpx.get(f"{base}/metrics", headers=key).text, "3 queued")
            proc.send_signal(signal.SIGTERM)

            def refused() -> bool:
                try:
                    socket.create_connection(("127.0.0.1", int(base.rsplit(":", 1)[1])), timeout=1).close()
                    return False
                except OSError:
                    return True

            _until(refused, "the port closed to new requests", timeout=10)
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
            assert [r.result().status_code for r in inflight] == [200] * 3
        assert proc.wait(timeout=15) == 0
        assert "stopped" in (tmp_path / "serve.log").read_text()
        assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie" for pid in pids)
    finally:
        stop_group(proc)


@pytest.mark.slow
def test_an_idle_connection_outlives_a_few_seconds(server: str) -> None:
    """A client's keep-alive connection, idle longer than uvicorn's default 5 s, still takes the next request: a
    server that closes first races a client reusing the connection, and that POST is lost."""
    request = b"POST /embed HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
    body = b'{"sentences": [["kept", "alive"]]}'
    with socket.create_connection(server.removeprefix("http://").split(":"), timeout=30) as client:
        reader = client.makefile("rb")
        for attempt in range(2):
            if attempt:
                time.sleep(6)  # the idleness under test, not a wait for something to happen
            client.sendall(request % (len(body), body))
            status = reader.readline()
            assert status.startswith(b"HTTP/1.1 200"), status  # b"": the server had closed the connection
            headers = dict(line.rstrip(b"\r\n").split(b": ", 1) for line in iter(reader.readline, b"\r\n"))
            assert reader.read(int(headers[b"content-length"])).startswith(b'{"model"')


def test_the_http_process_never_loads_torch() -> None:
    """What the HTTP process imports (the CLI, the start-up, the app, the queue, the pool) leaves torch to the model
    processes: the server process holds no model's worth of libraries and binds its port before anything heavy."""
    code = "import sys, elmo_core.cli, elmo_core.serve.run, elmo_core.serve.app\nprint('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_bad_model_is_one_line_before_the_port_is_taken(tmp_path: Path) -> None:
    from tests.helpers import run_elmo

    result = run_elmo("serve", str(MODEL / "options.json"), "--weight-file", str(tmp_path / "w.hdf5"))
    assert result.returncode == 2 and result.stderr.strip().endswith("no such weight file (--weight-file)")
    result = run_elmo("serve", str(tmp_path / "nowhere"), "--port", str(free_port()))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"elmo serve: error: {tmp_path / 'nowhere'}: no such model directory or options file"
    ]


@pytest.mark.slow
def test_a_refused_precision_is_one_line_before_the_port_is_taken() -> None:
    """bf16 on a CPU that would emulate it (any CPU under ``ELMO_CPU_ISA=avx2``) is the runtime's refusal, decided
    before the port is bound, not a model process's after it."""
    from tests.helpers import run_elmo

    env = {**os.environ, "ELMO_CPU_ISA": "avx2"}
    result = run_elmo("serve", str(MODEL), "--precision", "bf16", "--port", str(free_port()), env=env)
    assert result.returncode == 2 and "listening" not in result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("elmo serve: error: precision bf16: this CPU has no bfloat16"), lines


@pytest.mark.slow
def test_registered_model_served_and_its_pyfunc_signature(tmp_path: Path, bilm: BiLM) -> None:
    """A model registered in MLflow: `elmo serve models:/NAME/1` gives the fixture's vectors, and the pyfunc model
    that `mlflow models serve` runs has a signature with ``pooled``, whose answer is the served ``mean``."""
    import mlflow
    import pandas as pd

    from elmo_core.tracking import MLflowTracker

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = MLflowTracker(experiment="serve-test", tracking_uri=uri)
    model_uri = tracker.log_model_dir(MODEL, "served")
    tracker.close()
    assert model_uri == "models:/served/1"

    mlflow.set_tracking_uri(uri)
    pyfunc = mlflow.pyfunc.load_model(model_uri)
    signature = pyfunc.metadata.signature
    assert signature.inputs.input_names() == ["sentence"]
    assert [(p.name, p.default) for p in signature.params.params] == [("pooled", False)]
    frame = pd.DataFrame({"sentence": ["I ate an apple .", "Apple shares rose ."]})
    want = [x.mean(0) for x in bilm.embed_sentences([s.split() for s in frame["sentence"]])]
    pooled = pyfunc.predict(frame, params={"pooled": True})
    np.testing.assert_allclose(np.array(pooled), [w.mean(0) for w in want], atol=1e-6)
    tokens = pyfunc.predict(frame)
    np.testing.assert_allclose(np.array(tokens[0]), want[0], atol=1e-6)

    port = free_port()
    command = [sys.executable, "-m", "elmo_core.cli", "serve", "models:/served/1", "--port", str(port)]
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri}
    proc = start_server(command, f"http://127.0.0.1:{port}/health", tmp_path / "serve.log", env=env)
    try:
        base = f"http://127.0.0.1:{port}"
        _ready(base)
        answer = httpx.post(f"{base}/embed", json={"sentences": list(frame["sentence"]), "output": "mean"}).json()
        np.testing.assert_allclose(np.array([d["embedding"] for d in answer["data"]]), pooled, atol=1e-6)
    finally:
        stop_group(proc)


@pytest.mark.slow
def test_published_files_served_by_two_model_processes_sharing_the_cores(tmp_path: Path, bilm: BiLM) -> None:
    """The AllenNLP files given as they are published (options.json, then --weight-file), two model processes each
    with its share of the cores; both answer, and the same numbers."""
    import psutil

    proc, base = _serve(
        tmp_path, str(MODEL / "options.json"), "--weight-file", str(MODEL / "lm_weights.hdf5"), "--workers", "2"
    )
    try:
        _until(lambda: httpx.get(f"{base}/ready").json().get("workers_ready") == 2, "two warm model processes")
        workers = httpx.get(f"{base}/info").json()["workers"]
        share = max(1, len(os.sched_getaffinity(0)) // 2)
        assert [w["threads"] for w in workers] == [share, share] and len({w["pid"] for w in workers}) == 2
        sentence = ["I", "ate", "an", "apple", "."]
        with ThreadPoolExecutor(8) as pool:
            answers = list(
                pool.map(lambda _: httpx.post(f"{base}/embed", json={"sentences": [sentence]}).json(), range(16))
            )
        want = bilm.embed_sentences([sentence])[0].mean(0)
        for answer in answers:
            np.testing.assert_allclose(np.array(answer["data"][0]["embedding"]), want, atol=1e-6)
        assert all(psutil.Process(w["pid"]).nice() == 5 for w in workers)  # under the HTTP process
    finally:
        stop_group(proc)
