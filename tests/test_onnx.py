"""`elmo onnx`: one file that ONNX Runtime runs without torch and that gives our runtime's numbers.

The exported files run in a subprocess that imports onnxruntime and numpy only (it asserts torch never loaded);
its layers are compared with the runtime's (``Runtime.embed``, fp32) on the TensorFlow-made fixtures, on real text
through weights that drive a fifth of the cells to the clip, on a batch of mixed lengths against each sentence
alone, and on a registered version (``models:/``) whose identity the file's metadata names."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from elmo_core.allennlp import batch_to_ids
from elmo_core.bilm.model import BiLM
from elmo_core.config import preset
from elmo_core.runtime import Runtime
from elmo_core.runtime.onnx_file import parameter_bytes
from tests.helpers import ROOT, run_elmo, stop_group
from tests.test_disk_full import assert_disk_full_line, assert_refused, fill, leftovers, limit_entries, tmpfs
from tests.test_model_versions import register, store  # noqa: F401
from tests.test_precision import _real_text, clip_heavy

# runs each case's batch through its file: onnxruntime and numpy only
RUNNER = """
import json, sys
import numpy as np
import pytest
import onnxruntime as ort
cases = json.loads(open(sys.argv[1]).read())
for case in cases:
    session = ort.InferenceSession(case["onnx"], providers=["CPUExecutionProvider"])
    meta = session.get_modelmeta().custom_metadata_map
    ids = np.load(case["ids"])
    layers, mask = session.run(None, {"char_ids": ids})
    alone = [session.run(None, {"char_ids": ids[i : i + 1, : int(mask[i].sum())]})[0][:, 0] for i in range(len(ids))]
    # each distinct token alone (as the torch-free server keeps words), its layer 0 passed back as token_embeddings
    rows, inverse = np.unique(ids.reshape(-1, ids.shape[-1]), axis=0, return_inverse=True)
    words = session.run(None, {"char_ids": rows[:, None]})[0][0, :, 0, : layers.shape[-1] // 2]
    given = session.run(None, {"char_ids": ids, "token_embeddings": words[inverse.reshape(ids.shape[:2])]})[0]
    np.savez(case["out"], layers=layers, mask=mask, given=given, **{f"alone_{i}": a for i, a in enumerate(alone)})
    json.dump(meta, open(case["out"] + ".meta.json", "w"))
assert "torch" not in sys.modules, "onnxruntime's run imported torch"
print("torch-free")
"""


def _export(model: str, out: Path) -> subprocess.CompletedProcess:
    done = run_elmo("onnx", model, "--out", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    return done


def _run_torch_free(tmp_path: Path, cases: dict[str, tuple[Path, list[list[str]]]]) -> dict[str, dict]:
    """Each case's sentences through its file in one torch-free process: layers, mask, each sentence alone, meta."""
    jobs = []
    for name, (onnx_file, sentences) in cases.items():
        np.save(tmp_path / f"{name}.npy", batch_to_ids(sentences).numpy())
        jobs.append({"onnx": str(onnx_file), "ids": str(tmp_path / f"{name}.npy"), "out": str(tmp_path / name)})
    (tmp_path / "cases.json").write_text(json.dumps(jobs))
    done = subprocess.run(
        [sys.executable, "-c", RUNNER, str(tmp_path / "cases.json")], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0 and done.stdout.strip() == "torch-free", done.stderr[-3000:]
    results = {}
    for name in cases:
        found = dict(np.load(tmp_path / f"{name}.npz"))
        found["meta"] = json.loads((tmp_path / f"{name}.meta.json").read_text())
        results[name] = found
    return results


def _check(found: dict, expected: list[np.ndarray], tolerance: float = 1e-5) -> float:
    """The file's padded layers against the runtime's per sentence: equal where a token is, zero where none is; each
    sentence alone equal to its row of the batch, and so is the batch given its words' layer 0 (each word run alone)
    as ``token_embeddings``. Returns the largest difference."""
    layers, mask = found["layers"], found["mask"]
    worst = 0.0
    for i, ours in enumerate(expected):
        n = ours.shape[1]
        assert int(mask[i].sum()) == n and not mask[i, n:].any()
        worst = max(worst, float(np.abs(layers[:, i, :n] - ours).max()))
        assert not layers[:, i, n:].any()  # padding: zeros, as the runtime's padded layers
        assert np.abs(found[f"alone_{i}"] - layers[:, i, :n]).max() < 1e-6  # the batch changes nothing
        worst = max(worst, float(np.abs(found["given"][:, i, :n] - ours).max()))
        assert not found["given"][:, i, n:].any()
    assert worst < tolerance, worst
    return worst


def _clip_heavy(allennlp_dir: Path, folder: Path) -> Path:
    """The fixture with forget and input gates pushed open (test_precision's weights): a fifth of the cells clip."""
    clip_heavy(BiLM.from_pretrained(str(allennlp_dir))).save_pretrained(str(folder))
    return folder


@pytest.mark.slow
def test_the_file_gives_the_runtimes_layers_without_torch(tmp_path, allennlp_dir, bilm_tf_dir, fixture_sentences):
    bilm_tf = bilm_tf_dir / "model"
    tf_sentences = [s.split() for k in json.loads((bilm_tf / "lm_embeddings_sentences.json").read_text()) for s in k]
    text = _real_text(60)
    models = {
        "allennlp": (allennlp_dir, [s.split() for k in fixture_sentences for s in k]),
        "bilm_tf": (bilm_tf, tf_sentences),
        "clip_heavy": (_clip_heavy(allennlp_dir, tmp_path / "clip_heavy"), text),
    }
    cases = {}
    for name, (folder, sentences) in models.items():
        _export(str(folder), tmp_path / f"{name}.onnx")
        cases[name] = (tmp_path / f"{name}.onnx", sentences)
    found = _run_torch_free(tmp_path, cases)
    for name, (folder, sentences) in models.items():
        runtime = Runtime.open(str(folder), device="cpu", precision="fp32")
        worst = _check(found[name], runtime.embed(sentences))
        print(f"{name}: {len(sentences)} sentences, largest difference {worst:.1e}")
        assert found[name]["meta"]["elmo.model"] == str(Path(folder).resolve()) and found[name]["meta"]["elmo.opset"]


@pytest.mark.slow  # a server, a store or a tmpfs of its own: the quick loop keeps the parity test
def test_each_weight_is_stored_once(tmp_path):
    """At the published small shape (13.6M parameters without the softmax): the file within 1.10x their bytes."""
    torch.manual_seed(0)
    BiLM(preset("small")).save_pretrained(str(tmp_path / "small"))
    _export(str(tmp_path / "small"), tmp_path / "small.onnx")
    weights = parameter_bytes(BiLM.from_pretrained(str(tmp_path / "small")))
    size = (tmp_path / "small.onnx").stat().st_size
    assert size <= 1.10 * weights, (size, weights)
    assert weights > 40e6  # the softmax-free parameters of the small shape, not a fixture's


@pytest.mark.slow  # a server, a store or a tmpfs of its own: the quick loop keeps the parity test
def test_a_registered_version_is_exported_under_its_exact_name(tmp_path, allennlp_dir, store):  # noqa: F811
    exact = register(allennlp_dir, "onnxed")
    done = run_elmo("onnx", "models:/onnxed@champion", "--out", str(tmp_path / "x.onnx"), env=store)
    assert done.returncode != 0 and "onnxed@champion" in done.stderr  # no alias yet: one line, no file
    assert not (tmp_path / "x.onnx").exists() and not list(tmp_path.glob(".x.onnx*"))
    done = run_elmo("onnx", "models:/onnxed/latest", "--out", str(tmp_path / "x.onnx"), env=store)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith(f"onnx: {exact} -> ")
    found = _run_torch_free(tmp_path, {"registered": (tmp_path / "x.onnx", [["a", "registered", "model"]])})
    meta = found["registered"]["meta"]
    assert meta["elmo.model"] == exact and json.loads(meta["elmo.identity"])["version"] == "1"


@pytest.mark.slow  # a server, a store or a tmpfs of its own: the quick loop keeps the parity test
def test_bad_requests_are_one_line_and_leave_nothing(tmp_path, allennlp_dir):
    out = tmp_path / "m.onnx"
    out.write_bytes(b"a file of the user's")
    refused = run_elmo("onnx", str(allennlp_dir), "--out", str(out))
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1
    assert "exists" in refused.stderr and out.read_bytes() == b"a file of the user's"
    missing = run_elmo("onnx", str(tmp_path / "no-model"), "--out", str(tmp_path / "n.onnx"))
    assert missing.returncode == 2 and len(missing.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "n.onnx").exists() and [p.name for p in tmp_path.iterdir()] == ["m.onnx"]
    replaced = run_elmo("onnx", str(allennlp_dir), "--out", str(out), "--overwrite")
    assert replaced.returncode == 0 and out.read_bytes()[:2] != b"a "


@pytest.mark.slow  # a server, a store or a tmpfs of its own: the quick loop keeps the parity test
def test_a_full_disk_leaves_no_file(tmp_path, allennlp_dir):
    """On a real small filesystem: refused before writing where the file cannot fit; a write that runs out of room
    part way (no entry left for the file) is the one line of a full disk; neither leaves a file or a temporary."""
    with tmpfs(tmp_path / "disk", 1024) as disk:
        filler = fill(disk, 100_000)  # less than the 434 kB file
        assert_refused(run_elmo("onnx", str(allennlp_dir), "--out", str(disk / "m.onnx")), "onnx", disk)
        assert sorted(p.name for p in disk.iterdir()) == ["filler"]
        filler.unlink()
        limit_entries(disk, 0)
        full = run_elmo("onnx", str(allennlp_dir), "--out", str(disk / "m.onnx"))
        assert_disk_full_line(full, "onnx", disk / "m.onnx")
        assert list(disk.iterdir()) == [] and leftovers(disk) == []
        limit_entries(disk, None)
        assert run_elmo("onnx", str(allennlp_dir), "--out", str(disk / "m.onnx")).returncode == 0


@pytest.mark.slow  # a server, a store or a tmpfs of its own: the quick loop keeps the parity test
def test_a_triton_repository_whose_config_tritons_protobuf_parses(tmp_path, allennlp_dir):
    """``--triton DIR``: DIR/elmo/config.pbtxt parsed by Triton's own ModelConfig message (tritonclient), its
    tensors those of DIR/elmo/1/model.onnx less the batch dimension, which comes first in every tensor there (as
    Triton batches), with the same numbers as the plain file's."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    done = run_elmo("onnx", str(allennlp_dir), "--triton", str(tmp_path / "repository"))
    assert done.returncode == 0, done.stderr[-2000:]
    folder = tmp_path / "repository" / "elmo"
    config = text_format.Parse((folder / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    assert config.backend == "onnxruntime" and config.max_batch_size > 0 and config.HasField("dynamic_batching")
    import onnxruntime as ort

    session = ort.InferenceSession(str(folder / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    shapes = {t.name: t.shape for t in [*session.get_inputs(), *session.get_outputs()]}
    for tensor in [*config.input, *config.output]:
        onnx_shape = shapes[tensor.name]
        assert onnx_shape[0] == "batch" and len(onnx_shape) == len(tensor.dims) + 1, (tensor.name, onnx_shape)
        assert [d if isinstance(d, int) else -1 for d in onnx_shape[1:]] == list(tensor.dims), tensor.name
    _export(str(allennlp_dir), tmp_path / "plain.onnx")
    plain = ort.InferenceSession(str(tmp_path / "plain.onnx"), providers=["CPUExecutionProvider"])
    ids = batch_to_ids([["Triton", "batches", "first"], ["a", "second", "longer", "sentence", "here"]]).numpy()
    batched, plain_layers = session.run(None, {"char_ids": ids})[0], plain.run(None, {"char_ids": ids})[0]
    assert np.array_equal(batched, plain_layers.transpose(1, 0, 2, 3))


def test_the_docs_python_example_runs_without_torch(tmp_path, allennlp_dir):
    """docs/onnx.md's Python example as written, next to an exported elmo.onnx: its char ids are AllenNLP's."""
    import re

    docs = (ROOT / "docs" / "onnx.md").read_text(encoding="utf-8")
    (example,) = re.findall(r"```python\n(import numpy as np.*?)```", docs, re.S)
    _export(str(allennlp_dir), tmp_path / "elmo.onnx")
    checks = "\nassert 'torch' not in __import__('sys').modules\nnp.save('ids.npy', char_ids([['Apple', 'Ünïcode']]))\n"
    done = subprocess.run([sys.executable, "-c", example + checks], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("(3, 2, 4, 32) [[1, 1, 1, 1], [1, 1, 1, 0]] ")
    assert np.array_equal(np.load(tmp_path / "ids.npy"), batch_to_ids([["Apple", "Ünïcode"]]).numpy())


@pytest.mark.slow  # a server, a store or a tmpfs of its own: the quick loop keeps the parity test
def test_the_torch_free_server_answers_as_the_torch_one(tmp_path, allennlp_dir):
    """`elmo serve FILE.onnx` beside `elmo serve FOLDER`: /embed (every layer, the mix with weights, the mean, in
    base64) and /v1/embeddings equal within 1e-5, the same model id named; its model process never maps torch. The
    words' layer 0 is computed with the first request and kept: the later ones take it from the word cache."""
    import base64

    import httpx

    from tests.test_serve import _ready, _serve, _worker_pids, metric

    _export(str(allennlp_dir), tmp_path / "elmo.onnx")
    (tmp_path / "torch").mkdir()
    (tmp_path / "onnx").mkdir()
    torch_server, torch_url = _serve(tmp_path / "torch", str(allennlp_dir))
    onnx_server, onnx_url = _serve(tmp_path / "onnx", str(tmp_path / "elmo.onnx"))
    sentences = ["I ate an apple .", "Apple makes phones and the apple tree grows in the garden .", "Yes"]
    requests = [
        ("/embed", {"sentences": sentences, "output": "layers", "encoding": "base64"}),
        ("/embed", {"sentences": sentences, "output": "mix", "mix_weights": [0.5, -1.0, 2.0], "gamma": 1.5}),
        ("/embed", {"sentences": sentences, "output": "mean", "encoding": "base64"}),
        ("/v1/embeddings", {"input": sentences, "model": "elmo"}),
    ]
    try:
        _ready(torch_url)
        _ready(onnx_url)
        for (pid,) in [_worker_pids(onnx_url)]:
            maps = Path(f"/proc/{pid}/maps").read_text()
            assert "libtorch" not in maps and "onnxruntime" in maps
        new_words = []
        for path, body in requests:
            answers = [httpx.post(url + path, json=body, timeout=60) for url in (torch_url, onnx_url)]
            new_words.append(metric(onnx_url, "elmo_new_words_total"))
            assert all(a.status_code == 200 for a in answers), [a.text[:300] for a in answers]
            ours, theirs = (a.json() for a in answers)
            if path == "/embed":
                assert ours["model_id"] == theirs["model_id"]
            for a, b in zip(ours["data"], theirs["data"]):
                vectors = []
                for item in (a, b):
                    value = item["embedding"]
                    raw = np.frombuffer(base64.b64decode(value), "<f4") if isinstance(value, str) else np.array(value)
                    vectors.append(raw.astype(np.float32))
                assert vectors[0].shape == vectors[1].shape and np.abs(vectors[0] - vectors[1]).max() < 1e-5, path
        assert new_words[0] > 0 and set(new_words) == {new_words[0]}, new_words  # each word once
    finally:
        stop_group(torch_server)
        stop_group(onnx_server)


@pytest.mark.slow  # a server, a store or a tmpfs of its own: the quick loop keeps the parity test
def test_an_elmoformanylangs_release_is_exported_with_its_dictionaries(tmp_path, monkeypatch):
    """A released folder (test_manylangs' random one, Chinese and over-long tokens among its sentences): the file
    takes the model's own rows, carries the dictionaries that make them, and gives the runtime's layers; the
    torch-free server reads them from it."""
    import httpx

    from elmo_core.serve.onnx_compute import char_ids
    from elmo_core.text.manylangs_chars import ONNX_METADATA_KEY, Dictionaries
    from tests.test_manylangs import SENTENCES, SMALL, WORDS, write_release
    from tests.test_serve import _ready, _serve

    monkeypatch.setenv("ELMO_CACHE_DIR", str(tmp_path / "cache"))
    release = write_release(tmp_path / "zhs.model", SMALL, WORDS)
    _export(str(release), tmp_path / "zhs.onnx")
    import onnxruntime as ort

    session = ort.InferenceSession(str(tmp_path / "zhs.onnx"), providers=["CPUExecutionProvider"])
    state = json.loads(session.get_modelmeta().custom_metadata_map[ONNX_METADATA_KEY])
    sentences = [s for s in SENTENCES if s]
    layers, mask = session.run(None, {"char_ids": char_ids(sentences, Dictionaries.from_state(state, "file"))})
    expected = Runtime.open(str(release), device="cpu", precision="fp32").embed(sentences)
    worst = max(float(np.abs(layers[:, i, : len(s)] - e).max()) for i, (s, e) in enumerate(zip(sentences, expected)))
    assert worst < 1e-5 and mask.sum() == sum(map(len, sentences))
    server, url = _serve(tmp_path, str(tmp_path / "zhs.onnx"))
    try:
        _ready(url)
        body = {"sentences": [sentences[0]], "output": "layers", "encoding": "float"}
        served = np.array(httpx.post(f"{url}/embed", json=body, timeout=60).json()["data"][0]["embedding"])
    finally:
        stop_group(server)
    assert np.abs(served - expected[0]).max() < 1e-5


@pytest.mark.slow  # a server, a store or a tmpfs of its own: the quick loop keeps the parity test
def test_other_commands_refuse_the_file_in_one_line_naming_its_model(tmp_path, allennlp_dir):
    """The file is for ONNX Runtime: `elmo embed` (a job's plan) and `elmo onnx` (nothing to export) say so, naming
    the model it came from; nothing is written."""
    _export(str(allennlp_dir), tmp_path / "m.onnx")
    (tmp_path / "in.txt").write_text("a sentence .\n")
    embed = run_elmo(
        "embed", "--model", str(tmp_path / "m.onnx"), "--input", str(tmp_path / "in.txt"), "--out", str(tmp_path / "t")
    )
    again = run_elmo("onnx", str(tmp_path / "m.onnx"), "--out", str(tmp_path / "n.onnx"))
    for done in (embed, again):
        assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr[-2000:]
        assert str(allennlp_dir.resolve()) in done.stderr
    assert not (tmp_path / "t").exists() and not (tmp_path / "n.onnx").exists()
