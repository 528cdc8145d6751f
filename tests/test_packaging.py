"""The project as a user who does not clone gets it: a wheel built from the sources holds what the code reads."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from elmo_core.kernels.fused_gates import SOURCES

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_the_wheel_ships_every_c_source_the_kernels_compile(tmp_path):
    """A wheel without one of them falls back to the slow reference paths on first use, with only a warning."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for package in ("elmo_core", "flows"):
        shutil.copytree(ROOT / package, src / package, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), "."],
        cwd=src,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    (wheel,) = tmp_path.glob("elmo_pipeline-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for source in SOURCES:
        assert f"elmo_core/kernels/{source.name}" in names
