"""Shared bits of the flows: environment defaults (set before Prefect is imported) and input fingerprints."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Iterable

# Telemetry off; elmo_core's log lines go to the Prefect run logs.
os.environ.setdefault("DO_NOT_TRACK", "true")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "elmo_core")
# a busy 2-core machine can need more than the default 20 s to start the ephemeral API server
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")

PROJECT_ROOT = Path(__file__).resolve().parent.parent


def fingerprint_files(paths: Iterable[Path], extra: Any = None) -> str:
    """A cache key from files' names, sizes and modification times (cheap, no reading) plus parameters."""
    digest = hashlib.sha256(json.dumps(extra, sort_keys=True, default=str).encode())
    for path in sorted(Path(p) for p in paths):
        if path.is_dir():
            for child in sorted(path.rglob("*")):
                if child.is_file() and not child.name.endswith(".tmp"):
                    stat = child.stat()
                    digest.update(f"{child}:{stat.st_size}:{stat.st_mtime_ns}".encode())
        elif path.exists():
            stat = path.stat()
            digest.update(f"{path}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()


def mlflow_run_link(tracking_uri: str | None, run_id: str | None) -> str | None:
    """Where the run shows in `mlflow ui` (served on 127.0.0.1:5000 by the README's command)."""
    if not run_id:
        return None
    import mlflow

    if tracking_uri:
        mlflow.set_tracking_uri(tracking_uri)
    experiment = mlflow.get_run(run_id).info.experiment_id
    return f"http://127.0.0.1:5000/#/experiments/{experiment}/runs/{run_id}"
