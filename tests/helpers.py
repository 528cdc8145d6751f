"""What several test modules share beyond fixtures: running the ``elmo`` command as a user runs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_elmo(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """``elmo ARGS`` in a real subprocess from the project root, its output captured as text."""
    return subprocess.run(
        [sys.executable, "-m", "elmo_core.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
