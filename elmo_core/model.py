"""The ELMo biLM, top to bottom in the order it computes.

    char ids (B, T, C) ─► CharCNN ─► Highway × k ─► projection            = token embedding e (B, T, P)
                      ─► ElmoLstm: L layers × {forward, backward}, each an LSTM with a projection,
                         cell/projection clipping and (layers ≥ 1) a residual    = (B, T, P) per layer/direction
                      ─► activations: [e;e], [fwd_1;bwd_1], …, [fwd_L;bwd_L]     = L+1 tensors (B, T, 2P)
                      ─► ScalarMix (optional)                                    = (B, T, 2P)

Shapes: B batch rows, T time steps, C chars per token, F CNN filters, H LSTM cell, P projection, N real tokens.
The numerics follow bilm-tf exactly (``docs/elmo-format.md`` §4); the TensorFlow weight layout is converted in
``weights.py`` (``from_pretrained``/``save_pretrained`` call it), never here.

State is explicit: ``BiLM.forward`` takes an optional LSTM state and returns the new one beside the layers. Whoever
wants bilm-tf's stateful protocol carries it (``inference.StateCarry``); the model keeps nothing between calls.
Running over many sentences (length-sorted batches, the per-unit token cache) lives in ``inference.py``.

Parameters of each LSTM are held by a ``torch.nn.LSTM(proj_size=P)`` in PyTorch's layout (gates i, f, g, o;
``bias_hh`` holds TensorFlow's constant forget-gate +1 and is frozen). With clipping (every published model)
the recurrence runs in ``_clipped_bilstm``: one product for the input-to-gates of all steps, then one recurrent
product per step over the rows still running (packed sequences: no work on padding), both directions at once.
Without clipping ``nn.LSTM`` itself runs (cuDNN on GPU).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

from elmo_core import fused_gates, inference
from elmo_core.chars import BOS_TOKEN, EOS_TOKEN, N_CHARS, PAD_ID, tokens_to_char_array
from elmo_core.config import CharCNNConfig, LstmConfig, ModelConfig
from elmo_core.errors import WeightFileError
from elmo_core.packed import PackedWeights, worth_packing
from elmo_core.weights import forget_gate_bias, read_model_files, write_model_files

# (h, c) of every layer and direction: h (L, 2, B, P), c (L, 2, B, H); direction 0 forward, 1 backward.
LstmState = tuple[Tensor, Tensor]


# CPU inference keeps derived weights (bf16 casts, stacked, packed) between calls; ELMO_NO_WEIGHT_CACHE=1 runs the
# reference arithmetic instead (how the tests compare the two).
CACHE_INFERENCE_WEIGHTS = os.environ.get("ELMO_NO_WEIGHT_CACHE", "") != "1"

Derived = TypeVar("Derived")


def _cached(modules: Sequence[nn.Module], kind: str, make: Callable[[], Derived]) -> Derived:
    """Derived weights (stacked, cast, packed) kept on the first module until one of the modules' weights changes."""
    key = tuple((p.data_ptr(), p._version) for module in modules for p in module.parameters())
    cache = modules[0].__dict__.setdefault("_derived_weights", {})
    if kind not in cache or cache[kind][0] != key:
        cache[kind] = (key, make())
    return cache[kind][1]


def _cpu_inference(device: torch.device) -> bool:
    """Inference on the CPU with derived weights allowed: where the kernels with cached weights run."""
    return device.type == "cpu" and not torch.is_grad_enabled() and CACHE_INFERENCE_WEIGHTS


def _cpu_autocast_bf16() -> bool:
    return torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16


def _inference_params(module: nn.Linear | nn.Conv1d) -> tuple[Tensor, Tensor | None]:
    """(weight, bias) of ``module``; for CPU inference under bf16 autocast, their bf16 casts made once per weight
    version. Autocast would cast the same weights again on every call (about 2.5% of a small-shape bf16 call);
    given bf16 it casts nothing, so the numbers are the same."""
    weight, bias = module.weight, module.bias
    if not (_cpu_inference(weight.device) and _cpu_autocast_bf16()):
        return weight, bias
    return _cached(
        (module,),
        "bf16",
        lambda: (weight.detach().to(torch.bfloat16), bias.detach().to(torch.bfloat16) if bias is not None else None),
    )


# ----- 1. context-independent token encoder ---------------------------------------------------------


class CharCNN(nn.Module):
    """(N, C) char ids ─► (N, F): embed chars, one 1-D conv per width, max over positions, activation."""

    def __init__(self, config: CharCNNConfig) -> None:
        super().__init__()
        dim = config.embedding.dim
        # Row 0 is the padding-token row of the +1 scheme: always zero, never trained.
        self.char_embedding = nn.Embedding(N_CHARS, dim, padding_idx=0)
        self.convs = nn.ModuleList(nn.Conv1d(dim, count, width) for width, count in config.filters)
        self.max_width = max(width for width, _ in config.filters)
        self.activation = torch.relu if config.activation == "relu" else torch.tanh

    def forward(self, char_ids: Tensor) -> Tensor:
        # Positions after a word's end-of-word marker hold the in-word padding id, and every window lying
        # wholly in that padding gives the same value. Convolving up to the longest word plus the widest
        # filter keeps at least one such window, so the max over positions is unchanged and the work halves.
        content = (char_ids != PAD_ID) * torch.arange(1, char_ids.shape[-1] + 1, device=char_ids.device)
        keep = int(content.amax()) + self.max_width if char_ids.numel() else char_ids.shape[-1]
        if keep < char_ids.shape[-1]:
            char_ids = char_ids[..., :keep]
        # (N, D_c, 1, C) as a view of the (N, C, D_c) embeddings: channels-last, the layout oneDNN's convolution
        # wants, and the max over positions then runs across whole filter vectors. Measured against Conv1d on the
        # (N, D_c, C) transpose: 2.1x (fp32) and 1.85x (bf16) faster without gradients, 1.4x with, the same values.
        x = self.char_embedding(char_ids).transpose(1, 2).unsqueeze(2)
        convolved = (
            nn.functional.conv2d(x, weight.unsqueeze(2), bias)
            for weight, bias in (_inference_params(conv) for conv in self.convs)
        )
        # bias is inside the max; the activation is monotone, so it commutes with the max. Same values either way:
        # with gradients max pooling (its backward scatters to the argmax) is faster than amax (an equality mask
        # over every position); without, amax is.
        if torch.is_grad_enabled():
            pooled = [nn.functional.max_pool2d(y, (1, y.shape[-1])).flatten(1) for y in convolved]
        else:
            pooled = [y.amax(dim=(-2, -1)) for y in convolved]
        return torch.cat([self.activation(p) for p in pooled], dim=-1)


class Highway(nn.Module):
    """y = t ⊙ relu(W_transform x) + (1 − t) ⊙ x with t = σ(W_carry x): σ(carry) gates the *transform*."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.carry = nn.Linear(width, width)
        self.transform = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        gate = torch.sigmoid(nn.functional.linear(x, *_inference_params(self.carry)))
        return gate * torch.relu(nn.functional.linear(x, *_inference_params(self.transform))) + (1.0 - gate) * x


class TokenEncoder(nn.Module):
    """(N, C) char ids ─► (N, P) token embeddings: char CNN, highway layers, linear projection."""

    def __init__(self, config: CharCNNConfig, projection_dim: int) -> None:
        super().__init__()
        self.char_cnn = CharCNN(config)
        n_filters = config.n_filters
        self.highways = nn.ModuleList(Highway(n_filters) for _ in range(config.n_highway))
        # bilm-tf creates the projection only when F != P
        self.projection = nn.Linear(n_filters, projection_dim) if n_filters != projection_dim else None

    def forward(self, char_ids: Tensor) -> Tensor:
        x = self.char_cnn(char_ids)
        for highway in self.highways:
            x = highway(x)
        if self.projection is None:
            return x
        return nn.functional.linear(x, *_inference_params(self.projection))


# ----- 2. LSTM with projection and clipping ---------------------------------------------------------


# Both directions of a layer share one packing (the same lengths), so they run together: weights stacked as
# (2, ...), state (2, rows, ...), one batched product and one set of element-wise ops per time step.
#
# The per-step arithmetic comes in three kernels, picked per run by ``lstm_cell``:
#   reference (training, CUDA, autocast): batched products and the gates as TensorFlow computes them,
#       autograd-friendly; under autocast the products run in bf16 and the gates are cast up (cell in float32);
#   fp32 inference (CPU, no autograd): the same arithmetic with the weights stacked and transposed once;
#   bf16 inference (CPU under precision "bf16"): bfloat16 weights made once, the g-gate rows scaled by 2 so that
#       one sigmoid serves all four gates (tanh(x) = 2 sigmoid(2x) - 1: PyTorch's sigmoid is ~6x faster than its
#       tanh on the CPU); accumulation, the cell state and the gate arithmetic stay float32.
# Both inference kernels run the per-step products on weights packed for oneDNN where that pays (``packed.py``),
# and, where the C gate kernel could be built (``fused_gates.py``), the gate arithmetic as one C loop per step.


def _at_least_fp32(t: Tensor) -> Tensor:
    """Half-precision tensors up to float32 (the cell state and the gate arithmetic never run in bf16)."""
    return t.float() if t.dtype in (torch.bfloat16, torch.float16) else t


def _stacked(pair: Sequence[nn.LSTM], name: str) -> Tensor:
    return torch.stack([getattr(lstm, name) for lstm in pair])


class _Cell:
    """The reference kernel: ``input_gates`` for all steps at once, then ``step`` per time step.

    The bf16 inference kernel, and the fp32 one on packed weights (``fuses_input``), instead take each step's input
    with the state in one product, ``[x_t; h] @ [W_ih; W_hh]`` as TensorFlow does, so no (2, N, 4H) tensor of
    input gates is materialised (bf16 with bmm: 10-18% faster on the small shape, the same on the original).
    """

    fuses_input = False
    gate_kernel = False  # whether steps run the C gate kernel (``fused_gates.py``); only it takes ``GateRows``
    w_cat_t: Tensor | None = None  # [W_ih; W_hh].T (2, in + P, 4H), for kernels that fuse the input

    def __init__(self, pair: Sequence[nn.LSTM], cell_clip: float | None, proj_clip: float | None) -> None:
        self.hidden, self.cell_clip, self.proj_clip = pair[0].hidden_size, cell_clip, proj_clip
        self.projects = pair[0].proj_size > 0
        self.w_ih_t, self.bias, self.w_hh_t, self.w_hr_t = self.weights(pair)
        device = pair[0].weight_ih_l0.device.type
        if not self.fuses_input and torch.is_autocast_enabled(device):
            # autocast caches the casts of parameters only, not of these stacked weights: cast them once per call
            # of the layer, not at every time step (differentiable, so training still updates the float32 masters)
            dtype = torch.get_autocast_dtype(device)
            self.w_ih_t, self.w_hh_t = self.w_ih_t.to(dtype), self.w_hh_t.to(dtype)
            self.w_hr_t = self.w_hr_t.to(dtype) if self.w_hr_t is not None else None

    def weights(self, pair: Sequence[nn.LSTM]) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """(W_ih.T (2, in, 4H), bias (2, 1, 4H), W_hh.T (2, P, 4H), W_hr.T (2, H, P) or None)."""
        bias = (_stacked(pair, "bias_ih_l0") + _stacked(pair, "bias_hh_l0")).unsqueeze(1)
        w_hr_t = _stacked(pair, "weight_hr_l0").transpose(1, 2) if self.projects else None
        return (
            _stacked(pair, "weight_ih_l0").transpose(1, 2),
            bias,
            _stacked(pair, "weight_hh_l0").transpose(1, 2),
            w_hr_t,
        )

    def input_gates(self, x: Tensor) -> Tensor:
        """x (2, N, in) ─► (2, N, 4H)."""
        return torch.baddbmm(self.bias, x, self.w_ih_t)

    def word_gates(self, table: Tensor, rows: Tensor) -> WordGates:
        """Layer 0's input gates once per row of ``table`` (U, in) (each distinct word), both directions' in one
        table (2U, 4H); ``rows`` (2, N) says which table row each packed position takes."""
        return WordGates(self.input_gates(table.expand(2, *table.shape)).reshape(2 * table.shape[0], -1), rows)

    def recurrent(self, gx: Tensor, h: Tensor) -> Tensor:
        return torch.baddbmm(gx, h, self.w_hh_t)

    def recurrent_input(self, x: Tensor, h: Tensor) -> Tensor:
        return torch.baddbmm(self.bias, torch.cat([x, h], dim=-1), self.w_cat_t)

    def project(self, m: Tensor) -> Tensor:
        return torch.bmm(m, self.w_hr_t) if self.w_hr_t is not None else m

    def gates(self, z: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
        """z (2, rows, 4H) in gate order i, f, g, o ─► (m, c): TF ``LSTMCell`` with the cell clipped."""
        hidden = self.hidden
        sig = torch.sigmoid(z)
        c = sig[..., hidden : 2 * hidden] * c + sig[..., :hidden] * torch.tanh(z[..., 2 * hidden : 3 * hidden])
        if self.cell_clip is not None:
            c = c.clamp(-self.cell_clip, self.cell_clip)
        return sig[..., 3 * hidden :] * torch.tanh(c), c

    def step(self, gx: Tensor, h: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
        """One time step of the rows still running: (h, c) ─► (projected and clipped h, c)."""
        return self._finish(self.recurrent(gx, h), c)

    def step_input(self, x: Tensor, h: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
        """The same, from the step's input rows x (2, rows, in) instead of their input gates."""
        return self._finish(self.recurrent_input(x, h), c)

    def _finish(self, z: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
        m, c = self.gates(_at_least_fp32(z), c)  # under autocast: bf16 products, float32 cell
        h = self.project(m)
        if self.proj_clip is not None:
            h = h.clamp(-self.proj_clip, self.proj_clip)
        return h, c


def _plus(products: Tensor | Sequence[Tensor], add: Tensor) -> Tensor:
    """Per-direction products (rows, N) plus ``add`` (D, rows or 1, N), in float32, written into one (D, rows, N)
    tensor (no separate stack and add). A bf16 product is copied, then added to: one add with mixed dtypes measured
    2-3x slower."""
    first = products[0]
    out = torch.empty(len(products), *first.shape, dtype=torch.float32)
    for d, y in enumerate(products):
        if y.dtype == torch.float32:
            torch.add(y, add[d], out=out[d])
        else:
            out[d].copy_(y).add_(add[d])
    return out


def _packed(pair: Sequence[nn.LSTM], kind: str, elements: int, make_w_t: Callable[[], Tensor]) -> PackedWeights | None:
    """The weight ``make_w_t()`` (D, K, N), ``elements`` = K x N, packed for oneDNN once per weight version, or None
    where bmm is as fast (``packed.py``). Only the packed copy is kept, not the weight it was made from."""
    if not worth_packing(elements):
        return None
    return _cached(pair, f"{kind}-packed", lambda: PackedWeights(make_w_t().transpose(1, 2)))


class _InferenceCell(_Cell):
    """What the CPU inference kernels share: the per-step products on weights packed for oneDNN where that pays
    (``packed_hh``, ``packed_hr``, ``packed_cat`` for ``[W_ih; W_hh]``; each None where bmm serves), made once per
    weight version and kept under cache names that start with ``kind``."""

    kind = ""

    def __init__(self, pair: Sequence[nn.LSTM], cell_clip: float | None, proj_clip: float | None) -> None:
        super().__init__(pair, cell_clip, proj_clip)
        w_hh_t, w_hr_t = self.w_hh_t, self.w_hr_t
        self.packed_hh = _packed(pair, f"{self.kind}-hh", w_hh_t[0].numel(), lambda: w_hh_t)
        self.packed_hr = (
            _packed(pair, f"{self.kind}-hr", w_hr_t[0].numel(), lambda: w_hr_t) if w_hr_t is not None else None
        )
        cat_elements = self.w_ih_t[0].numel() + w_hh_t[0].numel()
        self.packed_cat = _packed(pair, f"{self.kind}-cat", cat_elements, self._stacked_input_and_recurrent)
        self.gate_kernel = fused_gates.available()

    def _stacked_input_and_recurrent(self) -> Tensor:
        """[W_ih; W_hh].T (2, in + P, 4H): the weight of a step that takes its input with the state."""
        return torch.cat([self.w_ih_t, self.w_hh_t], dim=1)

    # With the fused gate kernel (``fused_gates.py``) a step is: the bare products, then one C loop that adds the
    # bias or input gates and computes the cell and its output, then the projection.
    g_scale = 1.0  # what the g pre-activations are multiplied by (the bf16 weights carry a factor 2)
    m_dtype = torch.float32  # the cell output's dtype: what the projection takes

    def recurrent_products(self, h: Tensor) -> Tensor | list[Tensor]:
        """h @ W_hh.T per direction, without the input gates."""
        raise NotImplementedError

    def recurrent_input_products(self, x: Tensor, h: Tensor) -> Tensor | list[Tensor]:
        """[x; h] @ [W_ih; W_hh].T per direction, without the bias."""
        raise NotImplementedError

    def input_products(self, x: Tensor) -> Tensor:
        """x (2, N, in) @ W_ih.T ─► (2, N, 4H), without the bias, in the dtype of the cell's products."""
        raise NotImplementedError

    def word_gates(self, table: Tensor, rows: Tensor) -> WordGates:
        if not self.gate_kernel:
            return super().word_gates(table, rows)
        # the kernel adds the bias itself, so the table stays as the products come (bf16: half the memory)
        products = self.input_products(table.expand(2, *table.shape))
        return WordGates(products.reshape(2 * table.shape[0], -1), rows, bias=self.bias)

    def step(self, gx: Tensor | GateRows, h: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
        if isinstance(gx, GateRows):
            return self._fused_finish(self.recurrent_products(h), c, gx.bias, gx.table, gx.rows)
        if self.gate_kernel:  # gx (2, rows, 4H) already holds the bias
            return self._fused_finish(self.recurrent_products(h), c, None, gx)
        return super().step(gx, h, c)

    def step_input(self, x: Tensor, h: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
        if self.gate_kernel:
            return self._fused_finish(self.recurrent_input_products(x, h), c, self.bias)
        return super().step_input(x, h, c)

    def _fused_finish(
        self,
        y: Tensor | list[Tensor],
        c: Tensor,
        bias: Tensor | None,
        x: Tensor | None = None,
        x_rows: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        m, c = fused_gates.lstm_gates(
            y, c, bias, x, x_rows=x_rows, g_scale=self.g_scale, cell_clip=self.cell_clip, m_dtype=self.m_dtype
        )
        h = self.project(m)
        if self.proj_clip is not None:
            h = h.clamp(-self.proj_clip, self.proj_clip)
        return h, c


class _Fp32InferenceCell(_InferenceCell):
    """Exact fp32 CPU inference: the reference arithmetic, weights stacked and transposed once per weight version,
    and the per-step products on weights packed once for oneDNN (``packed.py``) where that pays.

    With packed weights each step takes its input with the state in one product, ``[x_t; h] @ [W_ih; W_hh]``
    (3-6.5% faster on the medium and original shapes, and no (2, N, 4H) tensor of input gates: 1 GB for a batch of
    8192 tokens of the original shape). With bmm the input gates stay one product over all steps: faster there.
    """

    kind = "fp32"

    def __init__(self, pair: Sequence[nn.LSTM], cell_clip: float | None, proj_clip: float | None) -> None:
        super().__init__(pair, cell_clip, proj_clip)
        self.fuses_input = self.packed_cat is not None

    def weights(self, pair: Sequence[nn.LSTM]) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        return _cached(
            pair,
            self.kind,
            lambda: tuple(
                w.detach().contiguous() if w is not None else None
                for w in super(_Fp32InferenceCell, self).weights(pair)
            ),
        )

    def recurrent(self, gx: Tensor, h: Tensor) -> Tensor:
        return _plus(self.packed_hh.products(h), gx) if self.packed_hh is not None else super().recurrent(gx, h)

    def input_products(self, x: Tensor) -> Tensor:
        return torch.bmm(x, self.w_ih_t)

    def recurrent_products(self, h: Tensor) -> Tensor | list[Tensor]:
        return self.packed_hh.products(h) if self.packed_hh is not None else torch.bmm(h, self.w_hh_t)

    def recurrent_input_products(self, x: Tensor, h: Tensor) -> Tensor | list[Tensor]:
        return self.packed_cat.products(torch.cat([x, h], dim=-1))  # type: ignore[union-attr]

    def recurrent_input(self, x: Tensor, h: Tensor) -> Tensor:
        return _plus(self.recurrent_input_products(x, h), self.bias)

    def project(self, m: Tensor) -> Tensor:
        return self.packed_hr(m) if self.packed_hr is not None else super().project(m)


class _Bf16InferenceCell(_InferenceCell):
    """bfloat16 CPU inference: bf16 products with float32 accumulation and cell; one sigmoid for all four gates."""

    kind = "bf16"
    fuses_input = True

    g_scale = 0.5  # the g columns of the weights and bias are scaled by 2 (see ``weights``)

    def __init__(self, pair: Sequence[nn.LSTM], cell_clip: float | None, proj_clip: float | None) -> None:
        super().__init__(pair, cell_clip, proj_clip)
        if self.packed_cat is None:  # bmm takes the weight itself
            self.w_cat_t = _cached(pair, f"{self.kind}-cat", self._stacked_input_and_recurrent)
        # the projection's input in bf16 straight from the kernel; without a projection m is h, kept float32
        self.m_dtype = torch.bfloat16 if self.projects else torch.float32

    def weights(self, pair: Sequence[nn.LSTM]) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        def make() -> tuple:
            w_ih_t, bias, w_hh_t, w_hr_t = (
                w.detach().float() if w is not None else None for w in super(_Bf16InferenceCell, self).weights(pair)
            )
            scale = torch.ones(4 * self.hidden)
            scale[2 * self.hidden : 3 * self.hidden] = 2.0  # g columns: sigmoid(2 z_g) gives tanh(z_g); exact in bf16
            bf16 = lambda w: (w * scale).to(torch.bfloat16).contiguous()  # noqa: E731
            return (
                bf16(w_ih_t),
                bias * scale,
                bf16(w_hh_t),
                w_hr_t.to(torch.bfloat16).contiguous() if w_hr_t is not None else None,
            )

        return _cached(pair, self.kind, make)

    def input_gates(self, x: Tensor) -> Tensor:
        return torch.bmm(x.to(torch.bfloat16), self.w_ih_t).float().add_(self.bias)

    def recurrent(self, gx: Tensor, h: Tensor) -> Tensor:
        return _plus(self.recurrent_products(h), gx)

    def input_products(self, x: Tensor) -> Tensor:
        return torch.bmm(x.to(torch.bfloat16), self.w_ih_t)

    def recurrent_products(self, h: Tensor) -> Tensor | list[Tensor]:
        h = h.to(torch.bfloat16)
        return self.packed_hh.products(h) if self.packed_hh is not None else torch.bmm(h, self.w_hh_t)

    def recurrent_input_products(self, x: Tensor, h: Tensor) -> Tensor | list[Tensor]:
        xh = torch.cat([x.to(torch.bfloat16), h.to(torch.bfloat16)], dim=-1)
        return self.packed_cat.products(xh) if self.packed_cat is not None else torch.bmm(xh, self.w_cat_t)

    def recurrent_input(self, x: Tensor, h: Tensor) -> Tensor:
        return _plus(self.recurrent_input_products(x, h), self.bias)

    def project(self, m: Tensor) -> Tensor:
        if self.packed_hr is not None:
            return self.packed_hr(m.to(torch.bfloat16))
        return torch.bmm(m.to(torch.bfloat16), self.w_hr_t) if self.w_hr_t is not None else m

    def gates(self, z: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
        hidden = self.hidden
        s = torch.sigmoid(z)  # i, f, sigmoid(2 g), o
        g = s[..., 2 * hidden : 3 * hidden].mul(2.0).sub_(1.0)
        c = torch.addcmul(s[..., hidden : 2 * hidden] * c, s[..., :hidden], g)
        if self.cell_clip is not None:
            c = c.clamp_(-self.cell_clip, self.cell_clip)
        return torch.sigmoid(c * 2.0).mul_(2.0).sub_(1.0).mul_(s[..., 3 * hidden :]), c


def lstm_cell(pair: Sequence[nn.LSTM], cell_clip: float | None, proj_clip: float | None, like: Tensor) -> _Cell:
    """The kernel for a run whose inputs look like ``like`` (device, dtype, grad mode, autocast)."""
    inference_cpu = _cpu_inference(like.device)
    if inference_cpu and _cpu_autocast_bf16():
        return _Bf16InferenceCell(pair, cell_clip, proj_clip)
    if inference_cpu and like.dtype == torch.float32 and not torch.is_autocast_enabled("cpu"):
        return _Fp32InferenceCell(pair, cell_clip, proj_clip)
    return _Cell(pair, cell_clip, proj_clip)


@dataclass
class WordGates:
    """Layer 0's input-to-gates product per distinct word, both directions' rows in one table (2U, 4H), and for
    every packed position the row to take (2, N): gathered step by step, never materialised for every token."""

    table: Tensor
    rows: Tensor
    bias: Tensor | None = None  # (2, 1, 4H) when the table leaves the bias out: built for the gate kernel

    def steps(self, batch_sizes: list[int]) -> Iterator[Tensor | GateRows]:
        """Each step's (2, rows, 4H) input gates, in order; for the gate kernel, where they are (``GateRows``)."""
        offset = 0
        for n in batch_sizes:
            rows = self.rows[:, offset : offset + n]
            if self.bias is not None:
                yield GateRows(self.table, rows, self.bias)
            else:
                yield self.table.index_select(0, rows.reshape(-1)).view(2, n, -1)
            offset += n


@dataclass
class GateRows:
    """A step's input gates as rows of a table, for the fused gate kernel, which reads them in place."""

    table: Tensor  # (R, 4H), without the bias
    rows: Tensor  # (2, rows) int64
    bias: Tensor  # (2, 1, 4H) float32, added by the kernel


def _clipped_bilstm(
    x: Tensor | None,
    batch_sizes: list[int],
    pair: Sequence[nn.LSTM],
    h0: Tensor,
    c0: Tensor,
    cell_clip: float | None,
    proj_clip: float | None,
    gates_x: Tensor | WordGates | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """One layer, both directions, with TF ``LSTMCell(num_proj, cell_clip, proj_clip)`` semantics.

    x (2, N_real, in) holds each direction's packed time-major data, rows sorted by length, longest first
    (``PackedSequence``): step t holds the first ``batch_sizes[t]`` rows. Rows that have ended drop out of the
    batch, so no work is spent on padding and each row's final state is its state after its last real step.
    ``gates_x`` (2, N_real, 4H), when given, is the input-to-gates product already computed by the same kernel,
    or ``WordGates`` (layer 0 computes it once per distinct word). Returns the outputs (2, N_real, P) and the
    final h (2, B, P), c (2, B, H), rows in the same sorted order.
    """
    like = x if x is not None else gates_x.table if isinstance(gates_x, WordGates) else gates_x
    cell = lstm_cell(pair, cell_clip, proj_clip, like)  # type: ignore[arg-type]
    # per step, what the cell takes: the step's inputs (inference fuses them with the state in one product) or
    # its input gates. One split, not a slice per step: a slice's gradient would zero-fill the whole tensor each step
    if gates_x is None and cell.fuses_input:
        sources, step = x.split(batch_sizes, dim=1), cell.step_input  # type: ignore[union-attr]
    else:
        if gates_x is None:  # training: input-to-gates for every step in one product, only h @ W_hh per step
            gates_x = cell.input_gates(x)  # type: ignore[arg-type]
        sources = gates_x.steps(batch_sizes) if isinstance(gates_x, WordGates) else gates_x.split(batch_sizes, dim=1)
        step = cell.step
    h, c = h0, _at_least_fp32(c0)
    outputs: list[Tensor] = []
    ended_h: list[Tensor] = []  # final states of rows that ended, the last-ending first
    ended_c: list[Tensor] = []
    for n, source in zip(batch_sizes, sources):
        if n < h.shape[1]:
            ended_h.append(h[:, n:])
            ended_c.append(c[:, n:])
            h, c = h[:, :n], c[:, :n]
        h, c = step(source, h, c)
        outputs.append(h)
    h_n = torch.cat([h, *reversed(ended_h)], dim=1) if ended_h else h
    c_n = torch.cat([c, *reversed(ended_c)], dim=1) if ended_c else c
    return torch.cat(outputs, dim=1), h_n, c_n


@dataclass
class Packing:
    """Where each (row, step) of a batch sits in packed, time-major data (rows sorted longest first).

    Step t holds the first ``batch_sizes[t]`` sorted rows; ``position(row, t) = offsets[t] + rank[row]``.
    """

    order: Tensor  # (B,) original row of each sorted row
    rank: Tensor  # (B,) sorted position of each original row
    batch_sizes: list[int]
    offsets: Tensor  # (T,) packed index of step t's first row
    lengths: Tensor  # (B,) original order, on the CPU

    @classmethod
    def of(cls, lengths: Tensor) -> Packing:
        lengths = lengths.detach().cpu().clamp(min=1)  # a 0-length row runs one dummy step (discarded by callers)
        order = torch.sort(lengths, descending=True, stable=True).indices
        rank = torch.empty_like(order)
        rank[order] = torch.arange(len(order))
        total = int(lengths.max()) if len(lengths) else 0
        counts = (lengths[None, :] > torch.arange(total)[:, None]).sum(1)
        offsets = torch.zeros(total, dtype=torch.long)
        if total > 1:
            offsets[1:] = counts.cumsum(0)[:-1]
        return cls(order, rank, counts.tolist(), offsets, lengths)

    def steps(self) -> tuple[Tensor, Tensor]:
        """(original row, step) of every packed position, in packed order."""
        sorted_lengths = self.lengths[self.order]
        t, r = torch.nonzero(torch.arange(len(self.offsets))[:, None] < sorted_lengths[None, :], as_tuple=True)
        return self.order[r], t

    def position(self, rows: Tensor, steps: Tensor) -> Tensor:
        return self.offsets[steps] + self.rank[rows]


class ElmoLstm(nn.Module):
    """L layers of forward and backward LSTMs with projection, clipping and the residual for layers ≥ 1.

    Two entry points: ``forward`` takes padded (B, T, P) inputs of both directions (the backward one already
    time-reversed per row; training passes two independent streams), and ``run_packed`` takes packed data.
    """

    def __init__(self, config: LstmConfig, use_fused: bool | None = None) -> None:
        super().__init__()
        self.config = config
        p, h = config.projection_dim, config.dim
        proj = p if p < h else 0

        def layers() -> nn.ModuleList:
            return nn.ModuleList(nn.LSTM(p, h, proj_size=proj, batch_first=True) for _ in range(config.n_layers))

        self.forward_layers = layers()
        self.backward_layers = layers()
        for lstm in self.all_layers():
            lstm.bias_hh_l0.requires_grad_(False)
            with torch.no_grad():
                lstm.bias_hh_l0.copy_(forget_gate_bias(h))
        # The fused path cannot clip; it is only allowed (and the default) when both clips are off.
        self.use_fused = (not config.clipped) if use_fused is None else use_fused
        if self.use_fused and config.clipped:
            raise ValueError("the fused nn.LSTM path cannot clip; set cell_clip and proj_clip to null")

    def all_layers(self) -> list[nn.LSTM]:
        return [*self.forward_layers, *self.backward_layers]

    def zero_state(self, batch: int, device: torch.device, dtype: torch.dtype = torch.float32) -> LstmState:
        cfg = self.config
        return (
            torch.zeros(cfg.n_layers, 2, batch, cfg.projection_dim, device=device, dtype=dtype),
            torch.zeros(cfg.n_layers, 2, batch, cfg.dim, device=device, dtype=dtype),
        )

    def run_packed(
        self,
        xs: Sequence[Tensor | None],
        batch_sizes: list[int],
        state: LstmState,
        dropout: float = 0.0,
        gates0: Tensor | WordGates | None = None,
    ) -> tuple[list[Tensor], LstmState]:
        """Packed inputs (N, P) of both directions ─► packed outputs (2, N, P) per layer, and the state.

        ``state`` and the returned state are in the packing's sorted row order. ``gates0`` ((2, N, 4H) or
        ``WordGates``): layer 0's input-to-gates products, already computed (inference computes them once per
        distinct word); the inputs ``xs`` are then not needed. ``dropout`` (training) applies to each layer's
        input; the residual adds the dropped input, as TF's ``DropoutWrapper`` inside a ``ResidualWrapper``.
        """
        cfg = self.config
        h_state, c_state = state
        x: Tensor | None = torch.stack(list(xs)) if xs[0] is not None else None  # (2, N, P)
        outputs, new_h, new_c = [], [], []
        for layer in range(cfg.n_layers):
            pair = (self.forward_layers[layer], self.backward_layers[layer])
            if x is not None and dropout > 0.0 and self.training:
                x = nn.functional.dropout(x, dropout, training=True)
            if self.use_fused:
                out, h, c = self._fused_layer(pair, x, batch_sizes, h_state[layer], c_state[layer])  # type: ignore[arg-type]
            else:
                gates_x = gates0 if layer == 0 else None
                out, h, c = _clipped_bilstm(
                    x, batch_sizes, pair, h_state[layer], c_state[layer], cfg.cell_clip, cfg.proj_clip, gates_x
                )
            if layer > 0 and cfg.use_skip_connections:
                out = out + x  # the residual changes the output only, never the recurrent state
            outputs.append(out)
            new_h.append(h)
            new_c.append(c)
            x = out
        return outputs, (torch.stack(new_h), torch.stack(new_c))

    @staticmethod
    def _fused_layer(
        pair: Sequence[nn.LSTM], x: Tensor, batch_sizes: list[int], h0: Tensor, c0: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``nn.LSTM`` (cuDNN on GPU) per direction, when no clipping is asked for."""
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

    def forward(
        self,
        inputs: tuple[Tensor, Tensor],
        lengths: Tensor,
        state: LstmState | None = None,
        dropout: float = 0.0,
    ) -> tuple[list[tuple[Tensor, Tensor]], LstmState]:
        """inputs: (forward (B, T, P), backward (B, T, P) already time-reversed); lengths (B,).

        Returns per layer (forward out, backward out) (B, T, P) in each direction's *input* time order, zero
        at padding, and the new state; rows of length 0 keep theirs.
        """
        batch, total, _ = inputs[0].shape
        if state is None:
            state = self.zero_state(batch, inputs[0].device, inputs[0].dtype)
        lengths_cpu = lengths.detach().cpu()
        # one packing serves every layer and both directions (same lengths)
        packs = [
            pack_padded_sequence(x, lengths_cpu.clamp(min=1), batch_first=True, enforce_sorted=False) for x in inputs
        ]
        layout = packs[0]
        order = layout.sorted_indices
        sorted_state = (state[0][:, :, order], state[1][:, :, order])
        packed_outputs, (h_new, c_new) = self.run_packed(
            [p.data for p in packs], layout.batch_sizes.tolist(), sorted_state, dropout
        )
        unorder = layout.unsorted_indices
        h_new, c_new = h_new[:, :, unorder], c_new[:, :, unorder]
        empty = lengths_cpu == 0
        if bool(empty.any()):
            ran = (~empty).to(h_new.device)[:, None]
            h_new, c_new = torch.where(ran, h_new, state[0]), torch.where(ran, c_new, state[1])
        outputs = []
        for layer_out in packed_outputs:
            pair = []
            for out in layer_out:
                padded, _ = pad_packed_sequence(layout._replace(data=out), batch_first=True, total_length=total)
                if bool(empty.any()):
                    padded = padded * (~empty).to(padded.device)[:, None, None]
                pair.append(padded)
            outputs.append((pair[0], pair[1]))
        return outputs, (h_new, c_new)


def reverse_padded(x: Tensor, lengths: Tensor) -> Tensor:
    """Reverse each row of (B, T, ...) within its own length; padding stays at the end. Self-inverse."""
    total = x.shape[1]
    steps = torch.arange(total, device=x.device)[None, :]
    lengths = lengths.to(x.device)[:, None]
    index = torch.where(steps < lengths, lengths - 1 - steps, steps)
    return x.gather(1, index.view(*index.shape, *([1] * (x.dim() - 2))).expand_as(x))


# ----- 3. the biLM ----------------------------------------------------------------------------------


class BiLM(nn.Module):
    """The bidirectional language model of ELMo: token encoder + forward/backward LSTM stacks (+ softmax).

    ``forward`` takes ids **without** sentence boundaries (as ``batch_to_ids`` makes them), adds ``<S>``/``</S>``,
    and returns the L+1 layers with the boundaries removed, the mask, and the LSTM state after each row's last
    token. Each row starts from ``state`` (zeros when None): pass a call's returned state into the next call
    for bilm-tf's stateful protocol (``inference.StateCarry`` does so across batches of changing size).
    """

    def __init__(self, config: ModelConfig, vocab: Sequence[str] | None = None, use_fused: bool | None = None) -> None:
        super().__init__()
        self.config = config
        p = config.lstm.projection_dim
        self.token_encoder = TokenEncoder(config.char_cnn, p)
        self.lstm = ElmoLstm(config.lstm, use_fused=use_fused)
        # bilm-tf's softmax: one (V, P) table and bias shared by both directions
        self.softmax = nn.Linear(p, config.n_tokens_vocab) if config.n_tokens_vocab else None
        self.vocab: list[str] | None = list(vocab) if vocab is not None else None  # the softmax's words
        max_chars = config.char_cnn.max_characters_per_token
        self.register_buffer(
            "boundary_char_ids",
            torch.from_numpy(tokens_to_char_array([BOS_TOKEN, EOS_TOKEN], max_chars)).long(),
            persistent=False,
        )

    # --- weight files --------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls,
        options_file: str,
        weight_file: str | None = None,
        device: str | torch.device = "cpu",
        vocab_file: str | None = None,
    ) -> BiLM:
        """Load bilm-tf / AllenNLP ``options.json`` + ``weights.hdf5`` (or a model directory), in eval mode."""
        config, state_dict, vocab = read_model_files(options_file, weight_file, vocab_file)
        model = cls(config, vocab=vocab)
        missing, unexpected = model.load_state_dict(state_dict, strict=False)
        if missing or unexpected:
            raise WeightFileError(
                f"{options_file}: weights do not fit the model: missing {missing}, unexpected {unexpected}"
            )
        return model.to(device).eval()

    def save_pretrained(self, directory: str) -> None:
        """Write options.json + weights.hdf5 (+ vocab.txt) that bilm-tf and AllenNLP load unchanged."""
        write_model_files(directory, self.config, self.state_dict(), self.vocab)

    @property
    def output_dim(self) -> int:
        return 2 * self.config.lstm.projection_dim

    @property
    def num_layers(self) -> int:
        return self.config.lstm.n_layers + 1

    @property
    def device(self) -> torch.device:
        return self.boundary_char_ids.device

    # --- token embeddings (layer 0) ------------------------------------------------------------------
    def embed_chars(self, char_ids: Tensor) -> Tensor:
        """(..., C) ids ─► (..., P). Each distinct word runs through the char CNN once."""
        table, index = self._distinct_chars(char_ids.reshape(-1, char_ids.shape[-1]))
        return table[index].view(*char_ids.shape[:-1], -1)

    def _distinct_chars(self, flat: Tensor) -> tuple[Tensor, Tensor]:
        """(N, C) char ids ─► table (U + 1, P) of the distinct words' embeddings (last row zero) and index (N,)."""
        real = (flat > 0).any(-1)
        unique, inverse = torch.unique(flat[real], dim=0, return_inverse=True)
        encoded = (
            self.token_encoder(unique)
            if unique.shape[0]
            else self.token_encoder.char_cnn.char_embedding.weight.new_zeros(0, self.config.lstm.projection_dim)
        )
        table = torch.cat([encoded, encoded.new_zeros(1, encoded.shape[1])])
        index = torch.full((flat.shape[0],), unique.shape[0], dtype=torch.long, device=flat.device)
        index[real] = inverse
        return table, index

    def token_embeddings(self, tokens: Sequence[str], batch_size: int = 1024) -> Tensor:
        """(V, P) context-independent embeddings of ``tokens`` (bilm-tf ``dump_token_embeddings``)."""
        max_chars = self.config.char_cnn.max_characters_per_token
        chunks = []
        with torch.no_grad():
            for start in range(0, len(tokens), batch_size):
                ids = torch.from_numpy(tokens_to_char_array(tokens[start : start + batch_size], max_chars)).long()
                chunks.append(self.token_encoder(ids.to(self.device)))
        return torch.cat(chunks) if chunks else torch.zeros(0, self.config.lstm.projection_dim, device=self.device)

    def _with_boundaries(self, inputs: Tensor, token_table: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(table (U, P), index (B, T+2) into it with <S>/</S> added, lengths (B,) with them, mask (B, T))."""
        batch, total = inputs.shape[:2]
        if inputs.dim() == 3:
            mask = (inputs > 0).any(-1)
        elif inputs.dim() == 2:
            if token_table is None:
                raise ValueError("(B, T) token ids need their token_table (see inference.TokenCache)")
            mask = inputs > 0
        else:
            raise ValueError(f"expected (B, T, C) char ids or (B, T) token ids, got shape {tuple(inputs.shape)}")
        # every row becomes <S> tokens </S> (empty sentences too); AllenNLP's add_sentence_boundary_token_ids
        lengths = mask.sum(1)
        rows = torch.arange(batch, device=inputs.device)
        if inputs.dim() == 3:
            ids = inputs.new_zeros(batch, total + 2, inputs.shape[2])
            ids[:, 1 : total + 1] = inputs * mask.unsqueeze(-1)
            ids[:, 0] = self.boundary_char_ids[0]
            ids[rows, lengths + 1] = self.boundary_char_ids[1]
            table, index = self._distinct_chars(ids.view(-1, ids.shape[-1]))
            index = index.view(batch, total + 2)
        else:
            vocab_rows = token_table.shape[0]  # type: ignore[union-attr]
            boundary = self.embed_chars(self.boundary_char_ids)
            table = torch.cat([token_table.to(boundary), boundary])  # type: ignore[union-attr]
            index = inputs.new_zeros(batch, total + 2)
            index[:, 1 : total + 1] = inputs * mask
            index[:, 0] = vocab_rows
            index[rows, lengths + 1] = vocab_rows + 1
        return table, index, lengths + 2, mask

    # --- forward -------------------------------------------------------------------------------------
    def _run(
        self, table: Tensor, index: Tensor, lengths: Tensor, state: LstmState | None
    ) -> tuple[Packing, list[list[Tensor]], LstmState]:
        """Token embeddings ``table[index]`` (B, T+2) with boundaries ─► packed LSTM outputs and the new state.

        Layer 0's input-to-gates product is computed once per row of ``table`` (each distinct word) and gathered.
        """
        device = index.device
        packing = Packing.of(lengths)
        rows, steps = (t.to(device) for t in packing.steps())
        lengths = lengths.to(device)
        ids = [index[rows, steps], index[rows, lengths[rows] - 1 - steps]]  # forward, backward (reversed) order
        if state is None:
            state = self.lstm.zero_state(index.shape[0], device, table.dtype)
        order, rank = packing.order.to(device), packing.rank.to(device)
        sorted_state = (state[0][:, :, order], state[1][:, :, order])
        if self.lstm.use_fused:
            xs, gates0 = [table[i] for i in ids], None
        else:
            cfg = self.config.lstm
            first = (self.lstm.forward_layers[0], self.lstm.backward_layers[0])
            cell = lstm_cell(first, cfg.cell_clip, cfg.proj_clip, table)
            xs, gates0 = [None, None], cell.word_gates(table, torch.stack([ids[0], ids[1] + table.shape[0]]))
        outputs, (h, c) = self.lstm.run_packed(xs, packing.batch_sizes, sorted_state, gates0=gates0)
        return packing, outputs, (h[:, :, rank], c[:, :, rank])

    def forward(
        self,
        inputs: Tensor,
        state: LstmState | None = None,
        token_table: Tensor | None = None,
        keep_boundaries: bool = False,
    ) -> dict:
        """inputs: char ids (B, T, C) in the +1 scheme, or token ids (B, T) into ``token_table``; no boundaries.

        Returns ``{"activations": [L+1 × (B, T, 2P)], "mask": (B, T) bool, "state": (h, c)}``, zero at padding;
        with ``keep_boundaries`` the layers are (B, T+2, 2P) with ``<S>`` at 0 and ``</S>`` at length+1
        (AllenNLP's ``_ElmoBiLm`` view) and the mask covers them.
        """
        batch, total = inputs.shape[:2]
        table, index, lengths, mask = self._with_boundaries(inputs, token_table)
        packing, outputs, new_state = self._run(table, index, lengths, state)
        width = total + 2
        rows, steps = (t.to(index.device) for t in packing.steps())
        lengths = lengths.to(index.device)
        at_forward, at_backward = rows * width + steps, rows * width + lengths[rows] - 1 - steps
        mask_b = torch.arange(width, device=index.device)[None, :] < lengths[:, None]
        x = table[index] * mask_b.unsqueeze(-1).to(table.dtype)
        layers = [torch.cat([x, x], dim=-1)]
        p = self.config.lstm.projection_dim
        for out_f, out_b in outputs:
            padded = out_f.new_zeros(batch * width, 2 * p)
            padded[at_forward, :p] = out_f
            padded[at_backward, p:] = out_b  # the backward LSTM read the row reversed
            layers.append(padded.view(batch, width, 2 * p))
        if keep_boundaries:
            return {"activations": layers, "mask": mask_b, "state": new_state}
        keep = mask.unsqueeze(-1).to(layers[0].dtype)  # drops </S>, which sits inside the window of shorter rows
        return {"activations": [layer[:, 1 : total + 1] * keep for layer in layers], "mask": mask, "state": new_state}

    def token_rows(
        self, inputs: Tensor, state: LstmState | None = None, token_table: Tensor | None = None
    ) -> tuple[list[Tensor], Tensor, LstmState]:
        """Like ``forward``, without padding: L+1 × (N, 2P) rows, the tokens of row 0, then row 1, …

        Returns the layers, each row's token count (B,), and the new state. What embedding jobs write: no
        padded (B, T, 2P) tensor is ever built, so the cost per token does not depend on the length spread.
        """
        table, index, lengths, _ = self._with_boundaries(inputs, token_table)
        packing, outputs, new_state = self._run(table, index, lengths, state)
        device = index.device
        lengths = lengths.to(device)
        counts = lengths - 2
        rows = torch.repeat_interleave(torch.arange(len(counts), device=device), counts)
        starts = torch.cumsum(counts, 0) - counts
        steps = torch.arange(len(rows), device=device) - starts[rows] + 1  # 1 … n: after <S>
        at_forward = packing.position(rows.cpu(), steps.cpu()).to(device)
        at_backward = packing.position(rows.cpu(), (lengths[rows] - 1 - steps).cpu()).to(device)
        e = table[index[rows, steps]]
        layers = [torch.cat([e, e], dim=-1)]
        for out_f, out_b in outputs:
            layers.append(torch.cat([out_f.index_select(0, at_forward), out_b.index_select(0, at_backward)], dim=-1))
        return layers, counts, new_state

    # --- the convenience API -------------------------------------------------------------------------
    def embed_sentences(
        self,
        sentences: Sequence[Sequence[str]],
        batch_size: int | None = None,
        stateful: bool = False,
        carry: inference.StateCarry | None = None,
        precision: str = "fp32",
        bf16: bool | None = None,
        max_batch_tokens: int = inference.MAX_BATCH_TOKENS,
    ) -> list[np.ndarray]:
        """One float32 array (L+1, n_tokens, 2P) per sentence, boundaries removed (``inference.embed_sentences``)."""
        return inference.embed_sentences(
            self,
            sentences,
            batch_size=batch_size,
            stateful=stateful,
            carry=carry,
            precision=precision,
            bf16=bf16,
            max_batch_tokens=max_batch_tokens,
        )


# ----- 4. scalar mix --------------------------------------------------------------------------------


class ScalarMix(nn.Module):
    """ELMo's task mix γ · Σ_j softmax(w)_j · LN?(layer_j), as AllenNLP computes it.

    With ``do_layer_norm`` each layer is normalised by one mean and variance over all unmasked positions and
    features, ε = 1e-13, no affine parameters. Given ``initial_scalar_parameters`` the weights are frozen.
    """

    def __init__(
        self,
        mixture_size: int,
        do_layer_norm: bool = False,
        initial_scalar_parameters: Sequence[float] | None = None,
        trainable: bool = True,
        gamma: float = 1.0,
    ) -> None:
        super().__init__()
        self.mixture_size = mixture_size
        self.do_layer_norm = do_layer_norm
        values = list(initial_scalar_parameters) if initial_scalar_parameters is not None else [0.0] * mixture_size
        if len(values) != mixture_size:
            raise ValueError(f"{len(values)} initial scalar parameters for a mixture of {mixture_size} layers")
        self.scalar_parameters = nn.ParameterList(
            nn.Parameter(torch.tensor([v]), requires_grad=trainable) for v in values
        )
        self.gamma = nn.Parameter(torch.tensor([gamma]), requires_grad=trainable)

    def forward(self, tensors: Sequence[Tensor], mask: Tensor | None = None) -> Tensor:
        if len(tensors) != self.mixture_size:
            raise ValueError(f"{len(tensors)} tensors passed to a ScalarMix of size {self.mixture_size}")
        weights = torch.softmax(torch.cat(list(self.scalar_parameters)), dim=0)
        if self.do_layer_norm and mask is None:
            raise ValueError("do_layer_norm needs the mask")
        pieces = []
        for weight, tensor in zip(weights.split(1), tensors):
            if self.do_layer_norm:
                tensor = _masked_layer_norm(tensor, mask)  # type: ignore[arg-type]
            pieces.append(weight * tensor)
        return self.gamma * sum(pieces)


def _masked_layer_norm(tensor: Tensor, mask: Tensor) -> Tensor:
    broadcast_mask = mask.unsqueeze(-1).to(tensor.dtype)
    n = broadcast_mask.sum() * tensor.shape[-1]
    masked = tensor * broadcast_mask
    mean = masked.sum() / n
    variance = (((masked - mean) * broadcast_mask) ** 2).sum() / n
    return (tensor - mean) / torch.sqrt(variance + 1e-13)


# ----- 5. initialisation for training (bilm-tf's recipe, docs §6) ------------------------------------


def init_bilm_tf(model: BiLM) -> None:
    """Initialise a fresh model as bilm-tf does before training."""
    cfg = model.config
    enc = model.token_encoder
    with torch.no_grad():
        nn.init.uniform_(enc.char_cnn.char_embedding.weight, -1.0, 1.0)
        enc.char_cnn.char_embedding.weight[0].zero_()
        for (width, _), conv in zip(cfg.char_cnn.filters, enc.char_cnn.convs):
            if cfg.char_cnn.activation == "relu":
                nn.init.uniform_(conv.weight, -0.05, 0.05)
            else:
                nn.init.normal_(conv.weight, 0.0, math.sqrt(1.0 / (width * cfg.char_cnn.embedding.dim)))
            conv.bias.zero_()
        std = math.sqrt(1.0 / cfg.char_cnn.n_filters)
        for highway in enc.highways:
            nn.init.normal_(highway.carry.weight, 0.0, std)
            nn.init.normal_(highway.transform.weight, 0.0, std)
            highway.carry.bias.fill_(-2.0)
            highway.transform.bias.zero_()
        if enc.projection is not None:
            nn.init.normal_(enc.projection.weight, 0.0, std)
            enc.projection.bias.zero_()
        for lstm in model.lstm.all_layers():
            # TF's default kernel init is Glorot-uniform over the fused [input; recurrent] kernel
            fan_in = lstm.input_size + (lstm.proj_size or lstm.hidden_size)
            bound = math.sqrt(6.0 / (fan_in + 4 * lstm.hidden_size))
            nn.init.uniform_(lstm.weight_ih_l0, -bound, bound)
            nn.init.uniform_(lstm.weight_hh_l0, -bound, bound)
            if lstm.proj_size > 0:
                bound_p = math.sqrt(6.0 / (lstm.hidden_size + lstm.proj_size))
                nn.init.uniform_(lstm.weight_hr_l0, -bound_p, bound_p)
            lstm.bias_ih_l0.zero_()
            lstm.bias_hh_l0.copy_(forget_gate_bias(lstm.hidden_size))
    init_softmax(model)


def init_softmax(model: BiLM) -> None:
    """bilm-tf's softmax init, N(0, 1/sqrt(P)) weights and zero bias (also for a new vocabulary when fine-tuning)."""
    if model.softmax is None:
        return
    with torch.no_grad():
        nn.init.normal_(model.softmax.weight, 0.0, 1.0 / math.sqrt(model.config.lstm.projection_dim))
        model.softmax.bias.zero_()
