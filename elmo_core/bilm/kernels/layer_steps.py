"""The clipped recurrence a layer at a time, without a launch per gate per step: ``LayerCell``, CUDA's inference
cell (and the CPU's where asked for; its C kernels stay faster there).

Why: every published ELMo clips its cell and its projection, which cuDNN's LSTM cannot do, so the reference cell
(``lstm.LstmCell``) runs each step from Python as a dozen small kernels: the recurrent product, the four gates'
activations, the cell update, its clip, the projection and its clip. On a GPU each is a launch that costs more than
the arithmetic it starts, and the batch job ran at a ninth of what training the same shape does.

``LayerCell`` takes a whole layer in one ``run_steps`` call (its ``loop_rows`` is unbounded, so ``lstm._recurrence``
hands it every step at once) and runs it on fixed shapes:

* the rows padded to a bucket (``row_bucket``: 8, 12, 16, 24, 32, 48, ... each at most 1.5x the one before), the
  steps cut into chunks of 16, 8, 4, 2 and 1 (``chunk_sizes``: no step is padded; a chunk holds at most
  ``CHUNK_ROWS`` steps x rows, so the large buckets of short sentences run smaller chunks). A row keeps its state
  from the step its sentence ended (``torch.where`` on an ``alive`` mask): every real row gets the reference's numbers;
* a chunk is one product for its steps' input gates, then per step ``lstm_step``: the reference arithmetic
  (``lstm_math.reference_gates``) with the products in the chosen precision, as autocast runs the reference;
* ``compiled``: ``lstm_step`` compiled once by ``torch.compile`` (inductor: Triton on CUDA, C++ on a CPU), its gates,
  clips and mask fused around the two products;
* ``graphs`` (CUDA): each (row bucket, chunk size) captured once as a CUDA graph (``cuda_graphs``) and replayed; a
  chunk of 16 steps costs four launches (its input copied in, the replay, its outputs copied out, the mask) instead
  of some two hundred.

Precision: in fp32 the products and gates are float32 (the fixtures hold 1e-5); in bf16 the input gates, the
recurrent and the projection products are bfloat16 as under autocast, the pre-activations, gates and cell state
float32. The buffers, the graphs and the prepared weights are kept per layer and weight version (``cache``).
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import Tensor, nn

from elmo_core.bilm.inference import SharedRows
from elmo_core.bilm.kernels import cuda_graphs, switches
from elmo_core.bilm.kernels.cache import WeightCache
from elmo_core.bilm.lstm_math import reference_gates, stacked

CHUNK_SIZES = (16, 8, 4, 2, 1)  # steps per chunk, largest first: a layer of T steps is at most T // 16 + 4 replays
CHUNK_ROWS = 16_384  # at most steps x rows a chunk (but one step of any bucket): its input gates, 2 x 16,384 x 4H
# floats, are 2 GB at the original shape in fp32; a bucket's buffers (2 x 2 x 16,384 rows of inputs and outputs)
SMALLEST_BUCKET = 8

Clips = tuple[float | None, float | None]
Step = Callable[..., tuple[Tensor, Tensor, Tensor]]


def row_bucket(rows: int) -> int:
    """The padded row count of a batch of ``rows``: 8, 12, 16, 24, 32, 48, ... (at most a third of it padding)."""
    bucket = SMALLEST_BUCKET
    while bucket < rows:
        bucket = bucket * 3 // 2 if bucket & (bucket - 1) == 0 else bucket * 4 // 3
    return bucket


def allowed_chunks(rows: int) -> tuple[int, ...]:
    """The chunk sizes of a bucket of ``rows``: at most ``CHUNK_ROWS`` steps x rows, one step always."""
    return tuple(size for size in CHUNK_SIZES if size * rows <= max(CHUNK_ROWS, rows))


def chunk_sizes(steps: int, sizes: Sequence[int] = CHUNK_SIZES) -> list[int]:
    """``steps`` as chunks of ``sizes`` (descending, ending with 1), largest first (23 → 16, 4, 2, 1)."""
    chunks = []
    for size in sizes:
        chunks += [size] * (steps // size)
        steps %= size
    return chunks


def lstm_step(
    gx: Tensor,
    alive: Tensor,
    h: Tensor,
    c: Tensor,
    w_hh_t: Tensor,
    w_hr_t: Tensor | None,
    cell_clip: float | None,
    proj_clip: float | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """One step of every row: input gates gx (2, R, 4H) in the products' dtype, alive (R, 1), h (2, R, P), c (2, R, H)
    float32 ─► (h, c) of the rows (a row not alive keeps its own) and the step's output (2, R, P). ``lstm.LstmCell
    .step``'s arithmetic: z = gx + h W_hh, the gates in float32, h = clip(m W_hr)."""
    z = torch.baddbmm(gx, h.to(w_hh_t.dtype), w_hh_t).float()
    m, c_new = reference_gates(z, c, cell_clip)
    out = torch.bmm(m.to(w_hr_t.dtype), w_hr_t) if w_hr_t is not None else m
    if proj_clip is not None:
        out = out.clamp(-proj_clip, proj_clip)
    return torch.where(alive, out.to(h.dtype), h), torch.where(alive, c_new, c), out


def compile_available(device: torch.device) -> tuple[bool, str]:
    """Whether ``torch.compile`` can compile ``lstm_step`` for ``device`` here, and if not why: inductor writes Triton
    kernels on CUDA, C++ on a CPU (it needs a C++ compiler). ``ELMO_NO_COMPILE=1`` turns it off."""
    if switches.off("ELMO_NO_COMPILE"):
        return False, "ELMO_NO_COMPILE=1"
    if device.type == "cuda":
        from torch.utils._triton import has_triton

        return (True, "Triton") if has_triton() else (False, "no Triton in this torch")
    if device.type != "cpu":
        return False, f"not compiled for {device.type}"
    compiler = os.environ.get("CXX", "g++")
    return (True, f"C++ ({compiler})") if shutil.which(compiler) else (False, f"no C++ compiler ({compiler})")


@lru_cache(maxsize=1)
def compiled_step() -> Step:
    """``lstm_step`` compiled by ``torch.compile``, once per process: the row count symbolic (one compile serves every
    bucket), the whole step one graph."""
    return torch.compile(lstm_step, dynamic=True, fullgraph=True)


def describe(compiled: bool, graphs: bool, compile_note: str, graphs_note: str) -> str:
    """The kernels line's words for a ``LayerCell`` so configured."""
    how = f"compiled by torch.compile ({compile_note})" if compiled else f"PyTorch ops ({compile_note})"
    replay = "replayed as CUDA graphs per row bucket" if graphs else f"run from Python ({graphs_note})"
    return (
        "the clipped LSTM a layer at a time: rows padded to a bucket, steps in chunks of "
        f"{'/'.join(map(str, CHUNK_SIZES))}, each step the reference arithmetic {how}, the chunks {replay}"
    )


@dataclass(frozen=True)
class LayerWeights:
    """One layer's weights, both directions, in the products' dtype (prepared once per weight version)."""

    w_ih_t: Tensor  # (2, in, 4H)
    bias: Tensor  # (2, 1, 4H)
    w_hh_t: Tensor  # (2, P, 4H)
    w_hr_t: Tensor | None  # (2, H, P); None: no projection

    @classmethod
    def of(cls, pair: Sequence[nn.LSTM], dtype: torch.dtype) -> LayerWeights:
        def cast(name: str) -> Tensor:
            return stacked(pair, name).detach().transpose(1, 2).to(dtype).contiguous()

        bias = (stacked(pair, "bias_ih_l0") + stacked(pair, "bias_hh_l0")).detach().unsqueeze(1).to(dtype)
        w_hr_t = cast("weight_hr_l0") if pair[0].proj_size > 0 else None
        return cls(cast("weight_ih_l0"), bias, cast("weight_hh_l0"), w_hr_t)

    @property
    def out_dtype(self) -> torch.dtype:
        """The dtype of a step's output: the projection's, or float32 (m) without one (as the reference)."""
        return self.w_hr_t.dtype if self.w_hr_t is not None else torch.float32


class Chunk:
    """The buffers of ``steps`` steps of ``rows`` rows, and ``run``: the chunk on them (a CUDA graph's replay, or a
    call). x (2, steps, rows, in) the inputs, alive (steps, rows, 1), out (2, steps, rows, P) the outputs; h and c
    (the bucket's) carry the state in and out."""

    def __init__(self, bucket: Bucket, steps: int) -> None:
        weights, rows, like = bucket.weights, bucket.rows, bucket.weights.w_hh_t
        self.bucket, self.steps = bucket, steps
        self.x = like.new_zeros(2, steps, rows, bucket.in_dim)
        self.alive = torch.zeros(steps, rows, 1, dtype=torch.bool, device=like.device)
        self.out = like.new_zeros(2, steps, rows, like.shape[1], dtype=weights.out_dtype)
        self.run: Callable[[], None] = self._compute

    def _compute(self) -> None:
        """The input gates of every step in one product, then the steps; h, c updated in place."""
        b, steps = self.bucket, self.steps
        w = b.weights
        gx = torch.baddbmm(w.bias, self.x.view(2, steps * b.rows, -1), w.w_ih_t).view(2, steps, b.rows, -1)
        h, c = b.h, b.c
        for k in range(steps):
            h, c, out = b.step_fn(gx[:, k], self.alive[k], h, c, w.w_hh_t, w.w_hr_t, *b.clips)
            self.out[:, k].copy_(out)
        b.h.copy_(h)
        b.c.copy_(c)


class Bucket:
    """A layer's state buffers for ``rows`` padded rows, and its chunks (captured as CUDA graphs where ``graphs``)."""

    def __init__(
        self, weights: LayerWeights, clips: Clips, step_fn: Step, rows: int, in_dim: int, graphs: GraphPoolRef
    ) -> None:
        self.weights, self.clips, self.step_fn, self.rows, self.in_dim = weights, clips, step_fn, rows, in_dim
        hidden = weights.w_hh_t.shape[2] // 4
        like = weights.w_hh_t
        self.h = like.new_zeros(2, rows, like.shape[1], dtype=weights.out_dtype)
        self.c = like.new_zeros(2, rows, hidden, dtype=torch.float32)
        self.chunks = {size: Chunk(self, size) for size in allowed_chunks(rows)}
        pool = graphs.get()
        if pool is not None:
            saved = self.h.clone(), self.c.clone()

            def restore() -> None:
                self.h.copy_(saved[0])
                self.c.copy_(saved[1])

            for chunk in self.chunks.values():
                chunk.run = pool.capture(chunk._compute, restore)

    def load(self, h0: Tensor, c0: Tensor) -> None:
        """The state of a batch's rows into the buffers (the padding rows at zero)."""
        n = h0.shape[1]
        self.h[:, :n].copy_(h0)
        self.h[:, n:].zero_()
        self.c[:, :n].copy_(c0)
        self.c[:, n:].zero_()


class GraphPoolRef:
    """The ``cuda_graphs.GraphPool`` of a layer, made on first use; None where graphs are off."""

    def __init__(self, device: torch.device, on: bool) -> None:
        self.device, self.on, self.pool = device, on, None

    def get(self) -> cuda_graphs.GraphPool | None:
        if self.on and self.pool is None:
            self.pool = cuda_graphs.GraphPool(self.device)
        return self.pool


@dataclass
class LayerInput:
    """A step's source: the layer's packed input x (2, N, in) (every step's rows), from this step's first row."""

    x: Tensor
    start: int


class LayerCell:
    """One layer's steps, both directions, run a layer at a time (see the module docstring); ``lstm.Cell``."""

    loop_rows = sys.maxsize  # ``lstm._recurrence`` hands the whole layer to ``run_steps``

    def __init__(
        self,
        pair: Sequence[nn.LSTM],
        clips: Clips,
        *,
        dtype: torch.dtype,
        cache: WeightCache,
        compiled: bool,
        graphs: bool,
    ) -> None:
        self.clips = clips
        kind = f"layer-{dtype}-{'compiled' if compiled else 'eager'}-{'graphs' if graphs else 'calls'}"
        self.weights: LayerWeights = cache.get(pair, f"{kind}-weights", lambda: LayerWeights.of(pair, dtype))
        self.buckets: dict[tuple[int, int], Bucket] = cache.get(pair, f"{kind}-buckets", dict)
        self.step_fn: Step = compiled_step() if compiled else lstm_step
        device = pair[0].weight_hh_l0.device
        self.graphs: GraphPoolRef = cache.get(pair, f"{kind}-graphs", lambda: GraphPoolRef(device, graphs))

    def steps(self, x: Tensor, batch_sizes: list[int]) -> Iterator[LayerInput]:
        starts = [0, *torch.tensor(batch_sizes).cumsum(0).tolist()[:-1]]
        return (LayerInput(x, start) for start in starts)

    def word_steps(
        self, table: Tensor, ids: Tensor, batch_sizes: list[int], shared: SharedRows | None = None
    ) -> Iterator[LayerInput]:
        """Layer 0: the table's rows of each token (``ids`` (2, N), packed order) as the layer's input (a layer's
        input product runs per token here, so ``shared`` rows have nothing to keep)."""
        return self.steps(torch.stack([table.index_select(0, ids[0]), table.index_select(0, ids[1])]), batch_sizes)

    def step(self, source: LayerInput, h: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
        """One step of the rows still running (``lstm.Cell``; ``_recurrence`` hands this cell whole layers)."""
        _, h, c = self.run_steps([source], [h.shape[1]], h, c)
        return h, c

    def run_steps(
        self, sources: list[LayerInput], batch_sizes: list[int], h: Tensor, c: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The layer from ``sources[0]``'s step on: outputs (2, sum(batch_sizes), P) in packed order, and every row's
        final h (2, B, P) and c (2, B, H), B = batch_sizes[0]."""
        first = sources[0]
        x = first.x[:, first.start : first.start + sum(batch_sizes)]
        with torch.autocast(x.device.type, enabled=False):  # the dtypes are this cell's own, as autocast's would be
            return self._layer(x, batch_sizes, h, c)

    def _layer(self, x: Tensor, batch_sizes: list[int], h0: Tensor, c0: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        steps, rows = len(batch_sizes), row_bucket(batch_sizes[0])
        alive = torch.arange(rows)[None, :] < torch.tensor(batch_sizes)[:, None]  # (T, R): packed order when flat
        where = alive.flatten().nonzero().squeeze(1).to(x.device, non_blocking=True)
        alive = alive.unsqueeze(-1).to(x.device, non_blocking=True)
        dense = x.new_zeros(2, steps * rows, x.shape[-1], dtype=self.weights.w_ih_t.dtype)
        dense.index_copy_(1, where, x.to(dense.dtype))
        dense = dense.view(2, steps, rows, -1)
        bucket = self._bucket(rows, x.shape[-1])
        bucket.load(h0, c0)
        out = bucket.h.new_empty(2, steps, rows, bucket.h.shape[-1])
        t = 0
        for size in chunk_sizes(steps, tuple(bucket.chunks)):
            chunk = bucket.chunks[size]
            chunk.x.copy_(dense[:, t : t + size])
            chunk.alive.copy_(alive[t : t + size])
            chunk.run()
            out[:, t : t + size].copy_(chunk.out)
            t += size
        n = batch_sizes[0]
        return out.view(2, steps * rows, -1).index_select(1, where), bucket.h[:, :n].clone(), bucket.c[:, :n].clone()

    def _bucket(self, rows: int, in_dim: int) -> Bucket:
        bucket = self.buckets.get((rows, in_dim))
        if bucket is None:
            bucket = Bucket(self.weights, self.clips, self.step_fn, rows, in_dim, self.graphs)
            self.buckets[(rows, in_dim)] = bucket
        return bucket
