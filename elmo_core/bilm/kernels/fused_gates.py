"""The LSTM cell's gate arithmetic fused into one C loop (``lstm_gates.c``) for CPU inference.

Why: with the products on packed weights (``packed.py``), what was left of a step was PyTorch's separate passes
over the (2, rows, 4H) pre-activations: the bias or input-gate add, a float32 copy of the bf16 product, sigmoid,
tanh, slices, products, clamp and casts, a share of the call that grows with the shape. The C loop reads each element
once and writes the cell state and the cell output (already in the dtype the projection takes).

The sources (``lstm_gates.c``; ``lstm_steps.c``, a layer's steps in one call; ``char_cnn.c``, training's char CNN) are
compiled into one library with the machine's C compiler (``$CC``, else ``cc``) the first time it is needed, for this
CPU (``-march=native``; ``x86-64-v3`` under ``ELMO_CPU_ISA=avx2``), into ``kernels/`` of the machine's cache, beside
its models (``fileio.cache_root``: ``$ELMO_CACHE_DIR``, default ``~/.cache/elmo``), under a name that hashes the
sources, the flags, the compiler and the CPU; later processes load the built library. Without a C compiler, or with
``ELMO_NO_FUSED_GATES=1``, the cells run the same arithmetic in PyTorch ops (``describe`` says which, and why).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

import torch
from torch import Tensor

from elmo_core import cpu
from elmo_core.bilm.kernels import switches
from elmo_core.bilm.lstm_math import reference_gates
from elmo_core.fileio import cache_root

log = logging.getLogger(__name__)

# one library: the LSTM gates (inference and training), a layer's steps in one call (``step_loop.py``) and the char
# CNN's training backward (``char_cnn.py``); the header is hashed with them
SOURCES = [Path(__file__).with_name(name) for name in ("lstm_gates.c", "lstm_steps.c", "char_cnn.c")]
HEADERS = [Path(__file__).with_name("lstm_math.h")]
FLAGS = ["-O3", "-fno-math-errno", "-fno-trapping-math", "-fPIC", "-shared", "-fopenmp"]


def _flags() -> list[str]:
    """FLAGS with the target: this CPU (``-march=native``), or ``x86-64-v3`` (AVX2 + FMA) under ELMO_CPU_ISA=avx2."""
    return [*FLAGS, f"-march={cpu.facts().c_march()}"]


PARALLEL_ELEMENTS = 1 << 15  # below this many cells per step, more threads cost more than they save


class _GateRows(ctypes.Structure):
    """``elmo_gate_rows`` in lstm_gates.c: one direction's pointers."""

    _fields_ = [
        ("y", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("x", ctypes.c_void_p),
        ("x_rows", ctypes.c_void_p),
        ("x_stride", ctypes.c_int64),
        ("c_in", ctypes.c_void_p),
        ("c_out", ctypes.c_void_p),
        ("m_out", ctypes.c_void_p),
    ]


def _cache_dir() -> Path:
    """Built libraries, beside the machine's models: one cache folder for the project (``fileio.cache_root``)."""
    return cache_root() / "kernels"


def _cpu_identity() -> str:
    """What -march=native compiles for: the CPU's model and feature flags (a shared cache may serve other CPUs)."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        lines = cpuinfo.read_text().splitlines()
        return "\n".join(line for line in lines if line.startswith(("model name", "flags", "Features")))[:100_000]
    return f"{platform.machine()} {platform.processor()}"


def _key(compiler: str) -> str:
    """What the built library is named by: the sources, the flags, the compiler's version and the CPU."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    parts = [*(f.read_text() for f in [*SOURCES, *HEADERS]), " ".join(_flags()), version, _cpu_identity()]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc") or shutil.which("clang")


def built() -> str:
    """Whether the library is built for this CPU, read only (what a plan may say; ``library`` builds it): "built
    (PATH)", "built on first use, into FOLDER", or why there will be none."""
    if switches.off("ELMO_NO_FUSED_GATES"):
        return "off (ELMO_NO_FUSED_GATES=1)"
    compiler = _compiler()
    if compiler is None:
        return "none (no C compiler found (set CC))"
    library = _cache_dir() / f"lstm_gates-{_key(compiler)}.so"
    return f"built ({library})" if library.exists() else f"built on first use, into {library.parent}"


def _build(compiler: str) -> Path:
    """The shared library for this source, flags, compiler and CPU: built once, then reused from the cache."""
    key = _key(compiler)
    directory = _cache_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError:
        directory = Path(tempfile.gettempdir()) / "elmo-pipeline"
        directory.mkdir(parents=True, exist_ok=True)
    library = directory / f"lstm_gates-{key}.so"
    if library.exists():
        return library
    fd, partial = tempfile.mkstemp(suffix=".so", dir=directory)  # built aside, renamed: concurrent builds are safe
    os.close(fd)
    try:
        flags = _flags()
        fallbacks = [flags, [f for f in flags if f != "-fopenmp"]]  # without OpenMP the loop runs on one thread
        fallbacks.append([f for f in fallbacks[1] if not f.startswith("-march=")])  # a compiler that cannot target it
        for flags in fallbacks:
            result = subprocess.run(
                [compiler, *flags, "-o", partial, *map(str, SOURCES)], capture_output=True, text=True, timeout=120
            )
            if result.returncode == 0:
                break
        else:
            raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[-500:]}")
        os.replace(partial, library)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    log.info("built the C kernels (LSTM gates, char CNN backward): %s", library)
    return library


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | str:
    """The loaded kernel, or why there is none (a string)."""
    if switches.off("ELMO_NO_FUSED_GATES"):
        return "ELMO_NO_FUSED_GATES=1"
    compiler = _compiler()
    if compiler is None:
        return "no C compiler found (set CC)"
    try:
        lib = ctypes.CDLL(str(_build(compiler)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("fused LSTM gate kernel unavailable, using PyTorch ops: %s", exc)
        return f"build failed: {exc}"
    lib.elmo_lstm_gates.argtypes = [
        ctypes.POINTER(_GateRows),
        ctypes.c_int,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_float,
        ctypes.c_float,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
    ]
    lib.elmo_lstm_gates.restype = ctypes.c_int
    error = _self_check(lib)
    if error > 1e-5:  # a miscompiled or mismatched library: never run it
        log.warning("fused LSTM gate kernel failed its self-check (error %.3g); using PyTorch ops", error)
        return f"self-check failed (error {error:.3g})"
    return lib


def _self_check(lib: ctypes.CDLL) -> float:
    """Largest difference between the kernel and PyTorch's arithmetic on a few rows (float32)."""
    hidden = 20
    y, bias = torch.linspace(-6, 6, 2 * 4 * hidden).view(1, 2, 4 * hidden), torch.linspace(1, -1, 4 * hidden)
    x, c = torch.linspace(2, -3, 2 * 4 * hidden).view(1, 2, 4 * hidden), torch.linspace(-2, 2, 2 * hidden)
    c = c.view(1, 2, hidden)
    try:
        m, c_new = _run(lib, y, c, bias.view(1, 1, -1), x, cell_clip=1.5, threads=1)
    except RuntimeError:
        return float("inf")
    m_ref, c_ref = reference_gates(y + bias + x, c, cell_clip=1.5)
    return float(max((m - m_ref).abs().max(), (c_new - c_ref).abs().max()))


def library() -> ctypes.CDLL | str:
    """The built library (its inference and training functions), or why there is none; built on the first call."""
    return _library()


def available() -> bool:
    """The fused kernel is built and loaded here (built on the first call)."""
    return not isinstance(_library(), str)


def describe() -> str:
    """'yes', or 'no (why)': for ``elmo -v embed`` and the benches."""
    library = _library()
    return f"no ({library})" if isinstance(library, str) else "yes"


def _dense(t: Tensor) -> Tensor:
    """t itself when its rows are packed back to back, as the C loop reads them (a slice of rows usually is)."""
    return t if t.is_contiguous() else t.contiguous()


def lstm_gates(
    y: Tensor | Sequence[Tensor],
    c: Tensor,
    bias: Tensor | None,
    x: Tensor | None = None,
    *,
    x_rows: Tensor | None = None,
    g_scale: float = 1.0,
    cell_clip: float | None = None,
    m_dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, Tensor]:
    """One LSTM step's cell update from its products ``y`` (D, rows, 4H) (or D tensors (rows, 4H)), gates i, f, g, o.

    The pre-activations are ``y + bias + x``: ``bias`` (D, 1, 4H) float32 or None; ``x`` the input gates, None,
    (D, rows, 4H), or, with ``x_rows`` (D, rows) int64, a table (R, 4H) whose row ``x_rows[d, r]`` goes with row r.
    ``y`` and ``x`` may be float32 or bfloat16. ``g_scale`` multiplies the g pre-activations (undoing a scale folded
    into the weights). ``c`` (D, rows, H) float32 is the cell state.

    Returns (m, c'): the cell output ``sigmoid(z_o) * tanh(c')`` (D, rows, H) in ``m_dtype`` and the clipped new cell
    state (D, rows, H) float32. The same arithmetic as ``lstm.LstmCell.gates``, to a few 1e-7.
    """
    library = _library()
    if isinstance(library, str):
        raise RuntimeError(f"the fused LSTM gate kernel is not available: {library}")
    rows, width = y.shape[1:] if isinstance(y, Tensor) else y[0].shape
    threads = torch.get_num_threads() if rows * width // 4 >= PARALLEL_ELEMENTS else 1
    return _run(library, y, c, bias, x, x_rows, g_scale, cell_clip, m_dtype, threads)


def _run(
    library: ctypes.CDLL,
    y: Tensor | Sequence[Tensor],
    c: Tensor,
    bias: Tensor | None,
    x: Tensor | None = None,
    x_rows: Tensor | None = None,
    g_scale: float = 1.0,
    cell_clip: float | None = None,
    m_dtype: torch.dtype = torch.float32,
    threads: int = 1,
) -> tuple[Tensor, Tensor]:
    """``lstm_gates`` on a given library: its arguments checked, then laid out as ``elmo_gate_rows`` for the C call.
    Every tensor whose pointer the C loop reads stays referenced here until the call returns."""
    ys = [_dense(t) for t in (y.unbind(0) if isinstance(y, Tensor) else y)]
    directions, (rows, width) = len(ys), ys[0].shape
    hidden = width // 4
    if width % 4 or any(t.shape != ys[0].shape or t.dtype != ys[0].dtype for t in ys):  # the C loop trusts shapes
        raise ValueError(f"y must be {directions} alike (rows, 4H) products, got {[tuple(t.shape) for t in ys]}")
    halves = (torch.float32, torch.bfloat16)
    if ys[0].dtype not in halves or m_dtype not in halves or (x is not None and x.dtype not in halves):
        raise TypeError(f"y, x, m must be float32 or bfloat16: {ys[0].dtype}, {getattr(x, 'dtype', None)}, {m_dtype}")
    if c.dtype != torch.float32 or c.shape != (directions, rows, hidden):
        raise ValueError(f"c must be float32 {(directions, rows, hidden)}, got {c.dtype} {tuple(c.shape)}")
    if bias is None:
        biases = [_zeros(width)] * directions
    elif bias.dtype == torch.float32 and bias.shape == (directions, 1, width):
        biases = [_dense(b) for b in bias.unbind(0)]
    else:
        raise ValueError(f"bias must be float32 {(directions, 1, width)}, got {bias.dtype} {tuple(bias.shape)}")
    x_stride, indices = 0, [None] * directions
    if x is None:
        xs = [_zeros(width)] * directions
    elif x_rows is not None:
        if x.dim() != 2 or x.shape[1] != width or x_rows.shape != (directions, rows) or x_rows.dtype != torch.int64:
            raise ValueError(f"x_rows {tuple(x_rows.shape)} needs a (R, {width}) table, got {tuple(x.shape)}")
        if x_rows.numel() and not 0 <= x_rows.min() <= x_rows.max() < len(x):  # the C loop trusts them
            raise ValueError(f"x_rows must be row numbers of the {len(x)}-row table")
        xs, indices = [_dense(x)] * directions, [_dense(r) for r in x_rows.unbind(0)]
    elif x.shape == (directions, rows, width):
        xs, x_stride = [_dense(t) for t in x.unbind(0)], 1
    else:
        raise ValueError(f"x {tuple(x.shape)} does not match y ({directions}, {rows}, {width})")
    cs = [_dense(t) for t in c.unbind(0)]
    m = torch.empty(directions, rows, hidden, dtype=m_dtype)
    c_new = torch.empty(directions, rows, hidden)
    dirs = (_GateRows * directions)()
    for d in range(directions):
        dirs[d].y, dirs[d].bias, dirs[d].x = ys[d].data_ptr(), biases[d].data_ptr(), xs[d].data_ptr()
        dirs[d].x_rows = indices[d].data_ptr() if indices[d] is not None else None
        dirs[d].x_stride = x_stride
        dirs[d].c_in, dirs[d].c_out, dirs[d].m_out = cs[d].data_ptr(), c_new[d].data_ptr(), m[d].data_ptr()
    clip = float("inf") if cell_clip is None else float(cell_clip)
    bf16 = [int(t.dtype == torch.bfloat16) for t in (ys[0], xs[0])] + [int(m_dtype == torch.bfloat16)]
    status = library.elmo_lstm_gates(dirs, directions, rows, hidden, g_scale, clip, *bf16, threads)
    if status != 0:
        raise RuntimeError(f"elmo_lstm_gates returned {status} for {directions} x {rows} rows")
    return m, c_new


@lru_cache(maxsize=8)
def _zeros(width: int) -> Tensor:
    """A row of zeros: the bias or input gates of a step that has none apart from its products."""
    return torch.zeros(width)
