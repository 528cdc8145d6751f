"""An LSTM layer's training window, both directions, as few autograd nodes: one per step (PyTorch's products, the
gate arithmetic forward and backward as C loops, ``lstm_gates.c``) and one for the window's input gates, where the
weight gradients of every step are taken at once. For training on a CPU.

Why: the main job's model (``mini``, 32 rows) spends its training step in per-operation overhead more than in
arithmetic. A step of the reference cell (``lstm.LstmCell``) is about ten autograd operations forward (the
recurrent product, chunk, three sigmoids, two tanhs, products, sum, the cell clip, the projection, its clip, the
casts autocast adds) and twice as many backward, each a pass over a (2, rows, 4H), (2, rows, H) or (2, rows, P)
tensor; 20 steps x 2 layers of them per window, and each step's backward makes two small weight-gradient products and
adds them up. Here a step is one node: forward, the recurrent product, one C loop for the gates and the cell clip,
the projection and its clip; backward, the clip's mask and the gates' gradients in C around the two products that
carry the gradient back a step. The recurrent and projection weights' gradients wait for the window's input-gate
node, whose backward runs after every step's (it feeds them all): there the gradient of the input gates is every
step's gate gradient side by side, so each weight gradient is one product over the window.

The numbers are the reference's to float rounding (``tests/test_trained_step.py``: values and gradients; the
exponential is lstm_gates.c's own). Both clips keep clamp's gradient exactly: zero past the clip, through within it
and at the boundary (TensorFlow's ``clip_by_value``). Under bf16 autocast the products run in bfloat16 on the
weights the cell cast once, as the reference's do; the cell state and the gate arithmetic stay float32.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from functools import lru_cache

import torch
from torch import Tensor

from elmo_core.bilm.kernels import fused_gates

# Below this many cells a step's gate loops run on one thread. Lower than inference's threshold: the forward loop
# is bound by its exponentials, and at the main job's 2 x 32 x 256 cells two threads took it from 34 to 19 us.
PARALLEL_CELLS = 1 << 12


@lru_cache(maxsize=1)
def _functions() -> tuple[ctypes._CFuncPtr, ctypes._CFuncPtr, ctypes._CFuncPtr] | str:
    """The C gate forward, gate backward and clip backward, or why there are none (a string)."""
    library = fused_gates.library()
    if isinstance(library, str):
        return library
    forward, backward = library.elmo_train_gates_forward, library.elmo_train_gates_backward
    clip_backward = library.elmo_clip_backward
    pointer, i64, flt, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
    forward.argtypes = [pointer] * 6 + [i64, i64, flt, i32, i32, i32]
    backward.argtypes = [pointer] * 8 + [i64, i64, flt, i32, i32, i32]
    clip_backward.argtypes = [pointer] * 3 + [i64, flt, i32]
    forward.restype = backward.restype = clip_backward.restype = ctypes.c_int
    return forward, backward, clip_backward


def available() -> bool:
    """The C loops are built and loaded here (built on the first call), so training can run its steps here."""
    return not isinstance(_functions(), str)


def describe() -> str:
    """'yes' or 'no (why)', for the training log."""
    functions = _functions()
    return f"no ({functions})" if isinstance(functions, str) else "yes"


def _threads(cells: int) -> int:
    return torch.get_num_threads() if cells >= PARALLEL_CELLS else 1


def _bound(clip: float | None) -> float:
    return float("inf") if clip is None else float(clip)


@dataclass
class _Record:
    """What the window's steps leave for its weight gradients: each step's state input and cell output (forward),
    and the gradient of its projection (backward, which runs the steps in reverse)."""

    h: list[Tensor] = field(default_factory=list)
    m: list[Tensor] = field(default_factory=list)
    dp: list[Tensor | None] = field(default_factory=list)


class _InputGates(torch.autograd.Function):
    """(x, bias, W_ih; W_hh, W_hr) ─► every step's input gates, (2, N, 4H). Its backward takes the gradients of all
    five: the last two from the steps' records, each in one product."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, x: Tensor, bias: Tensor, w_ih: Tensor, w_hh: Tensor, w_hr: Tensor | None, record: _Record
    ) -> Tensor:
        dtype = w_ih.dtype
        x_in = x.to(dtype)
        ctx.save_for_backward(x_in, w_ih)
        ctx.record, ctx.dtypes, ctx.projects = record, (x.dtype, bias.dtype), w_hr is not None
        return torch.baddbmm(bias.to(dtype), x_in, w_ih)

    @staticmethod
    def backward(ctx, dgx: Tensor | None) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        if dgx is None:
            return None, None, None, None, None, None
        x_in, w_ih = ctx.saved_tensors
        record: _Record = ctx.record
        dgx = dgx.contiguous()
        dx = torch.bmm(dgx, w_ih.transpose(1, 2)).to(ctx.dtypes[0]) if ctx.needs_input_grad[0] else None
        dbias = dgx.sum(1, keepdim=True).to(ctx.dtypes[1]) if ctx.needs_input_grad[1] else None
        dw_ih = torch.bmm(x_in.transpose(1, 2), dgx) if ctx.needs_input_grad[2] else None
        dw_hh = torch.bmm(torch.cat(record.h, dim=1).transpose(1, 2), dgx) if ctx.needs_input_grad[3] else None
        dw_hr = None
        if ctx.projects and ctx.needs_input_grad[4]:
            dp = [d if d is not None else torch.zeros(h.shape, dtype=dgx.dtype) for d, h in zip(record.dp, record.h)]
            dw_hr = torch.bmm(torch.cat(record.m, dim=1).transpose(1, 2), torch.cat(dp, dim=1))
        record.h.clear()  # the window's memory goes with its graph
        record.m.clear()
        record.dp.clear()
        return dx, dbias, dw_ih, dw_hh, dw_hr, None


class _Step(torch.autograd.Function):
    """(gx, h, c) ─► (h', c') on the window's weights (W_hr None: no projection, h' is the clipped m)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        gx: Tensor,
        h: Tensor,
        c: Tensor,
        w_hh: Tensor,
        w_hr: Tensor | None,
        cell_clip: float,
        proj_clip: float,
        record: _Record,
    ) -> tuple[Tensor, Tensor]:
        gates_forward = _functions()[0]  # type: ignore[index]
        dtype = w_hh.dtype  # the products' dtype: the cell cast its weights to autocast's once
        h_in, c = h.to(dtype).contiguous(), c.contiguous()
        z = torch.baddbmm(gx, h_in, w_hh)
        hidden = c.shape[-1]
        rows = c.numel() // hidden
        c_new, c_raw = torch.empty_like(c), torch.empty_like(c)
        m = torch.empty(c.shape, dtype=dtype if w_hr is not None else torch.float32)  # as the reference's gates give
        activated = torch.empty(z.shape, dtype=torch.float32)
        gates_forward(
            z.data_ptr(), c.data_ptr(), c_new.data_ptr(), m.data_ptr(), activated.data_ptr(), c_raw.data_ptr(),
            rows, hidden, cell_clip, int(dtype == torch.bfloat16), int(m.dtype == torch.bfloat16),
            _threads(rows * hidden),
        )  # fmt: skip
        projected = torch.bmm(m, w_hr) if w_hr is not None else m
        ctx.save_for_backward(activated, c, c_raw, c_new, projected, w_hh, w_hr)
        ctx.clips, ctx.h_dtype, ctx.record, ctx.index = (cell_clip, proj_clip), h.dtype, record, len(record.h)
        record.h.append(h_in)
        record.m.append(m)
        record.dp.append(None)
        ctx.set_materialize_grads(False)
        return projected.clamp(-proj_clip, proj_clip), c_new

    @staticmethod
    def backward(ctx, dh: Tensor | None, dc: Tensor | None) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        _, gates_backward, clip_backward = _functions()  # type: ignore[misc]
        activated, c, c_raw, c_new, projected, w_hh, w_hr = ctx.saved_tensors
        cell_clip, proj_clip = ctx.clips
        dtype = w_hh.dtype
        hidden = c.shape[-1]
        rows = c.numel() // hidden
        if dh is None:
            dm = torch.zeros(c.shape, dtype=projected.dtype if w_hr is None else dtype)
        else:
            dh = dh.to(projected.dtype).contiguous()
            dp = torch.empty_like(dh)
            p_bf16 = int(projected.dtype == torch.bfloat16)
            clip_backward(projected.data_ptr(), dh.data_ptr(), dp.data_ptr(), dp.numel(), proj_clip, p_bf16)
            ctx.record.dp[ctx.index] = dp  # for the window's W_hr gradient
            dm = torch.bmm(dp, w_hr.transpose(1, 2)) if w_hr is not None else dp
        dc = dc.contiguous().float() if dc is not None else torch.zeros(c.shape)  # the C loop reads one
        dz = torch.empty(activated.shape, dtype=dtype)
        dc_prev = torch.empty_like(c)
        gates_backward(
            activated.data_ptr(), c.data_ptr(), c_raw.data_ptr(), c_new.data_ptr(), dm.data_ptr(), dc.data_ptr(),
            dz.data_ptr(), dc_prev.data_ptr(), rows, hidden, cell_clip, int(dtype == torch.bfloat16),
            int(dm.dtype == torch.bfloat16), _threads(rows * hidden),
        )  # fmt: skip
        dh_prev = torch.bmm(dz, w_hh.transpose(1, 2)).to(ctx.h_dtype) if ctx.needs_input_grad[1] else None
        return dz, dh_prev, dc_prev, None, None, None, None, None


class Window:
    """One layer's training window on a CPU, both directions: ``input_gates`` of every step (one product), then
    ``step`` once per time step. Made by ``lstm.LstmCell`` from its stacked, transposed (and autocast-cast) weights:
    bias (2, 1, 4H), W_ih (2, in, 4H), W_hh (2, P, 4H), W_hr (2, H, P) or None."""

    def __init__(
        self,
        x: Tensor,
        bias: Tensor,
        w_ih: Tensor,
        w_hh: Tensor,
        w_hr: Tensor | None,
        cell_clip: float | None,
        proj_clip: float | None,
    ) -> None:
        if w_hh.dtype not in (torch.float32, torch.bfloat16) or w_ih.dtype != w_hh.dtype:
            raise TypeError(f"the weights must be float32 or bfloat16, alike: {w_ih.dtype}, {w_hh.dtype}")
        if w_hr is not None and w_hr.dtype != w_hh.dtype:
            raise TypeError(f"the weights must have one dtype, got {w_hh.dtype} and {w_hr.dtype}")
        if x.device.type != "cpu":
            raise ValueError(f"the training window runs on the CPU, not {x.device}")
        self.record = _Record()
        self.clips = (_bound(cell_clip), _bound(proj_clip))
        with torch.autocast("cpu", enabled=False):  # the products run in the weights' dtype, which autocast chose
            self.input_gates = _InputGates.apply(x, bias, w_ih, w_hh, w_hr, self.record)
        # the steps read the weights; their gradients are the input-gate node's (over the whole window)
        self.w_hh, self.w_hr = w_hh.detach(), (w_hr.detach() if w_hr is not None else None)

    def step(self, gx: Tensor, h: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
        """One time step of the rows still running: gx a slice of ``input_gates`` (2, rows, 4H), h (2, rows, P),
        c (2, rows, H) float32 ─► (h' projected and clipped, in the weights' dtype; c' clipped, float32)."""
        if c.dtype != torch.float32 or gx.shape[:-1] != c.shape[:-1] or gx.shape[-1] != 4 * c.shape[-1]:
            raise ValueError(f"gx {tuple(gx.shape)} and c {tuple(c.shape)} {c.dtype}: need (..., 4H), (..., H) fp32")
        with torch.autocast("cpu", enabled=False):
            return _Step.apply(gx, h, c, self.w_hh, self.w_hr, *self.clips, self.record)
