"""Shared test fixtures: the TF-generated reference models shipped in ``tests/fixtures`` (see its README)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

import elmo_core  # noqa: F401  (first, before torch: ELMO_CPU_ISA=avx2 then holds torch's own kernels to AVX2)

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"


@pytest.fixture(scope="session")
def bilm_tf_dir() -> Path:
    return FIXTURES / "bilm_tf"


@pytest.fixture(scope="session")
def allennlp_dir() -> Path:
    return FIXTURES / "allennlp_elmo"


@pytest.fixture(scope="session")
def fixture_sentences(allennlp_dir: Path) -> list[list[str]]:
    """The 3 x 10 sentences of the stateful protocol, as ``sentences[k][i]``."""
    return json.loads((allennlp_dir / "sentences.json").read_text())


@pytest.fixture
def c_kernels_off(monkeypatch: pytest.MonkeyPatch):
    """The C kernels off, as ``ELMO_NO_FUSED_GATES=1`` turns them off in a new process (every cached load cleared,
    then cleared again after the test so that the next one builds or loads them afresh)."""
    from elmo_core.bilm.kernels import char_cnn, fused_gates, trained_step

    loads = (fused_gates._library, trained_step._functions, char_cnn._function)
    monkeypatch.setenv("ELMO_NO_FUSED_GATES", "1")
    for load in loads:
        load.cache_clear()
    yield
    for load in loads:
        load.cache_clear()


@pytest.fixture(scope="session")
def prefect_home(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Path], Path]:
    """Makes a ``PREFECT_HOME`` of a test's own (for a flow's temporary Prefect server or ``prefect server start``)
    whose database is a copy of one migrated once per run: a server that migrates a new database first costs ~7 s
    more CPU (a one-task flow here: 25 s against 18 s), and the suite starts several. The pytest processes of one run
    share the copy (made once, under a lock)."""
    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # the run's folder, above each pytest process's own
    template = shared / "prefect-template"
    template.mkdir(exist_ok=True)
    with FileLock(str(template / "lock")):
        if not (template / "prefect.db").exists():
            making = template / "making"
            shutil.rmtree(making, ignore_errors=True)
            making.mkdir()
            prefect = str(Path(sys.executable).parent / "prefect")
            env = {**os.environ, "PREFECT_HOME": str(making)}
            subprocess.run([prefect, "server", "database", "upgrade", "-y"], env=env, capture_output=True, check=True)
            (making / "prefect.db").rename(template / "prefect.db")

    def make(home: Path) -> Path:
        home.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(template / "prefect.db", home / "prefect.db")
        return home

    return make
