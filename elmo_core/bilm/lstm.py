"""LSTM with projection and clipping: the biLM's L layers, both directions, as bilm-tf computes them.

``ElmoLstm`` holds each LSTM's parameters in a ``torch.nn.LSTM(proj_size=P)`` (gates i, f, g, o; ``bias_hh`` holds
TensorFlow's constant forget-gate +1). With clips (every published model) a layer is a ``Cell`` stepped by
``_recurrence``: ``LstmCell`` here (the reference: training, CUDA, any call with gradients) or a kernel's
(``kernels/``); without, ``nn.LSTM`` itself (cuDNN on GPU). ``model.BiLM`` runs it between the token encoder and
the output layers.

Both directions of a layer share one packing (the same lengths) and run together: weights (2, ...), state
(2, rows, ...), one batched product and one set of element-wise ops per step. Packed data is time-major, rows
sorted longest first: step t holds the first ``batch_sizes[t]`` rows, so ended rows drop out, keeping their state.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

from elmo_core.bilm.inference import LstmState, SharedRows
from elmo_core.bilm.kernels.trained_step import Window
from elmo_core.bilm.lstm_math import reference_gates, stacked
from elmo_core.bilm.packing import Packing
from elmo_core.bilm.weights import forget_gate_bias
from elmo_core.config import LstmConfig

Clips = tuple[float | None, float | None]  # (cell_clip, proj_clip)


class Cell(Protocol):
    """One layer's step, both directions: ``LstmCell`` here, or a kernel's (``kernels.cells.CpuCell``)."""

    loop_rows: int  # from the first step of at most this many rows, ``run_steps`` runs the rest in one call

    def steps(self, x: Tensor, batch_sizes: list[int]) -> Iterable[Any]: ...
    def word_steps(
        self, table: Tensor, ids: Tensor, batch_sizes: list[int], shared: SharedRows | None = None
    ) -> Iterable[Any]: ...
    def step(self, source: Any, h: Tensor, c: Tensor) -> tuple[Tensor, Tensor]: ...
    def run_steps(self, sources: list[Any], batch_sizes: list[int], h: Tensor, c: Tensor) -> tuple[Tensor, ...]: ...


def _at_least_fp32(t: Tensor) -> Tensor:
    """Half-precision tensors up to float32 (the cell state and the gate arithmetic never run in bf16)."""
    return t.float() if t.dtype in (torch.bfloat16, torch.float16) else t


class LstmCell:
    """TensorFlow's ``LSTMCell(num_proj, cell_clip, proj_clip)`` for one layer, both directions: the reference
    arithmetic, differentiable (training, CUDA, any call with gradients). Under autocast the products run in its
    dtype and the gates and the cell state in float32. ``one_node``: each step runs as one autograd node, these
    products with the gates in C forward and backward, and the weight gradients come once per window
    (``kernels.trained_step.Window``; CPU tensors): the same numbers to float rounding."""

    loop_rows = 0  # every step from Python

    def __init__(self, pair: Sequence[nn.LSTM], clips: Clips, one_node: bool = False) -> None:
        self.cell_clip, self.proj_clip = clips
        self.one_node = one_node
        self.window: Window | None = None
        self.bias = (stacked(pair, "bias_ih_l0") + stacked(pair, "bias_hh_l0")).unsqueeze(1)  # (2, 1, 4H)
        self.w_ih_t = stacked(pair, "weight_ih_l0").transpose(1, 2)  # (2, in, 4H)
        self.w_hh_t = stacked(pair, "weight_hh_l0").transpose(1, 2)  # (2, P, 4H)
        self.w_hr_t = stacked(pair, "weight_hr_l0").transpose(1, 2) if pair[0].proj_size > 0 else None  # (2, H, P)
        device = pair[0].weight_ih_l0.device.type
        if torch.is_autocast_enabled(device):
            # autocast caches the casts of parameters only, not of these stacked weights: cast them once per call
            # of the layer, not at every time step (differentiable, so training still updates the float32 masters)
            dtype = torch.get_autocast_dtype(device)
            self.w_ih_t, self.w_hh_t = self.w_ih_t.to(dtype), self.w_hh_t.to(dtype)
            self.w_hr_t = self.w_hr_t.to(dtype) if self.w_hr_t is not None else None

    def steps(self, x: Tensor, batch_sizes: list[int]) -> Iterable[Tensor]:
        """Each step's input gates (2, rows, 4H), from packed inputs x (2, N, in): one product for all steps. One
        split, not a slice per step: a slice's gradient would zero-fill the whole tensor at every step."""
        if self.one_node:
            self.window = Window(x, self.bias, self.w_ih_t, self.w_hh_t, self.w_hr_t, self.cell_clip, self.proj_clip)
            return self.window.input_gates.split(batch_sizes, dim=1)
        return torch.baddbmm(self.bias, x, self.w_ih_t).split(batch_sizes, dim=1)

    def word_steps(
        self, table: Tensor, ids: Tensor, batch_sizes: list[int], shared: SharedRows | None = None
    ) -> Iterator[Tensor]:
        """The same for layer 0 without gradients: the input gates of each distinct word (``table`` (U, in)) once,
        then per step the rows its tokens take (``ids`` (2, N), packed order). ``shared``: not kept here; every row of
        the table is computed, the chunk's shared rows too (at most as many again, ``inference.shared_first``)."""
        gates = torch.baddbmm(self.bias, table.expand(2, *table.shape), self.w_ih_t).reshape(2 * table.shape[0], -1)
        rows = ids + torch.tensor([[0], [table.shape[0]]], device=ids.device)  # backward rows follow the forward's
        return (gates.index_select(0, r.reshape(-1)).view(2, r.shape[1], -1) for r in rows.split(batch_sizes, dim=1))

    def step(self, gx: Tensor, h: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
        """One time step of the rows still running: (h, c) ─► (projected and clipped h, c)."""
        if self.window is not None:
            return self.window.step(gx, h, c)
        m, c = self.gates(_at_least_fp32(torch.baddbmm(gx, h, self.w_hh_t)), c)
        h = torch.bmm(m, self.w_hr_t) if self.w_hr_t is not None else m
        return (h.clamp(-self.proj_clip, self.proj_clip) if self.proj_clip is not None else h), c

    def gates(self, z: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
        """z (2, rows, 4H) ─► (m, c): ``lstm_math.reference_gates``, the reference arithmetic."""
        return reference_gates(z, c, self.cell_clip)


def _recurrence(
    cell: Cell, sources: Iterable[Any], batch_sizes: list[int], h0: Tensor, c0: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """One layer over packed time-major rows: the outputs (2, N, P) and each row's final h (2, B, P), c (2, B, H),
    rows in the packing's sorted order."""
    h, c, sources = h0, _at_least_fp32(c0), iter(sources)
    outputs, ended_h, ended_c = [], [], []  # ended: final states of rows that ended, the last-ending first
    for t, (n, source) in enumerate(zip(batch_sizes, sources)):
        if n < h.shape[1]:
            ended_h.append(h[:, n:])
            ended_c.append(c[:, n:])
            h, c = h[:, :n], c[:, :n]
        if n <= cell.loop_rows:  # this step and the rest in one call (``kernels.step_loop``)
            out, h, c = cell.run_steps([source, *sources], batch_sizes[t:], h, c)
            outputs.append(out)
            break
        h, c = cell.step(source, h, c)
        outputs.append(h)
    h_n = torch.cat([h, *reversed(ended_h)], dim=1) if ended_h else h
    c_n = torch.cat([c, *reversed(ended_c)], dim=1) if ended_c else c
    return torch.cat(outputs, dim=1), h_n, c_n


def _unclipped_layer(
    pair: Sequence[nn.LSTM], x: Tensor, batch_sizes: list[int], h0: Tensor, c0: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """``nn.LSTM`` (cuDNN on GPU) per direction, for models that clip nothing."""
    outs, hs, cs = [], [], []
    for direction, lstm in enumerate(pair):
        packed = PackedSequence(x[direction], torch.tensor(batch_sizes))
        out, (h, c) = lstm(
            packed, (h0[direction : direction + 1].contiguous(), c0[direction : direction + 1].contiguous())
        )
        outs.append(out.data)
        hs.append(h[0])
        cs.append(c[0])
    return torch.stack(outs), torch.stack(hs), torch.stack(cs)


class ElmoLstm(nn.Module):
    """L layers of forward and backward LSTMs with projection, clipping and the residual for layers ≥ 1."""

    def __init__(self, config: LstmConfig) -> None:
        super().__init__()
        self.config = config
        p, h = config.projection_dim, config.dim
        proj = p if p < h else 0

        def layers() -> nn.ModuleList:
            return nn.ModuleList(nn.LSTM(p, h, proj_size=proj, batch_first=True) for _ in range(config.n_layers))

        self.forward_layers = layers()
        self.backward_layers = layers()
        for lstm in self.all_layers():
            # TensorFlow's constant forget-gate +1, held as a buffer: every parameter of the biLM trains, as in
            # AllenNLP (code that optimizes or counts ``parameters()`` sees no frozen one); its state-dict key stays
            del lstm.bias_hh_l0
            lstm.register_buffer("bias_hh_l0", forget_gate_bias(h))
            lstm._init_flat_weights()  # nn.LSTM's own forward (and cuDNN) reads the buffer, not the deleted parameter

    def all_layers(self) -> list[nn.LSTM]:
        return [*self.forward_layers, *self.backward_layers]

    def zero_state(self, batch: int, device: torch.device, dtype: torch.dtype = torch.float32) -> LstmState:
        cfg = self.config
        return (
            torch.zeros(cfg.n_layers, 2, batch, cfg.projection_dim, device=device, dtype=dtype),
            torch.zeros(cfg.n_layers, 2, batch, cfg.dim, device=device, dtype=dtype),
        )

    def forward(
        self,
        table: Tensor,
        ids: Tensor,
        packing: Packing,
        state: LstmState,
        *,
        make_cell: Callable[[Sequence[nn.LSTM], Clips], Cell] | None = LstmCell,
        dropout: float = 0.0,
        shared: SharedRows | None = None,
    ) -> tuple[list[Tensor], LstmState]:
        """Token embeddings ``table`` (U, P) read at ``ids`` (2, N) (each direction's packed steps) ─► packed outputs
        (2, N, P) per layer, and the new state (rows in the batch's order; rows with nothing to read keep theirs).
        ``shared``: the table's first rows are a chunk's shared words (``inference.SharedRows``), for layer 0.

        ``make_cell`` makes each layer's cell (``LstmCell``, a kernel's); None runs PyTorch's ``nn.LSTM`` (a model
        without clips, as ``kernels.choose`` decides). Layer 0 computes its input gates once per distinct token
        where nothing needs the per-token inputs (no gradients, no dropout). ``dropout`` (training) applies to each
        layer's input; the residual adds the dropped input, as TF's ``DropoutWrapper`` inside a ``ResidualWrapper``.
        """
        cfg, batch_sizes = self.config, packing.batch_sizes
        order, rank = packing.order.to(table.device), packing.rank.to(table.device)
        h_state, c_state = state[0][:, :, order], state[1][:, :, order]  # the packing's sorted row order
        dropping = dropout > 0.0 and self.training
        x: Tensor | None = None  # (2, N, in): the layer's packed input; None while layer 0 reads the table
        outputs, new_h, new_c = [], [], []
        for layer in range(cfg.n_layers):
            pair = (self.forward_layers[layer], self.backward_layers[layer])
            if x is None and (make_cell is None or dropping or torch.is_grad_enabled()):
                x = torch.stack([table.index_select(0, ids[0]), table.index_select(0, ids[1])])
            if x is not None and dropping:
                x = nn.functional.dropout(x, dropout, training=True)
            if make_cell is None:
                out, h, c = _unclipped_layer(pair, x, batch_sizes, h_state[layer], c_state[layer])  # type: ignore[arg-type]
            else:
                cell = make_cell(pair, (cfg.cell_clip, cfg.proj_clip))
                sources = (
                    cell.steps(x, batch_sizes) if x is not None else cell.word_steps(table, ids, batch_sizes, shared)
                )
                out, h, c = _recurrence(cell, sources, batch_sizes, h_state[layer], c_state[layer])
            if layer > 0 and cfg.use_skip_connections:
                out = out + x  # the residual changes the output only, never the recurrent state
            outputs.append(out)
            new_h.append(h)
            new_c.append(c)
            x = out
        h, c = torch.stack(new_h)[:, :, rank], torch.stack(new_c)[:, :, rank]
        ran = packing.real_lengths > 0
        if not bool(ran.all()):
            ran = ran.to(table.device)[:, None]
            h, c = torch.where(ran, h, state[0]), torch.where(ran, c, state[1])
        return outputs, (h, c)
