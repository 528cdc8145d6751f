"""Shared test fixtures: the TF-generated reference models shipped in ``tests/fixtures`` (see its README)."""

from __future__ import annotations

import json
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
