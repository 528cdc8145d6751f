"""The char CNN's convolution and max over positions, one width, as one autograd node whose backward is sparse: the
gradient goes only to the position each max came from, in a C loop (``char_cnn.c``). For training on a CPU.

Why: after the LSTM step became one node (``trained_step``), the char CNN's backward was the largest single
operation of the main job's step: oneDNN's dense convolution backward, 14-15% of it, three times the forward
(``bench/train_profile.py`` on the 2-vCPU AMD EPYC with avx512_bf16). But
bilm-tf's char CNN takes the max over positions before its activation, and a max's gradient is zero at every
position but one, so that backward computes (words x filters x positions) products of which one position per word
and filter is nonzero. Here: the forward is the same oneDNN convolution and max pooling, which also gives the
positions; the backward reads each (word, filter)'s gradient once and adds it at its position only, into the
weights' gradient and straight into the char embedding table's (the lookup's backward folded in). On the main
job's batches the char CNN's forward and backward went from about 9.6 to 2.9 ms (bf16, 2 threads, the same
profile).

The numbers are the reference's (``model.CharCNN``): max pooling's first position among equal values, the embedding
table's padding row given no gradient; fp32 to float rounding. Under bf16 autocast the forward runs in bfloat16 as
the reference's does; the backward's sums are float32 where oneDNN's round to bfloat16, so it is the more exact.
``tests/test_char_cnn_kernel.py`` compares values and gradients.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache

import torch
from torch import Tensor, nn

from elmo_core.bilm.kernels import fused_gates

# Below this many (word, filter) pairs the backward runs on one thread.
PARALLEL_PAIRS = 1 << 12


@lru_cache(maxsize=1)
def _function() -> ctypes._CFuncPtr | str:
    """The C backward, or why there is none (a string)."""
    library = fused_gates.library()
    if isinstance(library, str):
        return library
    backward = library.elmo_conv_max_backward
    pointer, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    backward.argtypes = [pointer] * 8 + [i64] * 6 + [i32] * 3
    backward.restype = ctypes.c_int
    return backward


def available() -> bool:
    """The C backward is built and loaded here (built on the first call)."""
    return not isinstance(_function(), str)


def describe() -> str:
    """'yes' or 'no (why)', for the training log."""
    function = _function()
    return f"no ({function})" if isinstance(function, str) else "yes"


class _ConvMax(torch.autograd.Function):
    """(embedded, ids; table, weight, bias) ─► (N, F): each filter's largest value over the word's positions."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, embedded: Tensor, ids: Tensor, table: Tensor, weight: Tensor, bias: Tensor
    ) -> Tensor:
        # under autocast the convolution runs in its dtype, as the reference's
        convolved = nn.functional.conv2d(embedded, weight.unsqueeze(2), bias)
        if convolved.dtype not in (torch.float32, torch.bfloat16):
            raise TypeError(f"the char CNN's sparse backward takes float32 or bfloat16, not {convolved.dtype}")
        pooled, where = nn.functional.max_pool2d(convolved, (1, convolved.shape[-1]), return_indices=True)
        ctx.save_for_backward(ids, table, weight, where)
        ctx.dtype = convolved.dtype
        return pooled.flatten(1)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        ids, table, weight, where = ctx.saved_tensors
        dtype = ctx.dtype  # the forward's values, in the dtype it computed them
        filters, dim, width = weight.shape
        words, length = ids.shape
        grad = grad.contiguous()
        table_in, weight_in = table.detach().to(dtype).contiguous(), weight.detach().to(dtype).transpose(1, 2)
        weight_in = weight_in.contiguous()
        where = where.flatten(1).contiguous()
        dweight = torch.empty(filters, width, dim)  # the window's layout, (positions, channels)
        dbias, dtable = torch.empty(filters), torch.zeros(table.shape)
        threads = torch.get_num_threads() if words * filters >= PARALLEL_PAIRS else 1
        failed = _function()(  # type: ignore[operator]
            ids.data_ptr(), table_in.data_ptr(), weight_in.data_ptr(), where.data_ptr(), grad.data_ptr(),
            dweight.data_ptr(), dbias.data_ptr(), dtable.data_ptr(), words, length, dim, table.shape[0], filters,
            width, int(dtype == torch.bfloat16), int(grad.dtype == torch.bfloat16), threads,
        )  # fmt: skip
        if failed:
            raise MemoryError("the char CNN's backward could not allocate its float32 copies")
        dtable[0] = 0.0  # the padding row of the +1 scheme never learns (nn.Embedding's padding_idx)
        return None, None, dtable.to(table.dtype), dweight.transpose(1, 2).to(weight.dtype), dbias.to(weight.dtype)


def conv_max(embedded: Tensor, ids: Tensor, table: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """One width of the char CNN before its activation: ``embedded`` (N, D, 1, C) the words' char embeddings, looked
    up without gradients from ``table`` (V, D) at ``ids`` (N, C) int64 (channels-last, as ``model.CharCNN`` lays
    them out); ``weight`` (F, D, w), ``bias`` (F,) a ``Conv1d``'s ─► (N, F), differentiable in table, weight, bias."""
    if embedded.device.type != "cpu":
        raise ValueError(f"the char CNN's sparse backward runs on the CPU, not {embedded.device}")
    if ids.dtype != torch.long or ids.dim() != 2 or embedded.shape[-1] != ids.shape[-1]:
        raise ValueError(f"ids {tuple(ids.shape)} {ids.dtype} must be (N, C) int64 for embedded {embedded.shape}")
    return _ConvMax.apply(embedded, ids.contiguous(), table, weight, bias)
