"""A training step as one node (kernels/trained_step.py, lstm_gates.c) against the reference cell under autograd:
values and gradients of a window, the clips' gradients at their boundary, then the whole model's gradients."""

from __future__ import annotations

import shutil

import pytest
import torch
from torch import nn

from elmo_core import BiLM, batch_to_ids
from elmo_core.bilm.initialization import init_bilm_tf
from elmo_core.bilm.kernels import choose_training, trained_step
from elmo_core.bilm.lstm import LstmCell, _recurrence
from elmo_core.config import tiny

HIDDEN = 40  # not a multiple of the 16 float32 lanes: the vector loop's remainder runs too
SENTENCES = [["I", "ate", "an", "apple", "."], ["Hi"], ["The", "quick", "brown", "fox", "jumps", "over", "it", "."]]

needs_kernel = pytest.mark.skipif(not trained_step.available(), reason=trained_step.describe())


def test_the_kernel_is_built_wherever_a_c_compiler_is():
    if shutil.which("cc") or shutil.which("gcc") or shutil.which("clang"):
        assert trained_step.available(), trained_step.describe()
        assert choose_training(torch.device("cpu"), tiny().lstm).one_node


def _pair() -> list[nn.LSTM]:
    torch.manual_seed(0)
    pair = [nn.LSTM(12, HIDDEN, proj_size=12, batch_first=True) for _ in range(2)]
    with torch.no_grad():
        for lstm in pair:
            lstm.bias_hh_l0.requires_grad_(False)  # as the model holds it (TensorFlow's constant forget bias)
            lstm.weight_hh_l0.mul_(2)  # large pre-activations: saturated gates, cells past the clip
            lstm.weight_hr_l0.mul_(12)  # and projections past theirs
    return pair


def _window(pair, clips, one_node, x, h, c, precision, batch_sizes):
    """A window of lstm.LstmCell steps (rows ending on the way): outputs, final states and the gradients of a loss
    of all three w.r.t. the inputs, the initial state and every weight."""
    leaves = [t.clone().requires_grad_() for t in (x, h, c)]
    for lstm in pair:
        lstm.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        cell = LstmCell(pair, clips, one_node=one_node)
        outputs = _recurrence(cell, cell.steps(leaves[0], batch_sizes), batch_sizes, leaves[1], leaves[2])
    g = torch.Generator().manual_seed(1)
    loss = sum((out.float() * torch.randn(out.shape, generator=g)).sum() for out in outputs)
    loss.backward()
    grads = [t.grad for t in leaves] + [p.grad for lstm in pair for p in lstm.parameters() if p.grad is not None]
    return [*outputs, *grads]


@needs_kernel
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("clips", [(None, None), (3.0, 3.0)])
def test_a_window_and_its_gradients_are_the_reference_s(precision, clips):
    pair = _pair()
    g = torch.Generator().manual_seed(0)
    batch_sizes = [5, 5, 4, 4, 2, 1]  # rows leave the packed batch as they end
    x = torch.randn(2, sum(batch_sizes), 12, generator=g)
    h, c = torch.randn(2, 5, 12, generator=g), torch.randn(2, 5, HIDDEN, generator=g) * 3
    reference = _window(pair, clips, False, x, h, c, precision, batch_sizes)
    fused = _window(pair, clips, True, x, h, c, precision, batch_sizes)
    # outputs, h_n, c_n; x, h0, c0; per direction W_ih, W_hh, b_ih, W_hr (b_hh is frozen)
    assert len(fused) == len(reference) == 3 + 3 + 2 * 4
    for got, want in zip(fused, reference, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        if precision == "fp32":
            torch.testing.assert_close(got, want, atol=5e-5, rtol=1e-5)
        else:  # the same bf16 products; the exponential's roundings and the weight gradients' sums differ
            cosine = torch.nn.functional.cosine_similarity(got.float().flatten(), want.float().flatten(), dim=0)
            assert cosine > 0.9999
    if clips[0] is not None:  # both clips were hit
        assert (fused[2].abs() == 3.0).any() and (fused[0].abs() == 3.0).any() and (fused[0].abs() < 3.0).any()


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_clips_gradient_passes_at_the_boundary_as_clamp_s(dtype):
    clip_backward = trained_step._functions()[2]
    p = torch.tensor([-4.0, -3.0, -2.5, 0.0, 2.5, 3.0, 4.0, 3.0 + 2**-6], dtype=dtype)
    dh, dp = torch.arange(1.0, 9.0, dtype=dtype), torch.empty(8, dtype=dtype)
    clip_backward(p.data_ptr(), dh.data_ptr(), dp.data_ptr(), 8, 3.0, int(dtype == torch.bfloat16))
    leaf = p.clone().requires_grad_()
    leaf.clamp(-3.0, 3.0).backward(dh)
    assert torch.equal(dp, leaf.grad)
    assert dp.tolist() == [0.0, 2.0, 3.0, 4.0, 5.0, 6.0, 0.0, 0.0]


@needs_kernel
def test_the_cell_clip_s_gradient_passes_at_the_boundary():
    pair = _pair()
    with torch.no_grad():
        for lstm in pair:  # input gates of 0: forget gate 1, input gate 1/2, tanh(0) = 0, so c' = c
            lstm.weight_ih_l0.zero_()
            lstm.bias_ih_l0.zero_()
            lstm.bias_hh_l0.zero_()
            lstm.bias_ih_l0[HIDDEN : 2 * HIDDEN] = 1e4
    c = torch.zeros(2, 1, HIDDEN)
    c[0, 0, :4] = torch.tensor([3.0, -3.0, 3.5, -3.5])
    x, h = torch.zeros(2, 1, 12), torch.zeros(2, 1, 12)
    fused = _window(pair, (3.0, 3.0), True, x, h, c, "fp32", [1])
    reference = _window(pair, (3.0, 3.0), False, x, h, c, "fp32", [1])
    dc_fused, dc_reference = fused[5], reference[5]
    torch.testing.assert_close(dc_fused, dc_reference, atol=1e-6, rtol=1e-6)
    assert (dc_fused[0, 0, :2] != 0).all() and (dc_fused[0, 0, 2:4] == 0).all()  # at the clip / past it


def _model() -> BiLM:
    torch.manual_seed(0)
    config = tiny()
    config = config.model_copy(update={"lstm": config.lstm.model_copy(update={"cell_clip": 0.5, "proj_clip": 0.5})})
    bilm = BiLM(config)
    init_bilm_tf(bilm)
    return bilm.train()


def _gradients(bilm: BiLM, precision: str) -> dict[str, torch.Tensor]:
    bilm.zero_grad(set_to_none=True)
    ids = batch_to_ids(SENTENCES)  # rows of 5, 1 and 8 tokens: rows leave the packed batch step by step
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        out = bilm(ids)
        loss = sum((layer.float() ** 2).sum() for layer in out["activations"][1:])
        loss = loss + sum((s.float() ** 2).sum() for s in out["state"])
    loss.backward()
    return {name: p.grad.clone() for name, p in bilm.named_parameters() if p.grad is not None}


@needs_kernel
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_model_s_gradients_are_the_reference_s(precision, monkeypatch):
    bilm = _model()
    calls = []
    window = trained_step.Window
    monkeypatch.setattr("elmo_core.bilm.lstm.Window", lambda *a: calls.append(1) or window(*a))
    reference = _gradients(bilm, precision)
    assert not calls  # not prepared: the reference runs
    assert bilm.prepare_training().one_node
    fused = _gradients(bilm, precision)
    assert calls  # and now the one-node steps
    assert reference.keys() == fused.keys() and any(name.startswith("lstm.") for name in fused)
    for name, grad in reference.items():
        if precision == "fp32":
            torch.testing.assert_close(fused[name], grad, atol=1e-5, rtol=1e-4, msg=name)
        else:  # the same roundings but for the exponential's: gradients point the same way
            cosine = torch.nn.functional.cosine_similarity(fused[name].flatten(), grad.flatten(), dim=0)
            assert cosine > 0.999, name
    calls.clear()
    with torch.no_grad():
        bilm(batch_to_ids(SENTENCES))
    assert not calls  # calls without gradients are inference's: its own kernels or the reference


def test_chosen_once_and_off_where_it_does_not_apply():
    assert not choose_training(torch.device("cpu"), tiny().lstm, one_node=False).one_node
    assert "PyTorch ops (not chosen)" in str(choose_training(torch.device("cpu"), tiny().lstm, one_node=False))
    assert not choose_training(torch.device("cuda"), tiny().lstm).one_node  # CUDA's launches run ahead of the GPU


def test_off_with_elmo_no_fused_gates_and_the_reference_runs(c_kernels_off):
    chosen = choose_training(torch.device("cpu"), tiny().lstm)
    assert not chosen.one_node and "ELMO_NO_FUSED_GATES=1" in str(chosen)
    bilm = _model()
    bilm.prepare_training()
    assert _gradients(bilm, "fp32")  # the reference runs
