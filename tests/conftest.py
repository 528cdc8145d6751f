"""Shared test fixtures: paths to the TF-generated reference models in ``../shared/fixtures``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("ELMO_SHARED_DIR", ROOT.parent / "shared"))
FIXTURES = SHARED / "fixtures"


def _require(path: Path) -> Path:
    if not path.exists():
        pytest.fail(f"reference fixtures not found at {path} (set ELMO_SHARED_DIR to the shared/ folder)")
    return path


@pytest.fixture(scope="session")
def bilm_tf_dir() -> Path:
    return _require(FIXTURES / "bilm_tf")


@pytest.fixture(scope="session")
def allennlp_dir() -> Path:
    return _require(FIXTURES / "allennlp_elmo")


@pytest.fixture(scope="session")
def fixture_sentences(allennlp_dir: Path) -> list[list[str]]:
    """The 3 x 10 sentences of the stateful protocol, as ``sentences[k][i]``."""
    return json.loads((allennlp_dir / "sentences.json").read_text())
