"""The project as a user who does not clone gets it: a wheel built from the sources holds what the code reads."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from elmo_core.bilm.kernels.fused_gates import SOURCES

ROOT = Path(__file__).resolve().parent.parent


def _build_wheel(tmp_path: Path) -> Path:
    """A wheel of the project's sources (copied, so nothing built in the clone leaks in)."""
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
    return wheel


@pytest.mark.slow
def test_the_wheel_ships_every_c_source_the_kernels_compile_and_the_recipe_table(tmp_path):
    """A wheel without one of the C sources falls back to the slow reference paths on first use, with only a
    warning; one without the measured recipe table cannot train under a budget."""
    wheel = _build_wheel(tmp_path)
    names = set(zipfile.ZipFile(wheel).namelist())
    for source in SOURCES:
        assert f"elmo_core/bilm/kernels/{source.name}" in names
    assert "elmo_core/train/recipe_table.json" in names


@pytest.mark.slow
def test_the_wheel_in_a_fresh_venv_runs_the_kernels_the_clone_runs(tmp_path):
    """Installed from the wheel into a new venv, run outside any source tree: `elmo info` says the same kernels
    (C gates and char CNN compiled, oneDNN packing, int8) as the clone's. The venv borrows the clone's installed
    dependencies by a path line (torch is not downloaded again), not its editable install of the project."""
    wheel = _build_wheel(tmp_path)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    (site,) = (venv / "lib").glob("python*/site-packages")
    (site / "clone_dependencies.pth").write_text(
        "\n".join(p for p in sys.path if p.endswith("site-packages")) + "\n"  # a plain path: its .pth files not run
    )
    pip = [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python")]
    done = subprocess.run(
        [*pip, "install", "--no-deps", "-q", str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    where = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import elmo_core; print(elmo_core.__file__)"],
        cwd=outside,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert where.stdout.strip().startswith(str(site)), where.stdout + where.stderr  # the wheel's copy, not the clone

    def info(elmo: Path, cwd: Path, env: dict[str, str]) -> list[str]:
        result = subprocess.run([str(elmo), "info"], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr
        return result.stdout.splitlines()

    fresh_cache = {**os.environ, "ELMO_CACHE_DIR": str(tmp_path / "cache")}  # compiled from the wheel's sources
    installed = info(venv / "bin" / "elmo", outside, fresh_cache)
    assert list((tmp_path / "cache").glob("**/*.so"))
    assert "C kernels (LSTM gates, char CNN backward): yes" in installed
    assert installed == info(Path(sys.executable).parent / "elmo", ROOT, dict(os.environ))


def test_setup_hands_uv_the_sources_pip_would_use():
    """scripts/setup.sh installs with uv from pip's configured sources: each option from the scope pip takes it
    from (PIP_* variables over the PIP_CONFIG_FILE file over site, user and global files), every entry of a
    white-space separated value, and nothing uv has no flag for."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from pip_sources import uv_flags
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    listed = "\n".join(
        [
            "global.index-url='https://global.example/simple'",
            "user.index-url='https://user.example/simple'",
            ":env:.find-links='/opt/wheels'",
            "global.find-links='/elsewhere'",
            "global.extra-index-url='file:///a/simple file:///b/simple'",
            "global.constraint='/etc/c.txt'",
            "global.cert='/etc/ssl/ca.crt'",
            ":env:.default-timeout='180'",
        ]
    )
    flags = uv_flags(listed)
    pairs = {(flags[i], flags[i + 1]) for i in range(0, len(flags), 2)}
    assert pairs == {
        ("--index-url", "https://user.example/simple"),
        ("--find-links", "/opt/wheels"),
        ("--extra-index-url", "file:///a/simple"),
        ("--extra-index-url", "file:///b/simple"),
        ("--constraint", "/etc/c.txt"),
    }
    assert len(flags) == 2 * len(pairs)
    assert uv_flags("") == []
