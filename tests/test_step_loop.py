"""A layer's steps in one C call (step_loop.py, lstm_steps.c) against the same steps from Python."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from elmo_core import BiLM
from elmo_core.bilm.kernels import fused_gates, step_loop
from elmo_core.bilm.lstm_math import reference_gates
from tests.helpers import random_tiny_model

# 15, 6, 24, 3 and 1 tokens (with <S> and </S>: the rows drop out four times, the last steps run one row)
SENTENCES = [
    ["I", "ate", "an", "apple", "."] * 3,
    ["Hi", "there", "."] * 2,
    ["The", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog", "today", "really", "."] * 2,
    ["苹果", "手机", "!"],
    ["Hi"],
]

pytestmark = pytest.mark.skipif(not step_loop.on(), reason=f"no C step loop here: {step_loop.describe()}")


def _random_model(**lstm) -> BiLM:
    bilm = random_tiny_model(**lstm)
    with torch.no_grad():  # biases that differ by direction and gate (bilm-tf's initialization makes them alike)
        for lstm_layer in bilm.lstm.all_layers():
            lstm_layer.bias_ih_l0.normal_(0.0, 0.5)
    return bilm


@pytest.fixture
def loop_calls(monkeypatch) -> list[list[int]]:
    """The batch sizes of every call of the C loop (it ran, from the step it was meant to)."""
    calls: list[list[int]] = []
    run = step_loop.lstm_steps
    monkeypatch.setattr(
        step_loop, "lstm_steps", lambda s, sizes, *a, **k: calls.append(list(sizes)) or run(s, sizes, *a, **k)
    )
    return calls


def _both(bilm: BiLM, sentences, **choices) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(the C loop's vectors, every step's from Python) of one model, in fp32."""
    assert bilm.prepare("fp32", **choices).step_loop
    looped = bilm.embed_sentences(sentences)
    assert not bilm.prepare("fp32", step_loop=False, **choices).step_loop
    return looped, bilm.embed_sentences(sentences)


@pytest.mark.parametrize(
    "lstm",
    [
        {"cell_clip": 3.0, "proj_clip": 3.0},  # the published models' clips
        {"cell_clip": 0.05, "proj_clip": 0.02},  # clips that bite at most cells
        {"cell_clip": 3.0, "proj_clip": 3.0, "projection_dim": 64},  # no projection: h is m (P = H)
        {"cell_clip": None, "proj_clip": None},  # no clips (nn.LSTM's model, here on the cells)
    ],
)
def test_the_loop_gives_every_step_s_numbers_as_rows_drop_out(lstm, loop_calls):
    bilm = _random_model(**lstm)
    looped, stepped = _both(bilm, SENTENCES, nn_lstm=False)
    for x, y in zip(looped, stepped, strict=True):
        np.testing.assert_allclose(x, y, atol=2e-6, rtol=0)
    lengths = sorted((len(s) + 2 for s in SENTENCES), reverse=True)
    every_step = [sum(n > t for n in lengths) for t in range(lengths[0])]
    assert loop_calls == [every_step, every_step]  # both layers, from the first step (weights oneDNN does not pack)


def test_on_packed_weights_the_loop_takes_over_from_its_row_count(loop_calls):
    """With oneDNN-packed weights (each step then fuses its input into the product) the loop starts at the first
    step of at most ``PACKED_ROWS`` rows, and gives the same numbers."""
    bilm = _random_model(cell_clip=3.0, proj_clip=3.0)
    sentences = [SENTENCES[i % 5][: 2 + i] for i in range(step_loop.PACKED_ROWS + 4)]  # 20 rows, 3 to 22 tokens
    looped, stepped = _both(bilm, sentences, min_packed=0)
    for x, y in zip(looped, stepped, strict=True):
        np.testing.assert_allclose(x, y, atol=2e-6, rtol=0)
    assert len(loop_calls) == 2
    assert all(sizes[0] <= step_loop.PACKED_ROWS < len(sentences) for sizes in loop_calls)


def test_a_lone_sentence_gets_what_it_gets_in_a_batch():
    bilm = _random_model(cell_clip=3.0, proj_clip=3.0)
    batch = bilm.embed_sentences(SENTENCES)
    for sentence, vectors in zip(SENTENCES, batch, strict=True):
        np.testing.assert_allclose(bilm.embed_sentences([sentence])[0], vectors, atol=1e-6, rtol=0)


def test_inputs_that_are_not_one_tensor_s_splits_are_copied_first():
    """Steps given as separate tensors (not the splits of one, which the loop reads in place) give the same numbers."""
    torch.manual_seed(1)
    hidden, proj, sizes = 32, 16, [3, 2, 2, 1]
    gates = torch.randn(2, sum(sizes), 4 * hidden)
    w_hh, w_hr = torch.randn(2, proj, 4 * hidden) * 0.2, torch.randn(2, hidden, proj) * 0.2
    h, c = torch.randn(2, 3, proj), torch.randn(2, 3, hidden)
    weights = {"w_hh": step_loop.panels(w_hh), "w_hr": step_loop.panels(w_hr), "cell_clip": 1.0, "proj_clip": 0.5}
    in_place = step_loop.lstm_steps(list(gates.split(sizes, dim=1)), sizes, h, c, **weights)
    copied = step_loop.lstm_steps([g.clone() for g in gates.split(sizes, dim=1)], sizes, h, c, **weights)
    reference = _python_steps(gates, sizes, h, c, w_hh, w_hr, 1.0, 0.5)
    for x, y, z in zip(in_place, copied, reference, strict=True):
        assert torch.equal(x, y)
        torch.testing.assert_close(x, z, atol=2e-6, rtol=0)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_every_thread_count_gives_the_same_numbers(threads):
    """Two threads run a direction each, without meeting; one, both in turn; three or more, a team over both that
    meets after each part of a step. Every way gives the steps written out in PyTorch, rows dropping out."""
    torch.manual_seed(2)
    hidden, proj, sizes = 96, 80, [5, 5, 4, 2, 2, 1]  # 4H = 6 panels and P = 2 panels (one of them partly padding)
    gates = torch.randn(2, sum(sizes), 4 * hidden)
    w_hh, w_hr = torch.randn(2, proj, 4 * hidden) * 0.2, torch.randn(2, hidden, proj) * 0.2
    h, c = torch.randn(2, 5, proj), torch.randn(2, 5, hidden)
    weights = {"w_hh": step_loop.panels(w_hh), "w_hr": step_loop.panels(w_hr), "cell_clip": 1.0, "proj_clip": 0.5}
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        looped = step_loop.lstm_steps(list(gates.split(sizes, dim=1)), sizes, h, c, **weights)
    finally:
        torch.set_num_threads(before)
    for x, y in zip(looped, _python_steps(gates, sizes, h, c, w_hh, w_hr, 1.0, 0.5), strict=True):
        torch.testing.assert_close(x, y, atol=2e-6, rtol=0)


def _python_steps(gates, sizes, h, c, w_hh, w_hr, cell_clip, proj_clip):
    """The steps written out in PyTorch around the reference gates; rows that end keep their last state."""
    h, c, outputs, first = h.clone(), c.clone(), [], 0
    for n in sizes:
        z = torch.bmm(h[:, :n], w_hh) + gates[:, first : first + n]
        m, c[:, :n] = reference_gates(z, c[:, :n], cell_clip)
        h[:, :n] = torch.bmm(m, w_hr).clamp(-proj_clip, proj_clip)
        outputs.append(h[:, :n].clone())
        first += n
    return torch.cat(outputs, dim=1), h, c


def test_off_when_asked_and_the_model_still_runs(monkeypatch):
    monkeypatch.setenv("ELMO_NO_STEP_LOOP", "1")
    step_loop._function.cache_clear()
    try:
        assert step_loop.describe() == "no (ELMO_NO_STEP_LOOP=1)"
        bilm = _random_model(cell_clip=3.0, proj_clip=3.0)
        assert not bilm.prepare("fp32").step_loop
        assert "steps in one C loop no" in str(bilm.kernels)
        assert bilm.embed_sentences(SENTENCES)[0].shape == (3, 15, 32)
    finally:
        step_loop._function.cache_clear()
    assert fused_gates.available()  # the gate kernel stays on
