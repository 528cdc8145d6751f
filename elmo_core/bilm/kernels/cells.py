"""The CPU inference cell: one layer's LSTM step, both directions at once, without autograd.

It computes what ``lstm.LstmCell`` (the reference) computes, with the weights prepared once per weight version
(``cache.py``) instead of on every call:

* **fp32**: the weights stacked and transposed; the per-step products on weights packed for oneDNN where they are
  large enough to pay (``packed.py``), and then each step takes its input with the state in one product,
  ``[x_t; h] @ [W_ih; W_hh]`` as TensorFlow does (faster on the medium and original shapes, and no
  (2, N, 4H) tensor of input gates: 1 GB for a batch of 8,192 tokens of the original shape).
* **bf16**: bfloat16 weights with float32 accumulation, cell state and gate arithmetic; the g-gate rows scaled by 2
  so that one sigmoid serves all four gates (tanh(x) = 2 sigmoid(2x) - 1); each step's input always fused with
  the state (faster on the small shape than separate input gates).
* **int8**: as fp32, with every per-step product (input with state, recurrent, projection) on int8 weights with
  activations quantized per call (``int8.py``); layer 0's per-word input gates in bf16 where the CPU has bf16
  products (``word_gates_bf16``), else fp32; the gates and the state stay fp32.

The gate arithmetic of a step runs as one C loop where it could be built (``fused_gates.py``), else as PyTorch ops;
in fp32 a layer's steps run in one C call from the first step of ``loop_rows`` rows or fewer (``step_loop.py``).
Layer 0 reads its input gates per distinct word (``word_steps``): one product per word, not per token.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from elmo_core.bilm.inference import SharedRows
from elmo_core.bilm.kernels import fused_gates, step_loop
from elmo_core.bilm.kernels.cache import WeightCache
from elmo_core.bilm.kernels.int8 import Int8Weights
from elmo_core.bilm.kernels.packed import PackedWeights
from elmo_core.bilm.lstm_math import reference_gates, stacked


@dataclass
class GateRows:
    """A step's input gates as rows of the per-word table, which the C gate kernel reads in place."""

    table: Tensor  # (2U, 4H) products, without the bias
    rows: Tensor  # (2, rows) int64
    bias: Tensor  # (2, 1, 4H) float32, added by the kernel


@dataclass
class StepInput:
    """A step's input rows x_t (2, rows, in), for a cell that takes them with the state in one product."""

    x: Tensor


def _stacked(pair: Sequence[nn.LSTM], name: str) -> Tensor:
    return stacked(pair, name).detach()


def _plus(products: Tensor | Sequence[Tensor], add: Tensor) -> Tensor:
    """Per-direction products (rows, N) plus ``add`` (D, rows or 1, N), in float32, written into one (D, rows, N)
    tensor (no separate stack and add). A bf16 product is copied, then added to: one add with mixed dtypes is
    slower."""
    first = products[0]
    out = torch.empty(len(products), *first.shape, dtype=torch.float32)
    for d, y in enumerate(products):
        if y.dtype == torch.float32:
            torch.add(y, add[d], out=out[d])
        else:
            out[d].copy_(y).add_(add[d])
    return out


def _gates_fp32(z: Tensor, c: Tensor, hidden: int, cell_clip: float | None) -> tuple[Tensor, Tensor]:
    """The reference arithmetic (``lstm_math.reference_gates``) on float32 pre-activations z (2, rows, 4H)."""
    return reference_gates(z, c, cell_clip)


def _gates_one_sigmoid(z: Tensor, c: Tensor, hidden: int, cell_clip: float | None) -> tuple[Tensor, Tensor]:
    """The same from pre-activations whose g part is doubled: one sigmoid for all four (PyTorch's sigmoid is ~6x
    faster than its tanh on the CPU)."""
    s = torch.sigmoid(z)  # i, f, sigmoid(2 g), o
    g = s[..., 2 * hidden : 3 * hidden].mul(2.0).sub_(1.0)
    c = torch.addcmul(s[..., hidden : 2 * hidden] * c, s[..., :hidden], g)
    if cell_clip is not None:
        c = c.clamp_(-cell_clip, cell_clip)
    return torch.sigmoid(c * 2.0).mul_(2.0).sub_(1.0).mul_(s[..., 3 * hidden :]), c


def _products_into(gates: Tensor, start: int, x: Tensor, w_ih_t: Tensor) -> None:
    """x (rows, in) @ W_ih.T of each direction into ``gates[d, start : start + rows]`` (one product each, no copy)."""
    x = x.to(w_ih_t.dtype)
    for d in range(2):
        torch.mm(x, w_ih_t[d], out=gates[d, start : start + len(x)])


class CpuCell:
    """One layer's step for CPU inference in ``dtype`` (float32 or bfloat16); see the module docstring.

    ``min_packed`` is the size (elements per direction) from which a weight is packed for oneDNN, None for never;
    ``gate_kernel`` runs the gates in C. Both come from the ``Kernels`` the model was prepared with.
    """

    def __init__(
        self,
        pair: Sequence[nn.LSTM],
        clips: tuple[float | None, float | None],
        *,
        dtype: torch.dtype,
        cache: WeightCache,
        min_packed: int | None,
        gate_kernel: bool,
        int8: bool = False,
        c_loop: bool = False,
        word_gates_bf16: bool = False,
    ) -> None:
        self.hidden, (self.cell_clip, self.proj_clip) = pair[0].hidden_size, clips
        self.loop_rows = 0  # steps of at most this many rows run in one C call, with every step after them
        self.panels_hh = self.panels_hr = None
        self.dtype, self.gate_kernel = dtype, gate_kernel
        bf16 = dtype == torch.bfloat16
        self.g_scale = 0.5 if bf16 else 1.0  # bf16 weights carry the g-gate factor 2; the C loop undoes it
        self.gates = _gates_one_sigmoid if bf16 else _gates_fp32
        kind = "bf16" if bf16 else "int8" if int8 else "fp32"
        pack = Int8Weights if int8 else PackedWeights  # int8: the "packed" products are dynamic int8 ones
        self.w_ih_t, self.bias, self.w_hh_t, self.w_hr_t = cache.get(pair, kind, lambda: self._weights(pair))
        # int8 with the gate kernel on native bf16: layer 0's per-word input product in bf16, its weight made on first
        # use (only layer 0 reads words), its rows read by the C loop as bf16
        self.word_w_ih_t: Callable[[], Tensor] | None = None
        if word_gates_bf16 and gate_kernel:
            self.word_w_ih_t = lambda: cache.get(pair, "bf16-ih-words", lambda: self.w_ih_t.to(torch.bfloat16))
        # the projection's input comes from the C loop in bf16; without a projection m is h, kept float32
        self.m_dtype = torch.bfloat16 if bf16 and self.w_hr_t is not None else torch.float32

        def packed(name: str, elements: int, make_w_t: Callable[[], Tensor]) -> PackedWeights | Int8Weights | None:
            """The weight packed (or quantized) once (only that copy is kept), or None where bmm serves."""
            if min_packed is None or elements == 0 or elements < min_packed:
                return None
            return cache.get(pair, f"{kind}-{name}-packed", lambda: pack(make_w_t().transpose(1, 2)))

        hh, hr = self.w_hh_t[0].numel(), self.w_hr_t[0].numel() if self.w_hr_t is not None else 0
        self.packed_hh = packed("hh", hh, lambda: self.w_hh_t)
        self.packed_hr = packed("hr", hr, lambda: self.w_hr_t)
        self.packed_cat = packed("cat", self.w_ih_t[0].numel() + hh, self._input_and_recurrent)
        if c_loop and kind == "fp32":
            self.loop_rows = step_loop.rows(packed=self.packed_hh is not None or self.packed_cat is not None)
            self.panels_hh = cache.get(pair, "fp32-hh-panels", lambda: step_loop.panels(self.w_hh_t))
            if self.w_hr_t is not None:
                self.panels_hr = cache.get(pair, "fp32-hr-panels", lambda: step_loop.panels(self.w_hr_t))
        # bf16 always fuses the input into the step's product; fp32 only on packed weights (with bmm, one product
        # for every step's input gates is faster)
        self.fuses_input = bf16 or self.packed_cat is not None
        self.w_cat_t = (
            cache.get(pair, f"{kind}-cat", self._input_and_recurrent)
            if self.fuses_input and self.packed_cat is None
            else None
        )

    def _weights(self, pair: Sequence[nn.LSTM]) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """(W_ih.T (2, in, 4H), bias (2, 1, 4H) float32, W_hh.T (2, P, 4H), W_hr.T (2, H, P) or None) in ``dtype``,
        the g columns doubled in bf16 (sigmoid(2 z_g) gives tanh(z_g); a factor 2 is exact in bf16)."""
        scale = torch.ones(4 * self.hidden)
        if self.dtype == torch.bfloat16:
            scale[2 * self.hidden : 3 * self.hidden] = 2.0
        cast = lambda w: (w.transpose(1, 2) * scale).to(self.dtype).contiguous()  # noqa: E731
        bias = ((_stacked(pair, "bias_ih_l0") + _stacked(pair, "bias_hh_l0")) * scale).unsqueeze(1).float()
        w_hr_t = None
        if pair[0].proj_size > 0:
            w_hr_t = _stacked(pair, "weight_hr_l0").transpose(1, 2).to(self.dtype).contiguous()
        return cast(_stacked(pair, "weight_ih_l0")), bias, cast(_stacked(pair, "weight_hh_l0")), w_hr_t

    def _input_and_recurrent(self) -> Tensor:
        """[W_ih; W_hh].T (2, in + P, 4H): the weight of a step that takes its input with the state."""
        return torch.cat([self.w_ih_t, self.w_hh_t], dim=1)

    # --- what each step reads ----------------------------------------------------------------------------
    def steps(self, x: Tensor, batch_sizes: list[int]) -> Iterator[StepInput | Tensor]:
        """Per step, from packed inputs x (2, N, in): the input rows (fused cells) or the input gates with the
        bias (2, rows, 4H), all steps' in one product."""
        if self.fuses_input:
            return (StepInput(x_t) for x_t in x.split(batch_sizes, dim=1))
        return iter(self._input_gates(x).split(batch_sizes, dim=1))

    def word_steps(
        self, table: Tensor, ids: Tensor, batch_sizes: list[int], shared: SharedRows | None = None
    ) -> Iterator[GateRows | Tensor]:
        """Layer 0: the input gates of each distinct word once (both directions' in one flat (2R, 4H) table), then
        per step the rows its tokens take (``ids`` (2, N) rows of ``table``, packed order). ``shared``: the table's
        first rows are its chunk's shared words, whose gates are kept from the chunk's first pass."""
        w_ih_t = self.word_w_ih_t() if self.word_w_ih_t else self.w_ih_t
        flat, backward = self._word_gates(table, w_ih_t, shared)
        rows = ids + torch.tensor([[0], [backward]])  # the backward direction's rows follow the forward's
        if self.gate_kernel:  # the C loop adds the bias and reads the rows in place (bf16: half the memory)
            return (GateRows(flat, r, self.bias) for r in rows.split(batch_sizes, dim=1))
        return (
            _plus(flat.index_select(0, r.reshape(-1)).view(2, r.shape[1], -1), self.bias)
            for r in rows.split(batch_sizes, dim=1)
        )

    @staticmethod
    def _word_gates(table: Tensor, w_ih_t: Tensor, shared: SharedRows | None) -> tuple[Tensor, int]:
        """table (R, in) @ W_ih.T per direction, in W's dtype, without the bias: a flat (2 x rows, 4H) table and
        the first row of the backward direction's. With ``shared``, into the chunk's kept (2, capacity, 4H): the
        shared rows computed once (the chunk's first pass), then this pass's own after them."""
        if shared is None or len(table) > shared.capacity:
            flat = torch.bmm(table.to(w_ih_t.dtype).expand(2, *table.shape), w_ih_t)
            return flat.reshape(2 * len(table), -1), len(table)
        weight, gates = shared.kept.get(id(w_ih_t), (None, None))
        if weight is not w_ih_t or gates is None:  # the weight is held with its gates: its id cannot be reused
            gates = w_ih_t.new_empty(2, shared.capacity, w_ih_t.shape[2])
            _products_into(gates, 0, table[: shared.count], w_ih_t)
            shared.kept[id(w_ih_t)] = (w_ih_t, gates)
        _products_into(gates, shared.count, table[shared.count :], w_ih_t)
        return gates.view(2 * shared.capacity, -1), shared.capacity

    def _input_gates(self, x: Tensor) -> Tensor:
        """x (2, N, in) @ W_ih.T + bias ─► (2, N, 4H) float32."""
        if self.dtype == torch.float32:
            return torch.baddbmm(self.bias, x, self.w_ih_t)
        return torch.bmm(x.to(self.dtype), self.w_ih_t).float().add_(self.bias)

    # --- one step ------------------------------------------------------------------------------------------
    def step(self, source: StepInput | GateRows | Tensor, h: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
        """(h, c) of the rows still running ─► (projected and clipped h, float32 c)."""
        if isinstance(source, StepInput):
            m, c = self._cell(self._input_and_recurrent_products(source.x, h), c, self.bias)
        elif isinstance(source, GateRows):
            m, c = self._cell(self._recurrent_products(h), c, source.bias, source.table, source.rows)
        else:  # the step's input gates, bias included
            m, c = self._cell(self._recurrent_products(h), c, None, source)
        h = self._project(m)
        return (h.clamp(-self.proj_clip, self.proj_clip) if self.proj_clip is not None else h), c

    def run_steps(
        self, sources: list[StepInput | GateRows | Tensor], batch_sizes: list[int], h: Tensor, c: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The rest of the layer, from a step of at most ``loop_rows`` rows, in one C call (``step_loop``): the
        outputs (2, sum(batch_sizes), P) and every row's final (h, c)."""
        first = sources[0]
        if isinstance(first, GateRows):
            inputs: list[Tensor] | tuple = (first.table, [s.rows for s in sources], first.bias)  # type: ignore[union-attr]
        elif isinstance(first, StepInput):  # these steps' input gates in one product
            inputs = [torch.baddbmm(self.bias, torch.cat([s.x for s in sources], dim=1), self.w_ih_t)]  # type: ignore[union-attr]
        else:
            inputs = sources  # type: ignore[assignment]
        clips = {"cell_clip": self.cell_clip, "proj_clip": self.proj_clip}
        return step_loop.lstm_steps(inputs, batch_sizes, h, c, w_hh=self.panels_hh, w_hr=self.panels_hr, **clips)

    def _recurrent_products(self, h: Tensor) -> Tensor | list[Tensor]:
        h = h.to(self.dtype)
        return self.packed_hh.products(h) if self.packed_hh is not None else torch.bmm(h, self.w_hh_t)

    def _input_and_recurrent_products(self, x: Tensor, h: Tensor) -> Tensor | list[Tensor]:
        xh = torch.cat([x.to(self.dtype), h.to(self.dtype)], dim=-1)
        return self.packed_cat.products(xh) if self.packed_cat is not None else torch.bmm(xh, self.w_cat_t)

    def _cell(
        self,
        y: Tensor | list[Tensor],
        c: Tensor,
        bias: Tensor | None,
        x: Tensor | None = None,
        rows: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Pre-activations y + bias + x (x: input gates, or a table read at ``rows``) ─► (m, c')."""
        if self.gate_kernel:
            return fused_gates.lstm_gates(
                y, c, bias, x, x_rows=rows, g_scale=self.g_scale, cell_clip=self.cell_clip, m_dtype=self.m_dtype
            )
        return self.gates(_plus(y, bias if x is None else x), c, self.hidden, self.cell_clip)

    def _project(self, m: Tensor) -> Tensor:
        if self.w_hr_t is None:
            return m
        if self.packed_hr is not None:
            return torch.stack(self.packed_hr.products(m.to(self.dtype)))
        return torch.bmm(m.to(self.dtype), self.w_hr_t)
