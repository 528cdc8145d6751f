"""The C gate kernel (fused_gates.py, lstm_gates.c) against PyTorch's gate arithmetic, alone and inside the model."""

from __future__ import annotations

import shutil

import pytest
import torch

from elmo_core.bilm.kernels import fused_gates
from tests.helpers import assert_same_vectors, cpu_precisions
from tests.helpers import random_tiny_model as _random_model

HIDDEN = 40  # not a multiple of the 16 float32 lanes: the vector loop's remainder runs too
SENTENCES = [["I", "ate", "an", "apple", "."], ["Hi"], ["The", "quick", "brown", "fox", "jumps", "over", "it", "."]]


def _reference(z: torch.Tensor, c: torch.Tensor, clip: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """lstm.LstmCell.gates: TensorFlow's LSTMCell with the cell clipped."""
    h = z.shape[-1] // 4
    sig = torch.sigmoid(z)
    c = sig[..., h : 2 * h] * c + sig[..., :h] * torch.tanh(z[..., 2 * h : 3 * h])
    if clip is not None:
        c = c.clamp(-clip, clip)
    return sig[..., 3 * h :] * torch.tanh(c), c


@pytest.fixture(autouse=True)
def _fresh_library():
    yield
    fused_gates._library.cache_clear()


def test_the_kernel_is_built_wherever_a_c_compiler_is():
    if shutil.which("cc") or shutil.which("gcc") or shutil.which("clang"):
        assert fused_gates.available(), fused_gates.describe()  # never silently off
        assert fused_gates.describe() == "yes"


@pytest.mark.parametrize("y_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("x_kind", ["none", "per-row", "table", "bf16 table"])
@pytest.mark.parametrize("m_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("clip", [None, 3.0])
def test_kernel_gives_pytorch_s_gates(y_dtype, x_kind, m_dtype, clip):
    if not fused_gates.available():
        pytest.skip(fused_gates.describe())
    g = torch.Generator().manual_seed(0)
    rows = 5
    y = (torch.randn(2, rows, 4 * HIDDEN, generator=g) * 4).to(y_dtype)
    y[0, 0, :8] = torch.tensor([90.0, -90.0, 1e4, -1e4, 0.0, 1e-30, 20.0, -20.0]).to(y_dtype)  # saturation, tiny
    c = torch.randn(2, rows, HIDDEN, generator=g) * 3
    bias = torch.randn(2, 1, 4 * HIDDEN, generator=g)
    x, x_rows, z = None, None, y.float() + bias
    if x_kind == "per-row":
        x = torch.randn(2, rows, 4 * HIDDEN, generator=g)
        z = z + x
    elif x_kind.endswith("table"):
        x = torch.randn(7, 4 * HIDDEN, generator=g).to(torch.bfloat16 if x_kind == "bf16 table" else torch.float32)
        x_rows = torch.tensor([[6, 0, 3, 3, 1], [2, 5, 4, 0, 6]])
        z = z + x.float()[x_rows]
    m, c_new = fused_gates.lstm_gates(y, c, bias, x, x_rows=x_rows, cell_clip=clip, m_dtype=m_dtype)
    m_ref, c_ref = _reference(z, c, clip)
    assert m.dtype == m_dtype and c_new.dtype == torch.float32
    assert torch.isfinite(m.float()).all() and torch.isfinite(c_new).all()
    torch.testing.assert_close(c_new, c_ref, atol=1e-6, rtol=0)
    if m_dtype == torch.float32:
        torch.testing.assert_close(m, m_ref, atol=1e-6, rtol=0)
    else:  # one rounding to bfloat16, to nearest even
        assert (m.float() - m_ref).abs().max() <= 2**-9


def test_g_scale_undoes_weights_scaled_by_two():
    if not fused_gates.available():
        pytest.skip(fused_gates.describe())
    y, c = torch.randn(2, 3, 4 * HIDDEN), torch.randn(2, 3, HIDDEN)
    bias = torch.zeros(2, 1, 4 * HIDDEN)
    scaled = y.clone()
    scaled[..., 2 * HIDDEN : 3 * HIDDEN] *= 2
    plain = fused_gates.lstm_gates(y, c, bias)
    undone = fused_gates.lstm_gates(scaled, c, bias, g_scale=0.5)
    for a, b in zip(plain, undone):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=0)


def test_kernel_refuses_rows_outside_its_table():
    if not fused_gates.available():
        pytest.skip(fused_gates.describe())
    y, c, table = torch.randn(2, 2, 4 * HIDDEN), torch.randn(2, 2, HIDDEN), torch.randn(3, 4 * HIDDEN)
    with pytest.raises(ValueError, match="row numbers of the 3-row table"):
        fused_gates.lstm_gates(y, c, torch.zeros(2, 1, 4 * HIDDEN), table, x_rows=torch.tensor([[0, 1], [2, 3]]))


def test_built_once_into_the_cache_then_loaded(tmp_path, monkeypatch):
    if not fused_gates.available():
        pytest.skip(fused_gates.describe())
    monkeypatch.setenv("ELMO_CACHE_DIR", str(tmp_path))
    fused_gates._library.cache_clear()
    assert fused_gates.available()
    (built,) = (tmp_path / "kernels").glob("lstm_gates-*.so")  # the machine's cache, beside its models
    stamp = built.stat().st_mtime_ns
    fused_gates._library.cache_clear()
    assert fused_gates.available() and built.stat().st_mtime_ns == stamp  # reused, not rebuilt
    assert list((tmp_path / "kernels").iterdir()) == [built]  # no partial build left behind


def test_off_without_a_compiler_or_when_asked_and_the_model_still_runs(monkeypatch):
    monkeypatch.setattr(fused_gates.shutil, "which", lambda name: None)
    fused_gates._library.cache_clear()
    assert fused_gates.describe() == "no (no C compiler found (set CC))"
    assert _random_model().embed_sentences(SENTENCES, precision=cpu_precisions()[-1])[0].shape == (3, 5, 32)
    monkeypatch.setenv("ELMO_NO_FUSED_GATES", "1")
    fused_gates._library.cache_clear()
    assert fused_gates.describe() == "no (ELMO_NO_FUSED_GATES=1)"


@pytest.mark.parametrize("packed", [False, True])
def test_model_with_the_kernel_gives_the_pytorch_numbers(monkeypatch, packed):
    """Both inference kernels, with the products on bmm and on packed weights, as rows drop out step by step."""
    if not fused_gates.available():
        pytest.skip(fused_gates.describe())
    min_packed = 0 if packed else None  # the tiny model's weights are far below the size where packing pays
    bilm = _random_model(cell_clip=3.0, proj_clip=3.0)
    sentences = [s * 3 for s in SENTENCES]
    calls: list[tuple] = []
    kernel = fused_gates.lstm_gates
    monkeypatch.setattr(fused_gates, "lstm_gates", lambda *a, **k: calls.append(a) or kernel(*a, **k))
    fused = {}
    for precision in cpu_precisions():  # bf16 where the CPU has it (elsewhere it is refused)
        # every step from Python (the C step loop, which would run most of them, has its own tests)
        assert bilm.prepare(precision, min_packed=min_packed, step_loop=False).gate_kernel
        fused[precision] = bilm.embed_sentences(sentences, precision=precision)
    assert len(calls) == len(fused) * 2 * (24 + 2)  # precisions x layers x steps of the longest sentence: it ran
    for precision, vectors in fused.items():
        assert not bilm.prepare(precision, min_packed=min_packed, gate_kernel=False).gate_kernel
        assert_same_vectors(vectors, bilm.embed_sentences(sentences, precision=precision), precision, fp32_atol=2e-6)
