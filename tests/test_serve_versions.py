"""One server, one model version: ``elmo serve models:/NAME/latest`` keeps answering from the version it resolved when
it started, through a newer registration and a model process killed and restarted, until it is told to reload; the
reload switches once, and every answer names (and is) the version that made it.

Real processes throughout: an MLflow store in SQLite, the server with two model processes, SIGKILL, HTTP."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
from pathlib import Path

import h5py
import httpx
import numpy as np
import pytest

from elmo_core import BiLM
from tests.helpers import ROOT
from tests.test_serve import _serve, _until

MODEL = ROOT / "tests" / "fixtures" / "allennlp_elmo"
SENTENCE = ["I", "ate", "an", "apple", "."]

pytestmark = pytest.mark.slow


def other_weights(folder: Path, factor: float) -> Path:
    """The fixture with every weight scaled by ``factor``: another model of the same shape, whose vectors differ."""
    shutil.copytree(MODEL, folder)
    with h5py.File(folder / "lm_weights.hdf5", "r+") as f:
        f.visititems(lambda _, node: node.write_direct(node[()] * factor) if isinstance(node, h5py.Dataset) else None)
    return folder


def register(uri: str, folder: Path, name: str) -> str:
    from elmo_core.tracking import MLflowTracker

    tracker = MLflowTracker(experiment="versions-test", tracking_uri=uri)
    registered = tracker.log_model_dir(folder, name)
    tracker.close()
    return registered  # type: ignore[return-value]


def ask(base: str) -> tuple[str, str, np.ndarray]:
    """One sentence's mix vectors, with the version the answer names in its header and its body."""
    response = httpx.post(f"{base}/embed", json={"sentences": [SENTENCE]}, timeout=60)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["model"] == response.headers["x-elmo-model"]
    return response.headers["x-elmo-model"], response.headers["x-elmo-model-id"], np.array(body["data"][0]["embedding"])


def which(vectors: np.ndarray, wants: dict[str, np.ndarray]) -> str:
    found = [name for name, want in wants.items() if np.allclose(vectors, want, atol=1e-5)]
    assert len(found) == 1, "the vectors are neither version's"
    return found[0]


def test_latest_is_resolved_once_and_a_reload_switches_once(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    second = other_weights(tmp_path / "second", 1.1)
    assert register(uri, MODEL, "versions") == "models:/versions/1"
    wants = {
        "models:/versions/1": BiLM.from_pretrained(str(MODEL)).embed_sentences([SENTENCE])[0].mean(0),
        "models:/versions/2": BiLM.from_pretrained(str(second)).embed_sentences([SENTENCE])[0].mean(0),
    }
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "ELMO_CACHE_DIR": str(tmp_path / "cache")}
    proc, base = _serve(tmp_path, "models:/versions/latest", "--workers", "2", "--access-log", env=env)
    try:
        _until(lambda: httpx.get(f"{base}/ready").json().get("workers_ready") == 2, "two warm model processes")
        info = httpx.get(f"{base}/info").json()
        assert info["model"] == "models:/versions/1" and info["source"] == "models:/versions/latest"
        assert info["identity"]["version"] == "1" and info["identity"]["run_id"]
        assert httpx.get(f"{base}/v1/models").json()["data"][0]["id"] == "models:/versions/1"

        # a newer version registered while it runs, then a model process killed: its restart loads version 1 again
        assert register(uri, second, "versions") == "models:/versions/2"
        killed = info["workers"][0]["pid"]
        os.kill(killed, signal.SIGKILL)
        _until(
            lambda: (
                (w := httpx.get(f"{base}/info").json()["workers"])[0]["pid"] not in (None, killed)
                and all(x["ready"] for x in w)
            ),
            "the killed model process restarted and warm",
        )
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda _: ask(base), range(24)))
        assert {(name, which(vectors, wants)) for name, _, vectors in answers} == {("models:/versions/1",) * 2}

        # told to reload: it loads version 2 beside version 1 and switches once, while a client keeps asking
        seen: list[tuple[str, str]] = []
        stop = threading.Event()

        def keep_asking() -> None:
            while not stop.is_set():
                name, _, vectors = ask(base)
                seen.append((name, which(vectors, wants)))

        client = threading.Thread(target=keep_asking)
        client.start()
        try:
            _until(lambda: len(seen) >= 3, "answers before the reload")
            reload = httpx.post(f"{base}/reload", timeout=60)
            assert reload.status_code == 202, reload.text
            assert reload.json()["from"] == "models:/versions/1" and reload.json()["to"] == "models:/versions/2"
            _until(lambda: httpx.get(f"{base}/info").json()["model"] == "models:/versions/2", "the switch")
            count = len(seen)
            _until(lambda: len(seen) >= count + 3, "answers after the switch")
        finally:
            stop.set()
            client.join(timeout=60)
        assert all(name == made for name, made in seen), "an answer named another version than made it"
        names = [name for name, _ in seen]
        switch = names.index("models:/versions/2")
        assert names[:switch] == ["models:/versions/1"] * switch and set(names[switch:]) == {"models:/versions/2"}

        info = httpx.get(f"{base}/info").json()
        assert info["generation"] == 2 and info["last_reload"]["to"] == "models:/versions/2"
        _until(lambda: len(httpx.get(f"{base}/info").json()["workers"]) == 2, "the old processes gone")
        again = httpx.post(f"{base}/reload", timeout=60)  # nothing new: nothing happens
        assert again.status_code == 200 and "still names models:/versions/2" in again.json()["why"]

        # SIGHUP reloads too: a third version, and the server moves to it
        third = other_weights(tmp_path / "third", 1.2)
        assert register(uri, third, "versions") == "models:/versions/3"
        os.kill(proc.pid, signal.SIGHUP)
        _until(lambda: httpx.get(f"{base}/info").json()["model"] == "models:/versions/3", "the switch on SIGHUP")
        assert ask(base)[0] == "models:/versions/3"
    finally:
        from tests.helpers import stop_group

        stop_group(proc)
    logged = [json.loads(line) for line in (tmp_path / "serve.log").read_text().splitlines() if '"request_id"' in line]
    embeds = [line for line in logged if line["path"] == "/embed" and line["status"] == 200]
    assert {line["model"] for line in embeds} == {f"models:/versions/{n}" for n in (1, 2, 3)}


def test_a_request_begun_before_a_switch_ends_on_its_version(tmp_path: Path) -> None:
    """A request split over several batches, whose first batch is computing when the switch comes (its model process
    held with SIGSTOP), gets every sentence from the version it began on; the next request gets the new one. A
    model folder rewritten in place (a new export over the old) is what the reload finds."""
    from tests.test_serve import metric, stopped_workers

    folder = tmp_path / "model"
    shutil.copytree(MODEL, folder)
    first = BiLM.from_pretrained(str(folder))
    sentences = [[f"w{i}", "ate", "an", "apple", "."] for i in range(6)]  # 30 tokens: three batches of 10
    wants = {"old": first.embed_sentences(sentences), "new": None}
    proc, base = _serve(tmp_path, str(folder), "--max-batch-tokens", "10", "--max-sentence-tokens", "10")
    try:
        _until(lambda: httpx.get(f"{base}/ready").status_code == 200, "/ready")
        old_name, old_id = httpx.get(f"{base}/info").json()["model"], httpx.get(f"{base}/info").json()["identity"]
        fresh = other_weights(tmp_path / "fresh", 1.1)
        os.replace(fresh / "lm_weights.hdf5", folder / "lm_weights.hdf5")  # the new export, swapped in whole
        wants["new"] = BiLM.from_pretrained(str(folder)).embed_sentences(sentences)
        answers: list[httpx.Response] = []
        with stopped_workers(base):
            asking = threading.Thread(
                target=lambda: answers.append(httpx.post(f"{base}/embed", json={"sentences": sentences}, timeout=120))
            )
            asking.start()
            _until(lambda: metric(base, "elmo_inflight_tokens") > 0, "its first batch in the held model process")
            assert httpx.post(f"{base}/reload", timeout=60).status_code == 202
            _until(lambda: httpx.get(f"{base}/info").json()["identity"]["model_id"] != old_id["model_id"], "switch")
        asking.join(timeout=120)
        body = answers[0].json()
        assert answers[0].headers["x-elmo-model-id"] == old_id["model_id"] and body["model"] == old_name
        for item, want in zip(body["data"], wants["old"]):
            np.testing.assert_allclose(np.array(item["embedding"]), want.mean(0), atol=1e-5)
        after = httpx.post(f"{base}/embed", json={"sentences": sentences[:1]}, timeout=60)
        assert after.headers["x-elmo-model-id"] != old_id["model_id"]
        np.testing.assert_allclose(np.array(after.json()["data"][0]["embedding"]), wants["new"][0].mean(0), atol=1e-5)
    finally:
        from tests.helpers import stop_group

        stop_group(proc)


def test_a_server_following_an_alias_moves_with_it_once(tmp_path: Path) -> None:
    """``--follow-alias``: the alias moved to another version, and with no other word the server moves to it; a
    client asking all along meets version 1, then version 2, never one after the other again."""
    import mlflow

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    register(uri, MODEL, "followed")
    second = register(uri, other_weights(tmp_path / "second", 1.1), "followed")
    client = mlflow.MlflowClient(uri)
    client.set_registered_model_alias("followed", "champion", "1")
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "ELMO_CACHE_DIR": str(tmp_path / "cache")}
    proc, base = _serve(tmp_path, "models:/followed@champion", "--follow-alias", "0.5", env=env)
    seen: list[str] = []
    stop = threading.Event()
    asking = threading.Thread(target=lambda: [seen.append(ask(base)[0]) for _ in iter(stop.is_set, True)])
    try:
        _until(lambda: httpx.get(f"{base}/ready").status_code == 200, "/ready")
        asking.start()
        _until(lambda: len(seen) >= 3, "answers from the champion")
        client.set_registered_model_alias("followed", "champion", "2")
        _until(lambda: httpx.get(f"{base}/info").json()["model"] == second, "the server following the alias")
        count = len(seen)
        _until(lambda: len(seen) >= count + 3, "answers after the move")
    finally:
        stop.set()
        if asking.is_alive():
            asking.join(timeout=60)
        from tests.helpers import stop_group

        stop_group(proc)
    switch = seen.index(second)
    assert switch >= 3 and seen[:switch] == ["models:/followed/1"] * switch and set(seen[switch:]) == {second}
