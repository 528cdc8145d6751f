"""The char CNN's sparse backward (kernels/char_cnn.py, char_cnn.c) against the reference CharCNN under autograd:
values and every gradient, on words short and long, both activations, published widths, in fp32 and bf16; then the
choice that turns it on, and the whole model's training call."""

from __future__ import annotations

import shutil

import pytest
import torch

from elmo_core import BiLM, batch_to_ids
from elmo_core.bilm.kernels import char_cnn, choose_training
from elmo_core.bilm.model import CharCNN
from elmo_core.config import CharCNNConfig, CharEmbeddingConfig, tiny
from elmo_core.text.chars import tokens_to_char_array

# a one-letter word (windows in padding win), repeated letters (equal values inside the word), the longest word
# there is (50 chars: nothing to cut), and ordinary ones
WORDS = ["a", "aaaaaaa", "zz", "apple", "Deep", "contextualized", "x" * 60, "représentations", ".", "naïve"]

needs_kernel = pytest.mark.skipif(not char_cnn.available(), reason=char_cnn.describe())


def test_the_kernel_is_built_wherever_a_c_compiler_is():
    if shutil.which("cc") or shutil.which("gcc") or shutil.which("clang"):
        assert char_cnn.available(), char_cnn.describe()
        assert choose_training(torch.device("cpu"), tiny().lstm).sparse_char_cnn


def _cnn(activation: str, filters: list[list[int]]) -> CharCNN:
    torch.manual_seed(0)
    cnn = CharCNN(CharCNNConfig(embedding=CharEmbeddingConfig(dim=5), filters=filters, activation=activation))
    with torch.no_grad():
        cnn.char_embedding.weight.normal_()
        cnn.char_embedding.weight[0] = 0.0
    return cnn


def _run(cnn: CharCNN, ids: torch.Tensor, precision: str, sparse: bool) -> list[torch.Tensor]:
    """The CharCNN's output and the gradients of a loss of it w.r.t. the table, each width's weight and bias."""
    cnn.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        out = cnn(ids, char_cnn.conv_max if sparse else None)
    g = torch.Generator().manual_seed(1)
    (out.float() * torch.randn(out.shape, generator=g)).sum().backward()
    return [out.detach().float(), *(p.grad for p in cnn.parameters())]


@needs_kernel
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("activation", ["relu", "tanh"])
def test_values_and_gradients_are_the_reference_s(precision, activation):
    filters = [[1, 4], [2, 8], [3, 16], [4, 32], [7, 33]]  # the published widths run to 7; 33 filters: odd
    cnn = _cnn(activation, filters)
    ids = torch.from_numpy(tokens_to_char_array(WORDS, 50)).long()
    ids = torch.cat([ids, torch.zeros_like(ids[:1])])  # and a padding token's row, all char id 0
    reference, sparse = _run(cnn, ids, precision, False), _run(cnn, ids, precision, True)
    torch.testing.assert_close(sparse[0], reference[0], atol=0, rtol=0)  # the same forward ops
    assert len(sparse) == len(reference) == 2 + 2 * len(filters)  # the output, the table, each width's two
    for name, ours, theirs in zip(
        ["table"] + [f"{k}.{w}" for w, _ in filters for k in "wb"], sparse[1:], reference[1:]
    ):
        assert ours.dtype == theirs.dtype == torch.float32 and ours.shape == theirs.shape, name
        if precision == "fp32":
            torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5, msg=name)
        else:  # oneDNN's backward rounds its sums to bfloat16, this one keeps them float32: the same direction
            cosine = torch.nn.functional.cosine_similarity(ours.flatten(), theirs.flatten(), dim=0)
            assert cosine > 0.9999, name
    assert (sparse[1][0] == 0).all()  # the table's padding row never learns
    used = set(ids.unique().tolist())
    unused = [i for i in range(sparse[1].shape[0]) if i not in used]
    assert (sparse[1][unused] == 0).all() and (sparse[1][sorted(used - {0})].abs().sum(-1) > 0).all()


@needs_kernel
def test_many_words_run_on_every_thread_to_the_same_gradients():
    cnn = _cnn("relu", [[1, 32], [2, 32], [3, 64], [4, 128]])
    torch.manual_seed(2)
    words = ["".join(chr(97 + int(c)) for c in torch.randint(0, 26, (int(n),))) for n in torch.randint(1, 18, (300,))]
    ids = torch.from_numpy(tokens_to_char_array(words, 50)).long()
    assert ids.shape[0] * 128 >= char_cnn.PARALLEL_PAIRS  # the threaded loops run
    reference, sparse = _run(cnn, ids, "fp32", False), _run(cnn, ids, "fp32", True)
    for ours, theirs in zip(sparse, reference):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-5)


@needs_kernel
def test_the_training_call_runs_it_and_inference_does_not(monkeypatch):
    torch.manual_seed(0)
    bilm = BiLM(tiny()).train()
    calls = []
    monkeypatch.setattr("elmo_core.bilm.model.conv_max", lambda *a: calls.append(1) or char_cnn.conv_max(*a))
    ids = batch_to_ids([["I", "ate", "an", "apple", "."], ["Hi"]])
    bilm(ids)["activations"][0].sum().backward()
    assert not calls  # not prepared: the reference
    assert bilm.prepare_training().sparse_char_cnn
    bilm(ids)["activations"][0].sum().backward()
    assert len(calls) == len(tiny().char_cnn.filters)  # one node per width
    calls.clear()
    with torch.no_grad():
        bilm(ids)
    assert not calls


def test_chosen_once_and_off_where_it_does_not_apply():
    chosen = choose_training(torch.device("cpu"), tiny().lstm, sparse_char_cnn=False)
    assert not chosen.sparse_char_cnn and "dense backward (not chosen)" in str(chosen)
    assert not choose_training(torch.device("cuda"), tiny().lstm).sparse_char_cnn
    with pytest.raises(ValueError, match="runs on the CPU"):
        char_cnn.conv_max(torch.zeros(1, 2, 1, 3, device="meta"), torch.zeros(1, 3, dtype=torch.long), *[None] * 3)


def test_off_with_elmo_no_fused_gates(c_kernels_off):
    chosen = choose_training(torch.device("cpu"), tiny().lstm)
    assert not chosen.sparse_char_cnn and "ELMO_NO_FUSED_GATES=1" in str(chosen)
