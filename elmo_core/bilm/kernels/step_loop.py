"""A layer's LSTM steps in one C call (``lstm_steps.c``): CPU inference in fp32.

Why: from Python each step of a layer pays a dozen PyTorch calls besides its products; on the small shape a step
of one row took 0.5 ms, its products under half of that. Sentences of mixed lengths share a batch, and the longest
run their last steps nearly alone: a server's batches, made of whatever requests wait, spend much of their time
there. In one C call the steps run in one OpenMP region, each thread on the same panels of the weights at every
step, with products summed in registers (each weight read once per step and block of rows).

Which steps: on weights below oneDNN's packing size (``packed.MIN_ELEMENTS``: the tiny and small shapes) every
step, as the loop was faster at every row count measured (1 to 256 rows, 2 cores); on packed weights (medium,
original) the steps from the first with at most ``PACKED_ROWS`` rows, where oneDNN's packed products stop being
faster. ``bench/step_loop.py`` measures both against the steps from Python. ``ELMO_NO_STEP_LOOP=1``
turns it off, as does a C library that did not build (``fused_gates.describe``). The numbers are the Python step's
to a few 1e-7: the same gate arithmetic (``lstm_math.h``), the products summed in another order.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Sequence
from functools import lru_cache

import torch
from torch import Tensor

from elmo_core.bilm.kernels import fused_gates, switches

PACKED_ROWS = 16  # on the original shape, 2 cores: the loop 2x faster at 1-4 rows, level at 16 and 64
PANEL = 64  # lstm_steps.c's PANEL


@lru_cache(maxsize=1)
def _function() -> ctypes._CFuncPtr | str:
    """``elmo_lstm_steps`` of the built library, or why there is none."""
    if switches.off("ELMO_NO_STEP_LOOP"):
        return "ELMO_NO_STEP_LOOP=1"
    library = fused_gates.library()
    if isinstance(library, str):
        return library
    function = library.elmo_lstm_steps
    i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    function.argtypes = [i64, ptr, i64, i64, ptr, i64, ptr, i64, ptr, ptr, ptr, ptr, ptr, ptr, i64, ptr, ptr, ptr, f32]
    function.argtypes += [f32, ctypes.c_int]
    function.restype = ctypes.c_int
    return function


def on() -> bool:
    """The C loop is built and not turned off here."""
    return not isinstance(_function(), str)


def rows(packed: bool) -> int:
    """The most rows a step may have for the loop to run it and the rest: every step (``sys.maxsize``) on weights
    oneDNN does not pack, ``PACKED_ROWS`` on packed ones."""
    return PACKED_ROWS if packed else sys.maxsize


def describe() -> str:
    function = _function()
    if isinstance(function, str):
        return f"no ({function})"
    return f"yes (every step; on oneDNN-packed weights from {PACKED_ROWS} rows down)"


def panels(w_t: Tensor) -> Tensor:
    """W^T (2, K, N) as the C loop reads it: panels of 64 columns, each (K, 64) contiguous, zero-padded to whole
    panels, (2, ceil(N / 64), K, 64) float32. Read in order, a panel stays in cache where W's own rows, 4H floats
    apart, would fall into a few cache sets."""
    directions, k_dim, width = w_t.shape
    padded = torch.zeros(directions, k_dim, -(-width // PANEL) * PANEL)
    padded[:, :, :width] = w_t.float()
    return padded.view(directions, k_dim, -1, PANEL).permute(0, 2, 1, 3).contiguous()


def _run_of(items: Sequence[Tensor]) -> tuple[Tensor, int]:
    """(2, n_t, ...) items as (the first, its direction stride) where they lie back to back in one tensor, as the
    splits of one do, each direction's rows dense; else one dense copy of them all."""
    first, last = items[0], items[-1]
    row = first[0, 0].numel()
    before = sum(item.shape[1] for item in items[:-1])
    dense_rows = first.stride(-1) == 1 and (first.dim() == 2 or first.stride(1) == row)
    if dense_rows and last.stride() == first.stride():
        if last.data_ptr() == first.data_ptr() + before * row * first.element_size():
            return first, first.stride(0)
    merged = torch.cat(list(items), dim=1).contiguous()
    return merged, merged.stride(0)


def lstm_steps(
    sources: Sequence[Tensor] | tuple[Tensor, Sequence[Tensor], Tensor],
    batch_sizes: list[int],
    h: Tensor,
    c: Tensor,
    *,
    w_hh: Tensor,
    w_hr: Tensor | None,
    cell_clip: float | None,
    proj_clip: float | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """The steps of ``batch_sizes`` from state (h (2, rows, P), c (2, rows, H)), rows = batch_sizes[0]:
    ``sources`` each step's input gates (2, n_t, 4H) with the bias, or (table (R, 4H), each step's rows of it
    (2, n_t), bias (2, 1, 4H)) for layer 0; ``w_hh`` and ``w_hr`` the ``panels`` of W_hh^T and W_hr^T. Returns the
    outputs (2, sum(batch_sizes), P), packed, and the final (h, c) of every row (a row that ends keeps its last
    state)."""
    function = _function()
    if isinstance(function, str):
        raise RuntimeError(f"the C step loop is not available: {function}")
    steps, packed = len(batch_sizes), sum(batch_sizes)
    proj, hidden = h.shape[2], c.shape[2]
    width = 4 * hidden
    if w_hh.shape != (2, -(-width // PANEL), proj, PANEL) or (w_hr is not None and w_hr.shape[2] != hidden):
        raise ValueError(f"weights {tuple(w_hh.shape)} are not the panels of a ({proj}, {width}) W_hh^T")
    if not (w_hh.is_contiguous() and (w_hr is None or w_hr.is_contiguous())):
        raise ValueError("the weights must be dense, as ``panels`` makes them")
    x, x_dir, x_rows, rows_dir, bias = _inputs(sources, width)
    h, c = (t.clone(memory_format=torch.contiguous_format) for t in (h, c))  # the loop's own, dense
    out = torch.empty(2, packed, proj)
    rows = batch_sizes[0]
    y, m = torch.empty(2, rows, w_hh.shape[1] * PANEL), torch.empty(2, rows, hidden)
    p = torch.empty(2, rows, w_hr.shape[1] * PANEL if w_hr is not None else 0)
    sizes = torch.tensor(batch_sizes, dtype=torch.int64)
    clip = [float("inf") if v is None else float(v) for v in (cell_clip, proj_clip)]
    status = function(
        steps,
        sizes.data_ptr(),
        proj,
        hidden,
        x.data_ptr(),
        x_dir,
        x_rows.data_ptr() if x_rows is not None else None,
        rows_dir,
        bias.data_ptr(),
        w_hh.data_ptr(),
        w_hr.data_ptr() if w_hr is not None else None,
        h.data_ptr(),
        c.data_ptr(),
        out.data_ptr(),
        packed,
        y.data_ptr(),
        m.data_ptr(),
        p.data_ptr(),
        *clip,
        torch.get_num_threads(),
    )
    if status != 0:
        raise RuntimeError(f"elmo_lstm_steps refused {steps} steps of {batch_sizes[:3]}... rows")
    return out, h, c


def _inputs(
    sources: Sequence[Tensor] | tuple[Tensor, Sequence[Tensor], Tensor], width: int
) -> tuple[Tensor, int, Tensor | None, int, Tensor]:
    """(x, its direction stride, x_rows or None, their direction stride, bias (2, 4H)) as the C loop reads them."""
    if isinstance(sources, tuple):  # layer 0: a table of input gates per word, the rows each step reads, the bias
        table, row_items, bias = sources
        x_rows, rows_dir = _run_of(row_items)
        return table.contiguous(), 0, x_rows, rows_dir, bias.reshape(2, width).contiguous()
    x, x_dir = _run_of(sources)
    return x, x_dir, None, 0, _zeros(width)


@lru_cache(maxsize=8)
def _zeros(width: int) -> Tensor:
    return torch.zeros(2, width)
