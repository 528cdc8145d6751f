"""What ``deploy/`` ships, checked: the Kubernetes manifests against Kubernetes' own JSON schemas (the
``kubernetes-validate`` package, which carries them: offline) and against the ``elmo serve`` they start; the
Dockerfile against the repository; and the HAProxy configuration run as shipped in front of two real replicas,
through a rolling restart and a ``kill -9`` under load, losing no request (``bench/replicas.py`` runs the parts)."""

from __future__ import annotations

import base64
import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml

from bench.replicas import HAPROXY_CFG, Balancer, Load, Replica, core_shares, haproxy_config, roll_and_kill
from elmo_core import BiLM
from elmo_core.cli import build_parser, parse_config
from elmo_core.options import ServeConfig
from elmo_core.serve.metrics import ServerMetrics
from tests.helpers import ROOT

DEPLOY = ROOT / "deploy"
MODEL = ROOT / "tests" / "fixtures" / "allennlp_elmo"
PROBES = [line for line in (ROOT / "data" / "probes" / "apple.txt").read_text(encoding="utf-8").splitlines() if line]
HAPROXY = shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin")  # sbin: off a user's PATH
needs_haproxy = pytest.mark.skipif(
    HAPROXY is None, reason="haproxy not found (Debian: apt-get install haproxy, as .ci/run does)"
)


def _manifests() -> dict[str, dict]:
    """Every document of deploy/k8s/*.yaml, by kind."""
    documents = [d for path in sorted((DEPLOY / "k8s").glob("*.yaml")) for d in yaml.safe_load_all(path.read_text())]
    kinds = {d["kind"]: d for d in documents}
    assert len(kinds) == len(documents), "one object of each kind"
    return kinds


def _serve_config(argv: list[str]) -> ServeConfig:
    """``elmo serve ARGV`` as the CLI reads it: an unknown flag or a bad value fails here as it would in the pod."""
    args = build_parser().parse_args(["serve", *argv])
    return parse_config(ServeConfig, args)


def test_manifests_validate_against_kubernetes_schemas() -> None:
    """Strict validation (no field the schema lacks) for the oldest Kubernetes still commonly run and the newest
    the package knows."""
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    from kubernetes_validate.utils import latest_version

    manifests = _manifests()
    assert set(manifests) == {"Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget"}
    for version in ("1.29.0", latest_version()):
        for manifest in manifests.values():
            kubernetes_validate.validate(manifest, version, strict=True)


def test_a_manifest_with_a_misspelt_field_is_refused() -> None:
    """The schema check is not vacuous: a probe's misspelt field fails it."""
    kubernetes_validate = pytest.importorskip("kubernetes_validate")

    deployment = _manifests()["Deployment"]
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["periodSecond"] = 2
    with pytest.raises(kubernetes_validate.ValidationError, match="periodSecond"):
        kubernetes_validate.validate(deployment, "1.29.0", strict=True)


def test_deployment_runs_the_server_its_probes_and_autoscaler_expect() -> None:
    """The container's arguments are ones ``elmo serve`` takes; the probes, the Service and the metric name what it
    serves; SIGKILL after the grace period cannot cut preStop and the drain short."""
    manifests = _manifests()
    deployment, service, hpa = manifests["Deployment"], manifests["Service"], manifests["HorizontalPodAutoscaler"]
    pod = deployment["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    config = _serve_config(container["args"])
    (port,) = container["ports"]
    assert (config.host, config.port) == ("0.0.0.0", port["containerPort"])
    assert config.metrics_open, "the autoscaler's metric is scraped without the API key"
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": port["name"]}
    assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": port["name"]}
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(config.port)

    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep" and int(pre_stop[1]) >= 3
    drain = int(pre_stop[1]) + config.drain_delay + config.drain_seconds
    assert pod["spec"]["terminationGracePeriodSeconds"] > drain

    resources = container["resources"]
    assert resources["requests"] == resources["limits"], "Guaranteed QoS: the cores are the pod's"
    assert float(resources["limits"]["cpu"]).is_integer(), "whole cores, which the static CPU manager pins"

    labels = pod["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert service["spec"]["selector"].items() <= labels.items()
    assert service["spec"]["ports"][0]["targetPort"] == port["name"]
    assert manifests["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"].items() <= labels.items()

    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    (metric,) = hpa["spec"]["metrics"]
    served = {m.name for m in ServerMetrics().registry.collect()}
    assert metric["pods"]["metric"]["name"] == "elmo_queue_tokens" and "elmo_queue_tokens" in served
    assert int(metric["pods"]["target"]["averageValue"]) < config.max_queue_tokens, "scales before clients get 429"


def _instructions(dockerfile: Path) -> list[str]:
    """A Dockerfile's instructions, continuation lines joined, after checking that every file it COPYs (but the
    model, a build argument) is in the project."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    instructions = [line for line in text.splitlines() if line and not line.startswith("#")]
    for line in instructions:
        if line.startswith("COPY ") and "${MODEL}" not in line:
            for source in line.split()[1:-1]:
                assert (ROOT / source).exists(), f"{dockerfile.name} copies {source}, which the project does not have"
    return instructions


def test_dockerfile_copies_what_exists_and_runs_the_deployments_command() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    instructions = _instructions(DEPLOY / "Dockerfile")
    setup_torch = re.search(r"ELMO_TORCH_VERSION:-([\d.]+)", (ROOT / "scripts" / "setup.sh").read_text()).group(1)
    assert f"torch=={setup_torch} " in text, "the image's torch is the one scripts/setup.sh installs"
    assert re.search(r"^ARG MODEL=data/export$", text, re.M), "the main job's export folder"

    entrypoint = next(line for line in instructions if line.startswith("ENTRYPOINT"))
    command = next(line for line in instructions if line.startswith("CMD"))
    assert yaml.safe_load(entrypoint.split(None, 1)[1]) == ["elmo", "serve"]
    config = _serve_config(yaml.safe_load(command.split(None, 1)[1]))
    (container,) = _manifests()["Deployment"]["spec"]["template"]["spec"]["containers"]
    assert config.model == container["args"][0] == "/models/elmo"
    assert f"EXPOSE {config.port}" in text


@needs_haproxy
def test_shipped_haproxy_configuration_is_valid(tmp_path: Path) -> None:
    """``haproxy -c``: the file as shipped, and with the loopback servers the next test puts in."""
    check = subprocess.run([HAPROXY, "-c", "-f", str(HAPROXY_CFG)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    (tmp_path / "two.cfg").write_text(haproxy_config([("elmo1", "127.0.0.1:9001"), ("elmo2", "127.0.0.1:9002")]))
    check = subprocess.run([HAPROXY, "-c", "-f", str(tmp_path / "two.cfg")], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr


@pytest.mark.slow
@needs_haproxy
def test_replicas_behind_haproxy_lose_no_request_through_a_rolling_restart_and_a_kill(tmp_path: Path) -> None:
    """Two ``elmo serve`` replicas (the fixture model, a core each) behind ``deploy/haproxy.cfg``, eight
    closed-loop clients that retry 429 and 503 as OpenAI's client does (at most twice). Under that load each replica
    in turn gets SIGTERM, exits 0 and is started again; then one is killed with ``kill -9`` while a request waits
    in it, and started again. Every request is answered 200, with its sentence's lone ``embed_sentences`` vectors
    within 1e-6, and answers keep coming between every two of those events."""
    sentences = [line.split() for line in PROBES]
    expected = BiLM.from_pretrained(str(MODEL)).embed_sentences(sentences)
    bodies = [{"sentences": [s], "output": "layers", "encoding": "base64"} for s in sentences]
    # --drain-delay 3: above the checks' 1 s x 2 (deploy/haproxy.cfg), below the default 5 to keep the test short
    replicas = [
        Replica(f"elmo{i}", MODEL, tmp_path / f"elmo{i}.log", ["--drain-delay", "3"], cores=cores)
        for i, cores in enumerate(core_shares(2), 1)
    ]
    balancer = Balancer(replicas, tmp_path)
    try:
        for replica in replicas:
            replica.start()
        for replica in replicas:
            replica.wait_ready()
        balancer.start()
        for replica in replicas:
            balancer.wait_state(replica.name, "UP")
        load = Load(f"{balancer.url}/embed", bodies, clients=8).start()
        try:
            load.wait_answers(50)
            exits = roll_and_kill(replicas, balancer, load, say=lambda line: None)
            load.wait_answers(50)  # and answers go on after the last restart
        finally:
            outcomes = load.stop()
        stats = balancer.stats()
        served_since_start = [_answered(replica.url) for replica in replicas]
    finally:
        balancer.close()
        for replica in replicas:
            replica.close()

    assert exits == [0, 0], "SIGTERM drains and exits 0"
    lost = [o for o in outcomes if o.status != 200]
    described = ", ".join(f"#{o.index}: {o.status} after {o.attempts} tries" for o in lost[:10])
    assert not lost, f"{len(lost)} of {len(outcomes)} requests lost ({described}); see {tmp_path}"
    for outcome in outcomes:
        (item,) = outcome.answer["data"]
        want = expected[outcome.index % len(sentences)]
        assert item["tokens"] == sentences[outcome.index % len(sentences)]
        got = np.frombuffer(base64.b64decode(item["embedding"]), "<f4").reshape(item["shape"])
        np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
    ends = sorted(o.ended for o in outcomes)
    for (start, what), (end, then) in zip(load.marks, load.marks[1:]):
        if not then.startswith(("SIGTERM", "kill")):  # those follow the last event at once, by design
            assert any(start <= t < end for t in ends), f"no answer between {what!r} and {then!r}"
    assert all(n > 0 for n in served_since_start), f"answers per replica since its last start: {served_since_start}"
    rescued = int(stats["BACKEND"]["wretr"] or 0) + int(stats["BACKEND"]["wredis"] or 0)
    assert rescued > 0, "the kill met no request, so nothing here tested the balancer's retries"
    events = ", ".join(f"{t - load.marks[0][0]:.1f} s {what}" for t, what in load.marks)
    print(f"{len(outcomes)} requests, none lost; haproxy retried {rescued}; {events}")


def _answered(base: str) -> float:
    """/embed requests this replica answered 200 since it started (its own metrics)."""
    text = httpx.get(f"{base}/metrics", timeout=5).text
    found = re.search(r'^elmo_requests_total\{endpoint="/embed",status="200"\} (\S+)$', text, re.M)
    assert found, 'elmo_requests_total{endpoint="/embed",status="200"} not in /metrics'
    return float(found.group(1))


@pytest.mark.slow
def test_the_onnx_image_serves_from_its_own_packages_alone(tmp_path: Path) -> None:
    """deploy/Dockerfile.onnx's pip installs as written, into an empty venv: no torch (nor Arrow, MLflow, Prefect,
    DuckDB) in it, and `elmo serve FILE.onnx` from it answers as the project's model does."""
    import shlex
    import sys

    instructions = _instructions(DEPLOY / "Dockerfile.onnx")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    for line in instructions:
        if line.startswith("RUN pip install "):
            args = shlex.split(line.removeprefix("RUN pip install "))
            done = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", *args], cwd=ROOT, capture_output=True)
            assert done.returncode == 0, done.stderr[-2000:]
    (site,) = (venv / "lib").glob("python3*/site-packages")
    installed = {p.name.split("-")[0].lower() for p in site.glob("*.dist-info")}
    assert not installed & {"torch", "pyarrow", "mlflow", "prefect", "duckdb", "h5py"}, installed
    exported = subprocess.run(
        [sys.executable, "-m", "elmo_core.cli", "onnx", str(MODEL), "--out", str(tmp_path / "elmo.onnx")], cwd=ROOT
    )
    assert exported.returncode == 0
    from tests.helpers import free_port, start_server, stop_group

    port = free_port()
    command = [str(venv / "bin" / "elmo"), "serve", str(tmp_path / "elmo.onnx"), "--port", str(port)]
    server = start_server(command, f"http://127.0.0.1:{port}/health", tmp_path / "serve.log")
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            if httpx.get(f"{url}/ready").status_code == 200:
                break
            time.sleep(0.1)
        body = {"sentences": [PROBES[0]], "output": "layers", "encoding": "base64"}
        item = httpx.post(f"{url}/embed", json=body, timeout=60).json()["data"][0]
    finally:
        stop_group(server)
    served = np.frombuffer(base64.b64decode(item["embedding"]), "<f4").reshape(item["shape"])
    expected = BiLM.from_pretrained(str(MODEL)).embed_sentences([item["tokens"]])[0]
    assert np.abs(served - expected).max() < 1e-5
