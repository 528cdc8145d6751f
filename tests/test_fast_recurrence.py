"""The clipped recurrence a layer at a time (``kernels/layer_steps.py``: CUDA's inference cell) against the reference
cell, on the CPU: the padded rows, the chunks and the masks in plain PyTorch, and the step compiled by
``torch.compile`` (inductor's C++ here; Triton on CUDA, ``tests/test_gpu.py``). fp32 within 1e-5 of the reference
and of the TensorFlow fixtures; bf16 by cosine to fp32, as ``tests/test_precision.py`` holds the CPU's bf16."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from elmo_core import BiLM, batch_to_ids
from elmo_core.bilm.kernels import choice, layer_steps
from elmo_core.bilm.kernels.cache import WeightCache
from elmo_core.bilm.lstm import LstmCell, _recurrence
from elmo_core.precision import cpu_has_native_bf16, resolve_precision
from tests.helpers import needs_native_bf16, random_tiny_model
from tests.test_model_fixtures import ATOL, _max_protocol_error

# 15, 6, 24, 3, 1 and 0 tokens: rows drop out four times, 26 steps (chunks 16, 8, 2), 5 rows (bucket 8)
SENTENCES = [
    ["I", "ate", "an", "apple", "."] * 3,
    ["Hi", "there", "."] * 2,
    ["The", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog", "today", "really", "."] * 2,
    ["苹果", "手机", "!"],
    ["Hi"],
    [],
]
CLIPS = [
    {"cell_clip": 3.0, "proj_clip": 3.0},  # the published models' clips
    {"cell_clip": 0.05, "proj_clip": 0.02},  # clips that bite at most cells
    {"cell_clip": 3.0, "proj_clip": 3.0, "projection_dim": 64},  # no projection: h is m
    {"cell_clip": None, "proj_clip": None},  # no clips (nn.LSTM's model by default; here forced onto the cell)
]
compiles = pytest.mark.skipif(
    not layer_steps.compile_available(torch.device("cpu"))[0],
    reason=f"torch.compile cannot run here: {layer_steps.compile_available(torch.device('cpu'))[1]}",
)


def _random_model(**lstm) -> BiLM:
    bilm = random_tiny_model(**lstm)
    with torch.no_grad():  # biases that differ by direction and gate
        for layer in bilm.lstm.all_layers():
            layer.bias_ih_l0.normal_(0.0, 0.5)
    return bilm


def _reference_and_layered(bilm: BiLM, ids: torch.Tensor, state=None, **choices) -> tuple[dict, dict]:
    """One call through the reference ``LstmCell`` (nothing prepared) and one through ``LayerCell``."""
    with torch.no_grad():
        bilm.kernels = None
        reference = bilm(ids, state=state)
        assert bilm.prepare("fp32", layer_at_once=True, nn_lstm=False, **choices).layer_at_once
        return reference, bilm(ids, state=state)


def _assert_same(reference: dict, layered: dict, atol: float = ATOL) -> None:
    for x, y in zip(reference["activations"], layered["activations"], strict=True):
        torch.testing.assert_close(y, x, atol=atol, rtol=0)
    for x, y in zip(reference["state"], layered["state"], strict=True):
        torch.testing.assert_close(y.float(), x.float(), atol=atol, rtol=0)


def test_row_buckets_pad_at_most_a_third_and_chunks_cover_every_step_once():
    assert [layer_steps.row_bucket(n) for n in (1, 8, 9, 13, 17, 33, 100, 1000)] == [8, 8, 12, 16, 24, 48, 128, 1024]
    for rows in range(1, 5000):
        bucket = layer_steps.row_bucket(rows)
        assert rows <= bucket and (bucket <= 8 or bucket * 2 < rows * 3)
    assert layer_steps.chunk_sizes(23) == [16, 4, 2, 1]
    assert all(sum(layer_steps.chunk_sizes(t)) == t for t in range(200))
    assert layer_steps.allowed_chunks(1024) == (16, 8, 4, 2, 1) and layer_steps.allowed_chunks(4096) == (4, 2, 1)
    assert layer_steps.allowed_chunks(65_536) == (1,) and layer_steps.chunk_sizes(7, (4, 2, 1)) == [4, 2, 1]


def test_a_layer_at_once_is_the_reference_recurrence_with_state_in_and_out():
    """One layer's cell against ``lstm._recurrence`` over ``LstmCell``: 13 rows (bucket 16: three padded), 23 steps
    (chunks 16, 4, 2, 1), rows ending at every few steps, a nonzero starting state."""
    lstm = _random_model().lstm
    pair = (lstm.forward_layers[1], lstm.backward_layers[1])
    sizes = [13] * 5 + [11] * 4 + [7] * 6 + [2] * 5 + [1] * 3
    torch.manual_seed(2)
    x = torch.randn(2, sum(sizes), pair[0].input_size)
    h0, c0 = torch.randn(2, 13, pair[0].proj_size) * 0.5, torch.randn(2, 13, pair[0].hidden_size)
    with torch.no_grad():
        reference = LstmCell(pair, (3.0, 0.5))
        want = _recurrence(reference, reference.steps(x, sizes), sizes, h0, c0)
        cell = layer_steps.LayerCell(
            pair, (3.0, 0.5), dtype=torch.float32, cache=WeightCache(), compiled=False, graphs=False
        )
        got = _recurrence(cell, cell.steps(x, sizes), sizes, h0, c0)
    assert got[0].shape == want[0].shape and got[1].shape == want[1].shape
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=0)
    one_step = cell.step(next(cell.steps(x, sizes)), h0, c0)  # ``lstm.Cell.step``: the first step alone
    torch.testing.assert_close(one_step[0], want[0][:, :13], atol=2e-6, rtol=0)


@pytest.mark.parametrize("lstm", CLIPS)
def test_fp32_is_the_reference_cell_s_as_rows_drop_out_and_state_is_carried(lstm):
    bilm = _random_model(**lstm)
    ids = batch_to_ids(SENTENCES)
    reference, layered = _reference_and_layered(bilm, ids, compiled=False)
    _assert_same(reference, layered)
    again = _reference_and_layered(bilm, ids, state=reference["state"], compiled=False)  # the stateful protocol
    _assert_same(*again)


def test_fp32_on_the_tensorflow_fixtures(bilm_tf_dir, allennlp_dir, fixture_sentences):
    for files, expected in [
        ((bilm_tf_dir / "model" / "options.json", bilm_tf_dir / "model" / "lm_weights.hdf5"), bilm_tf_dir / "model"),
        ((allennlp_dir / "options.json", allennlp_dir / "lm_weights.hdf5"), allennlp_dir),
    ]:
        bilm = BiLM.from_pretrained(*map(str, files))
        kernels = bilm.prepare("fp32", layer_at_once=True, compiled=False)
        assert "a layer at a time" in str(kernels)
        assert _max_protocol_error(bilm, fixture_sentences, expected / "lm_embeddings_{k}.hdf5") < ATOL


@needs_native_bf16
def test_bf16_is_as_close_to_fp32_as_the_cpu_cells_bf16(allennlp_dir, fixture_sentences):
    bilm = BiLM.from_pretrained(str(allennlp_dir))
    sentences = [s.split() for k in fixture_sentences for s in k]
    bilm.kernels = None
    exact = bilm.embed_sentences(sentences)
    bilm.prepare("bf16", layer_at_once=True, compiled=False)
    layered = bilm.embed_sentences(sentences, precision="bf16")
    for layer in range(bilm.num_layers):
        a, b = np.concatenate([x[layer] for x in exact]), np.concatenate([x[layer] for x in layered])
        cosines = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
        assert cosines.min() >= 0.999 and np.abs(a - b).max() < 0.05


def test_chosen_once_and_named_cuda_s_default_the_cpu_keeps_its_c_kernels(monkeypatch):
    lstm = _random_model().config.lstm
    cpu = choice.choose(torch.device("cpu"), resolve_precision("fp32", "cpu"), lstm)
    assert not cpu.layer_at_once and "a layer at a time" not in str(cpu)  # measured slower here: docs/what-runs.md
    cuda = choice.choose(torch.device("cuda"), resolve_precision("fp32", "cuda"), lstm)
    assert cuda.layer_at_once and cuda.cpu_cells and "the clipped LSTM a layer at a time" in str(cuda)
    assert not choice.choose(
        torch.device("cuda"), resolve_precision("fp32", "cuda"), lstm, cpu_cells=False
    ).cpu_cells  # the reference asked for
    if "int8" in choice.offered_precisions("cpu"):
        with pytest.raises(ValueError, match="no int8 products"):
            choice.choose(torch.device("cpu"), resolve_precision("int8", "cpu"), lstm, layer_at_once=True)
    monkeypatch.setenv("ELMO_NO_LAYER_STEPS", "1")
    assert not choice.choose(
        torch.device("cuda"), resolve_precision("fp32", "cuda"), lstm
    ).cpu_cells  # the reference cell
    unclipped = lstm.model_copy(update={"cell_clip": None, "proj_clip": None})
    assert choice.choose(
        torch.device("cuda"), resolve_precision("fp32", "cuda"), unclipped
    ).nn_lstm  # cuDNN where nothing clips
    monkeypatch.setenv("ELMO_NO_COMPILE", "1")
    off = choice.choose(torch.device("cpu"), resolve_precision("fp32", "cpu"), lstm, layer_at_once=True)
    assert not off.compiled and "PyTorch ops (ELMO_NO_COMPILE=1)" in str(off)


@pytest.mark.slow  # inductor's first C++ compile of the step takes ~30 s on 2 cores
@compiles
@pytest.mark.parametrize("lstm", CLIPS)
def test_the_compiled_step_is_the_reference_cell_s_in_fp32(lstm):
    import torch._dynamo.utils

    bilm = _random_model(**lstm)
    ids = batch_to_ids(SENTENCES)
    torch._dynamo.reset()  # compiled afresh in this test (inductor's disk cache keeps it quick)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    reference, layered = _reference_and_layered(bilm, ids, compiled=True)
    assert bilm.kernels.compiled and "compiled by torch.compile" in str(bilm.kernels)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs  # the step ran compiled (fullgraph)
    _assert_same(reference, layered)
    _assert_same(*_reference_and_layered(bilm, ids, state=reference["state"], compiled=True))


@pytest.mark.slow
@compiles
def test_the_compiled_step_on_the_tensorflow_fixture_and_in_bf16(allennlp_dir, fixture_sentences):
    bilm = BiLM.from_pretrained(str(allennlp_dir))
    bilm.prepare("fp32", layer_at_once=True, compiled=True)
    assert _max_protocol_error(bilm, fixture_sentences, allennlp_dir / "lm_embeddings_{k}.hdf5") < ATOL
    if cpu_has_native_bf16():
        sentences = [s.split() for k in fixture_sentences for s in k]
        exact = bilm.embed_sentences(sentences)
        bilm.prepare("bf16", layer_at_once=True, compiled=True)
        for a, b in zip(exact, bilm.embed_sentences(sentences, precision="bf16"), strict=True):
            cosines = (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))
            assert cosines.min() >= 0.999


def test_the_runtime_s_token_budget_is_the_cpu_s_default_here_and_grows_with_a_gpu_s_memory(allennlp_dir):
    from elmo_core.config import preset
    from elmo_core.runtime import Runtime
    from elmo_core.runtime.engine import CUDA_MAX_BATCH_TOKENS, MAX_BATCH_TOKENS, bytes_per_token, cuda_budget

    runtime = Runtime.open(str(allennlp_dir), device="cpu")
    assert runtime.max_batch_tokens == MAX_BATCH_TOKENS == 8192
    assert "8,192 padded tokens a pass (the cpu's default)" in runtime.line()
    assert runtime.facts()["max_batch_tokens_why"] == "the cpu's default"
    assert Runtime.open(str(allennlp_dir), device="cpu", max_batch_tokens=64).budget_why == "asked for"
    original = preset("original")
    assert bytes_per_token(original) == 4 * (2 * 4 * 4096 + 2 * 3 * 2 * 512)  # 152 KiB: the input gates dominate
    h100, why = cuda_budget(80 << 30, original)
    assert h100 == CUDA_MAX_BATCH_TOKENS and why.startswith("CUDA: a quarter of 80 GiB at 152 KiB a padded token")
    small_gpu = cuda_budget(16 << 30, original)[0]
    assert MAX_BATCH_TOKENS < small_gpu < h100 and small_gpu % 1024 == 0
    assert cuda_budget(2 << 30, original)[0] == MAX_BATCH_TOKENS  # never below the CPU's
