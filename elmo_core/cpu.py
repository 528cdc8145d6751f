"""What this CPU can do for the project's kernels, read once, and the override that makes it look like a smaller one.

Why one module: which precision a run may take (``precision``), which products get packed for oneDNN
(``kernels.packed``), what the C kernels are compiled for (``kernels.fused_gates``), whether int8 inference is
offered (``kernels.int8``), ``elmo info`` and every bench header ask the same questions of the same machine.
The answers come from ``/proc/cpuinfo`` (what the CPU has) and from torch (what its kernels dispatch to).

``ELMO_CPU_ISA=avx2`` makes a CPU with AVX-512 (and bf16, AMX, VNNI) behave as an AVX2-only one, as many cloud VMs,
AMD Zen 2/3 and older Intel CPUs are: the project's own choices see no AVX-512, no native bfloat16 and no AMX, the C
kernels are compiled for ``x86-64-v3`` (AVX2 + FMA), and, when it is set before torch is first imported (importing
``elmo_core`` first does it), torch's own kernels are held to AVX2 as well (oneDNN's ``ONEDNN_MAX_CPU_ISA``, ATen's
``ATEN_CPU_CAPABILITY``, fbgemm's ``FBGEMM_ENABLE_INSTRUCTIONS``, each unless already set). CI runs the
fallback paths with it on any machine. It imports without torch.
"""

from __future__ import annotations

import contextlib
import os
import platform
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

OVERRIDE = "ELMO_CPU_ISA"
OVERRIDES = ("avx2",)
# what the override asks of torch's own libraries, so that the products really run as on an AVX2-only CPU
TORCH_LIMITS = {
    "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2", "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2"}
}
# the flags that decide a kernel here: AVX-512, bf16 dot products, AMX tiles, VNNI (int8 dot products)
FLAGS_THAT_MATTER = (
    "avx2",
    "fma",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx_vnni",
    "avx512_bf16",
    "avx_ne_convert",
    "amx_bf16",
    "amx_int8",
    "asimd",
    "bf16",
    "i8mm",
    "sve",
)
# flags an AVX2-only CPU does not have (what the override takes away)
_NOT_ON_AVX2 = ("avx512", "amx", "avx_vnni", "avx_ne_convert")


def override() -> str | None:
    """The CPU the project behaves as (``ELMO_CPU_ISA``), or None; an unknown value is a one-line error."""
    value = os.environ.get(OVERRIDE, "").strip().lower()
    if not value:
        return None
    if value not in OVERRIDES:
        from elmo_core.errors import ConfigError

        raise ConfigError(f"{OVERRIDE}={value!r}: expected one of {', '.join(OVERRIDES)} (or unset)")
    return value


def limit_torch() -> None:
    """Hold torch's libraries to the override's instruction set; only before torch is imported (they read these
    variables once). Called first thing by ``elmo_core/__init__``."""
    isa = os.environ.get(OVERRIDE, "").strip().lower()
    if isa not in TORCH_LIMITS or "torch" in sys.modules:  # a bad value is reported by ``override`` when asked
        return
    for name, value in TORCH_LIMITS[isa].items():
        os.environ.setdefault(name, value)


def _cpuinfo() -> tuple[str, frozenset[str]]:
    """(model name, flags) from /proc/cpuinfo; elsewhere what ``platform`` says, with no flags."""
    path = Path("/proc/cpuinfo")
    model, flags = "", frozenset()
    if path.exists():
        for line in path.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("model name", "Model", "CPU part") and not model:
                model = value.strip()
            elif key in ("flags", "Features") and not flags:
                flags = frozenset(value.split())
    return model or platform.processor() or platform.machine(), flags


@dataclass(frozen=True)
class CpuFacts:
    """This CPU as the project's choices see it (the override applied)."""

    model: str
    machine: str  # x86_64, aarch64, ...
    flags: frozenset[str]  # the FLAGS_THAT_MATTER it has
    override: str | None

    @property
    def x86(self) -> bool:
        return self.machine.lower() in ("x86_64", "amd64", "i686", "i386")

    @property
    def avx512(self) -> bool:
        return "avx512f" in self.flags

    @property
    def amx(self) -> bool:
        return "amx_bf16" in self.flags or "amx_int8" in self.flags

    @property
    def vnni(self) -> bool:
        return "avx512_vnni" in self.flags or "avx_vnni" in self.flags or "amx_int8" in self.flags

    @property
    def bf16_instructions(self) -> bool:
        """bfloat16 dot products in hardware: avx512_bf16, AMX or AVX-NE-CONVERT on x86, the bf16 feature on Arm."""
        if self.x86:
            return bool({"avx512_bf16", "amx_bf16", "avx_ne_convert"} & self.flags)
        return "bf16" in self.flags

    def c_march(self) -> str:
        """What the C kernels are compiled for: this CPU, or an AVX2 one under the override."""
        return "x86-64-v3" if self.override == "avx2" and self.x86 else "native"

    def line(self) -> str:
        """One line for logs and bench headers: the CPU and the flags that matter."""
        yes = lambda v: "yes" if v else "no"  # noqa: E731
        if self.x86:
            have = (
                f"AVX2 {yes('avx2' in self.flags)}, AVX-512 {yes(self.avx512)}, avx512_bf16 "
                f"{yes('avx512_bf16' in self.flags)}, AMX {yes(self.amx)}, VNNI {yes(self.vnni)}"
            )
        else:
            have = f"bf16 {yes('bf16' in self.flags)}, i8mm {yes('i8mm' in self.flags)}, SVE {yes('sve' in self.flags)}"
        behaving = ""
        if self.override:
            behaving = f" (behaving as an {self.override.upper()}-only CPU: {OVERRIDE}={self.override})"
        return f"{self.model} ({self.machine}): {have}{behaving}"


@lru_cache(maxsize=4)
def _facts(isa: str | None) -> CpuFacts:
    model, flags = _cpuinfo()
    kept = frozenset(f for f in FLAGS_THAT_MATTER if f in flags)
    if isa == "avx2":
        kept = frozenset(f for f in kept if not f.startswith(_NOT_ON_AVX2))
    return CpuFacts(model=model, machine=platform.machine(), flags=kept, override=isa)


def facts() -> CpuFacts:
    """This CPU, read once (per value of the override, which tests change)."""
    return _facts(override())


def hidden_by(isa: str) -> frozenset[str]:
    """The flags that matter which ``ELMO_CPU_ISA=isa`` takes away on this CPU: none where the CPU is no more than
    that already (CI then skips its second run under the override, which would repeat the first exactly)."""
    return _facts(None).flags - _facts(isa).flags


def torch_capability() -> str:
    """What torch's CPU kernels were dispatched for (AVX512, AVX2, DEFAULT, ...)."""
    import torch

    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except Exception:  # older builds
        return "unknown"


def describe() -> str:
    """The CPU line and what torch dispatches to: the header of ``elmo info`` and of every bench."""
    capability = torch_capability()
    held = (
        "" if override() is None or capability == "AVX2" else " (not held to AVX2: torch was imported before elmo_core)"
    )
    return f"CPU {facts().line()}; torch {_torch_version()} CPU kernels {capability}{held}"


def _torch_version() -> str:
    import torch

    return torch.__version__


# --- cores shared by the processes of one job ----------------------------------------------------------------------
THREADS = "ELMO_TORCH_THREADS"  # set by the project for each worker process it starts: its share of the cores


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask, which containers and taskset narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def threads_for(processes: int) -> int:
    """Each of ``processes`` worker processes on this machine gets cores / processes torch threads (at least 1): two
    workers each taking every core embedded 2,590 tok/s against 3,431 with their shares (``bench/embed_job.py
    --cluster-workers 2``, the 2-vCPU AMD EPYC with avx512_bf16)."""
    return max(1, usable_cores() // max(1, processes))


def worker_env(processes: int, threads: int | None = None) -> dict[str, str]:
    """The environment of a worker process that shares this machine with ``processes - 1`` others: torch's threads
    (``apply_thread_share`` reads them) and the OpenMP / MKL pools', which torch sizes itself from at start.
    ``threads`` overrides the share (a bench shows what every worker taking every core costs)."""
    n = str(threads if threads else threads_for(processes))
    return {THREADS: n, "OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n}


def thread_share() -> int | None:
    """The share of the cores a worker process the project started was given (``worker_env``), if it was one."""
    value = os.environ.get(THREADS)
    return max(1, int(value)) if value else None


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """``values`` in this process's environment while the block runs (the processes it starts inherit them)."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def apply_thread_share() -> str | None:
    """In a worker process the project started: take its share of the cores (``THREADS``) as torch's thread count.
    Returns the line to log (None where no share was set: the process keeps torch's default)."""
    value = os.environ.get(THREADS)
    if not value:
        return None
    import torch

    n = max(1, int(value))
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return f"torch threads: {n} in this process (pid {os.getpid()}), its share of the {usable_cores()} cores"
