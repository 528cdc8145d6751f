"""What several test modules share beyond fixtures: running the ``elmo`` command as a user runs it, comparing
two runs of the model that should give the same vectors, and the marks of tests that need a capability of the CPU
(probed as ``tests/test_gpu.py`` probes CUDA, so that an AVX2-only machine, or ``ELMO_CPU_ISA=avx2``, runs the rest)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch

from elmo_core import BiLM, cpu
from elmo_core.bilm.initialization import init_bilm_tf
from elmo_core.bilm.kernels import choice
from elmo_core.config import tiny
from elmo_core.precision import cpu_has_native_bf16

ROOT = Path(__file__).resolve().parent.parent


def random_tiny_model(seed: int = 0, **lstm) -> BiLM:
    """The tiny preset, bilm-tf-initialised from ``seed``, with ``lstm`` fields changed (clips, sizes), in eval mode:
    weights no fixture fixes, for kernels checked against each other."""
    torch.manual_seed(seed)
    config = tiny()
    config = config.model_copy(update={"lstm": config.lstm.model_copy(update=lstm)})
    bilm = BiLM(config)
    init_bilm_tf(bilm)
    return bilm.eval()


needs_native_bf16 = pytest.mark.skipif(
    not cpu_has_native_bf16(), reason=f"needs a CPU with bfloat16 instructions, not {cpu.facts().line()}"
)


def cpu_precisions() -> tuple[str, ...]:
    """The float precisions the chooser offers for CPU inference on this machine (bf16 only where it is native);
    int8, whose products are not the float ones, has its own tests (``test_int8.py``)."""
    return tuple(p for p in choice.offered_precisions("cpu") if p != "int8")


def run_elmo(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """``elmo ARGS`` in a real subprocess from the project root, its output captured as text."""
    return run_module("elmo_core.cli", *args, env=env, timeout=timeout)


def run_module(
    module: str, *args: str, env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess:
    """``python -m MODULE ARGS`` (a flow's command line, the CLI) the same way."""
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


def assert_same_vectors(
    vectors: Sequence[np.ndarray], reference: Sequence[np.ndarray], precision: str, fp32_atol: float
) -> None:
    """Two kernels' ``embed_sentences`` outputs agree: in fp32 to ``fp32_atol``; in bf16 (whose roundings fall in
    different places) to a per-token cosine of at least 0.9999."""
    for x, y in zip(vectors, reference, strict=True):
        if precision == "fp32":
            np.testing.assert_allclose(x, y, atol=fp32_atol, rtol=0)
        else:
            cosine = (x * y).sum(-1) / (np.linalg.norm(x, axis=-1) * np.linalg.norm(y, axis=-1))
            assert cosine.min() >= 0.9999


def free_port() -> int:
    """A TCP port on the loopback nobody listens on now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the process group a server was started in, then SIGKILL if it has not ended in 20 s."""
    import os
    import signal

    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def start_server(
    command: Sequence[str], ready: str, log: Path, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.Popen:
    """Start a server in a session of its own (its output to ``log``) and poll ``ready`` until it answers (any
    HTTP reply but a connection error); a server that exits or stays silent fails with its log's tail."""
    import time
    import urllib.error
    import urllib.request

    with open(log, "w") as sink:
        server = subprocess.Popen(
            list(command), env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT
        )
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(ready, timeout=2).close()
            return server
        except urllib.error.HTTPError:
            return server  # it answers: up
        except OSError:
            if time.monotonic() > deadline or server.poll() is not None:
                stop_group(server)
                raise RuntimeError(f"{command[0]} did not start: {log.read_text()[-2000:]}") from None
            time.sleep(0.5)


def ingested(folder: Path, lines: Sequence[str], name: str = "text.txt") -> Path:
    """``lines`` written as one text file and ingested as they are (no heldout split) into ``folder/ing``."""
    from elmo_core.ingest import IngestConfig, ingest

    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text("\n".join(lines) + "\n", encoding="utf-8")
    ingest(IngestConfig(sources=[str(folder / name)], out=str(folder / "ing"), heldout_fraction=0.0))
    return folder / "ing"
