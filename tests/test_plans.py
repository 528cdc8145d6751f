"""Every stage plans before it acts, and a plan only reads: ``elmo <stage> --plan`` leaves every folder byte for byte
as it was (listing, sizes, modification times); and every stage claims what it writes before a byte changes, so a
second job on any stage's folder is refused in one line while the first holds it, the first's files untouched.

One small chain is made once, through the ``elmo`` command as a user runs it (ingest, vocab, train, export, embed,
index), then each stage is asked again: for its plan, and while another process holds its folder."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from elmo_core.fileio import FolderLock, beside
from tests.helpers import run_elmo
from tests.test_train import FIXTURE_OPTIONS

pytestmark = pytest.mark.slow

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "bilm_tf" / "train"


def _ok(*args: str) -> str:
    done = run_elmo(*args)
    assert done.returncode == 0, (args, done.stderr[-2000:])
    return done.stdout


@pytest.fixture(scope="module")
def chain(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("chain")
    (root / "corpus.txt").write_text((FIXTURES / "data.txt").read_text())
    _ok("ingest", str(root / "corpus.txt"), "--out", str(root / "ingest"), "--heldout-fraction", "0.1")
    _ok("vocab", "--corpus", str(root / "ingest"), "--db", str(root / "vocab" / "vocab.duckdb"))
    train = {**FIXTURE_OPTIONS, "data": str(root / "vocab"), "out": str(root / "run"), "max_steps": 3}
    (root / "train.json").write_text(json.dumps(train))
    _ok("train", "--config", str(root / "train.json"))
    _ok("export", "--run", str(root / "run"), "--out", str(root / "export"))
    _ok("embed", "--model", str(root / "export"), "--input", str(root / "corpus.txt"), "--out", str(root / "emb"))
    _ok("index", str(root / "emb"))
    senses = [
        {"tokens": ["the", "bank", "rose"], "index": 1, "sense": f"s{i % 2}", "lemma": "bank.n"} for i in range(4)
    ]
    (root / "senses.jsonl").write_text("".join(json.dumps(s) + "\n" for s in senses))
    return root


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every file and folder under ``root`` (hidden ones and locks included): size and mtime."""
    found = {}
    for path in sorted(root.rglob("*")):
        stat = path.stat()
        found[str(path.relative_to(root))] = (stat.st_size if path.is_file() else -1, stat.st_mtime_ns)
    return found


def _commands(root: Path) -> dict[str, list[str]]:
    """Each stage's command on the chain's folders (a rerun of what made them) and on new ones."""
    return {
        "ingest": ["ingest", str(root / "corpus.txt"), "--out", str(root / "ingest"), "--heldout-fraction", "0.1"],
        "ingest-new": ["ingest", str(root / "corpus.txt"), "--out", str(root / "ingest2")],
        "vocab": ["vocab", "--corpus", str(root / "ingest"), "--db", str(root / "vocab" / "vocab.duckdb")],
        "train": ["train", "--config", str(root / "train.json"), "--max-steps", "5"],
        "train-new": ["train", "--config", str(root / "train.json"), "--out", str(root / "run2")],
        "export": ["export", "--run", str(root / "run"), "--out", str(root / "export")],
        "perplexity": ["perplexity", "--model", str(root / "export"), "--corpus", str(root / "ingest")],
        "embed": [
            "embed", "--model", str(root / "export"), "--input", str(root / "corpus.txt"), "--out", str(root / "emb"),
        ],
        "embed-new-text": [
            "embed", "--model", str(root / "export"), "--input", str(root / "corpus.txt"), "--out", str(root / "e2"),
            "--index",
        ],
        "embed-dataset": [
            "embed", "--model", str(root / "export"), "--input", str(root / "ingest"), "--out", str(root / "e3"),
        ],
        "index": ["index", str(root / "emb"), "--rebuild"],
        "probe": [
            "probe", "wsd", "--model", str(root / "export"), "--data", str(root / "senses.jsonl"),
            "--out", str(root / "probe"), "--tracking", "none",
        ],
    }  # fmt: skip


def test_every_stage_plan_changes_nothing_on_disk(chain):
    before = _snapshot(chain)
    said = {}
    for name, command in _commands(chain).items():
        said[name] = _ok(*command, "--plan")
        assert _snapshot(chain) == before, name
    assert "writes " in said["ingest"] and "files already in its manifest are skipped" in said["ingest"]
    assert "device cpu, precision " in said["train"] and "; 5 steps" in said["train"]
    assert "no time budget" in said["train"] and f"writes {chain / 'run2'}" in said["train-new"]
    assert "units (" in said["embed"] and "already done" in said["embed"] and "model " in said["embed"]
    assert (
        "tokenize 1 text files" in said["embed-new-text"]
        and "index: built once the table is written" in said["embed-new-text"]
    )
    assert "a new index (the quantizer trained anew)" in said["index"]
    for name in ("vocab", "train", "train-new", "index"):  # the bytes each will write, and the room there is
        assert " to write" in said[name] and " free" in said[name], name


def test_plans_download_convert_and_build_nothing(chain, tmp_path):
    """A plan reads the registry, the folder and the caches and writes none of them: an embedding of a registered
    version not yet downloaded, of an ELMoForManyLangs release not yet converted, a probe and a scoring of a
    registered version, a training whose C kernels are not built yet and a fine-tuning of a registered version leave
    the machine's cache (models, releases, kernels) and the chain as they were; then the job itself fetches what
    its plan said, under its claim."""
    from elmo_core.tracking import MLflowTracker
    from tests.test_manylangs import SMALL, WORDS, write_release

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = MLflowTracker(experiment="plans", tracking_uri=uri)
    assert tracker.log_model_dir(chain / "export", "planned") == "models:/planned/1"
    tracker.close()
    release = write_release(tmp_path / "zhs.model", SMALL, WORDS)
    cache = tmp_path / "cache"
    cache.mkdir()
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "ELMO_CACHE_DIR": str(cache)}
    text, out = str(chain / "corpus.txt"), tmp_path / "out"
    commands = {
        "embed-registered": ["embed", "--model", "models:/planned/latest", "--input", text, "--out", str(out / "e1")],
        "embed-release": ["embed", "--model", str(release), "--input", text, "--out", str(out / "e2")],
        "probe-registered": [
            "probe", "wsd", "--model", "models:/planned/1", "--data", str(chain / "senses.jsonl"),
            "--out", str(out / "probe"), "--tracking", "none",
        ],
        "perplexity-registered": ["perplexity", "--model", "models:/planned/1", "--corpus", str(chain / "ingest")],
        "train-first-build": ["train", "--config", str(chain / "train.json"), "--out", str(out / "run")],
        "fine-tune-registered": [
            "train", "--config", str(chain / "train.json"), "--out", str(out / "tuned"), "--init-from",
            "models:/planned/latest",
        ],
    }  # fmt: skip
    before = (_snapshot(cache), _snapshot(chain))
    said = {}
    for name, command in commands.items():
        done = run_elmo(*command, "--plan", env=env)
        assert done.returncode == 0, (name, done.stderr[-2000:])
        said[name] = done.stdout
        assert (_snapshot(cache), _snapshot(chain)) == before, name
    assert "models:/planned/1, downloaded into the model cache" in said["embed-registered"]
    assert "converted once into" in said["embed-release"]
    assert "the C kernels built on first use" in said["train-first-build"]
    assert "fine-tunes model models:/planned/1 (downloaded into the model cache" in said["fine-tune-registered"]
    assert not out.exists()

    embedded = run_elmo(*commands["embed-registered"], env=env)  # the job fetches what its plan said it would
    assert embedded.returncode == 0, embedded.stderr[-2000:]
    assert json.loads((out / "e1" / "_job.json").read_text())["model_version"] == "models:/planned/1"
    assert any((cache / "models").glob("planned-1-*/model.json")) and any((cache / "kernels").glob("*.so"))


def _holder(root: Path, name: str) -> FolderLock:
    """The lock another job on the stage's folder would hold."""
    folder = {
        "ingest": root / "ingest",
        "vocab": root / "vocab",
        "train": root / "run",
        "export": root / "export",
        "embed": root / "emb",
        "probe": root / "probe",
    }[name]
    if name == "embed":
        return FolderLock(root / ".emb.elmo" / "lock", folder)
    return FolderLock(beside(folder), folder)


@pytest.mark.parametrize("name", ["ingest", "vocab", "train", "export", "embed", "index", "probe"])
def test_a_second_job_on_a_stage_folder_is_refused_in_one_line(chain, name):
    lock = (
        FolderLock(chain / "emb" / "_index" / "elmo" / "lock", chain / "emb" / "_index" / "elmo")
        if name == "index"
        else _holder(chain, name)
    )
    with lock:
        before = _snapshot(chain)
        done = run_elmo(*_commands(chain)[name])
        after = _snapshot(chain)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and f"in use by another job (pid {os.getpid()} on " in lines[0], lines
    assert after == before
