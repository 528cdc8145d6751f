"""BiLM behaviour: API shapes, stateless independence, stateful carry semantics, fused path, odd input."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from elmo_core import BiLM, batch_to_ids
from elmo_core.bilm.inference import StateCarry
from elmo_core.bilm.packing import Packing
from tests.helpers import assert_same_vectors, cpu_precisions, needs_native_bf16
from tests.helpers import random_tiny_model as _random_model

SENTENCES = [
    ["I", "ate", "an", "apple", "."],
    ["苹果", "手机"],
    ["The", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog", "today", "."],
    ["Hi"],
]


@pytest.fixture(scope="module")
def model(allennlp_dir) -> BiLM:
    return BiLM.from_pretrained(str(allennlp_dir / "options.json"), str(allennlp_dir / "lm_weights.hdf5"))


def test_forward_api_shapes(model):
    with torch.no_grad():
        out = model(batch_to_ids(SENTENCES))
    assert len(out["activations"]) == 3
    for layer in out["activations"]:
        assert layer.shape == (4, 11, 32)
    assert out["mask"].tolist()[1] == [True, True] + [False] * 9
    # padding positions are zero in every layer
    assert all(float(layer[1, 2:].abs().max()) == 0.0 for layer in out["activations"])


def test_keep_boundaries_view(model):
    out = model(batch_to_ids(SENTENCES), keep_boundaries=True)
    assert out["activations"][0].shape == (4, 13, 32)
    assert out["mask"].sum(1).tolist() == [7, 4, 13, 3]
    stripped = model(batch_to_ids(SENTENCES))["activations"][2]
    assert torch.allclose(out["activations"][2][0, 1:6], stripped[0, :5])


def test_embed_sentences_shapes_unicode_long_and_empty(model):
    vecs = model.embed_sentences([[], ["苹果", "手机"], ["x" * 500, "é" * 100], ["a"]])
    assert [v.shape for v in vecs] == [(3, 0, 32), (3, 2, 32), (3, 2, 32), (3, 1, 32)]
    assert all(v.dtype == np.float32 and np.isfinite(v).all() for v in vecs)


def test_stateless_output_does_not_depend_on_the_batch(model):
    alone = [model.embed_sentences([s])[0] for s in SENTENCES]
    together = model.embed_sentences(SENTENCES)
    reordered = model.embed_sentences(SENTENCES[::-1] + [["filler"] * 30], batch_size=2)[:4][::-1]
    for a, b, c in zip(alone, together, reordered):
        np.testing.assert_allclose(a, b, atol=1e-6)
        np.testing.assert_allclose(a, c, atol=1e-6)
    # and it is deterministic
    again = model.embed_sentences(SENTENCES)
    assert all(np.array_equal(x, y) for x, y in zip(together, again))


def test_a_chunk_computes_each_words_input_gates_once(model, monkeypatch):
    """A chunk's passes each get the chunk's shared words (those more than one of them reads) first, the same rows in
    the same order, then their own words alone: layer 0's input product, which runs over every row of a pass's table
    that it did not keep, then covers each word of the chunk once. Same vectors as one sentence at a time."""
    sentences = [[f"w{i}", f"w{i + 1}", "the", "."] for i in range(0, 60, 2)] + [
        [f"v{i}", "the"] * 4 for i in range(12)
    ]
    alone = [model.embed_sentences([s])[0] for s in sentences]
    given, token_rows = [], model.token_rows

    def recording(ids, state=None, token_table=None, shared=None):
        given.append((ids, token_table, shared))
        return token_rows(ids, state=state, token_table=token_table, shared=shared)

    monkeypatch.setattr(model, "token_rows", recording)
    together = model.embed_sentences(sentences, max_batch_tokens=40)
    assert len(given) > 3
    shared = given[0][2]
    assert shared is not None and all(s is shared for _, _, s in given)  # one chunk: these sentences are few
    assert shared.count == 3  # the padding row, then "." and "the", which every pass reads
    for ids, table, _ in given:
        assert torch.equal(table[: shared.count], given[0][1][: shared.count])
        own = torch.unique(ids[ids >= shared.count])
        assert own.tolist() == list(range(shared.count, len(table)))  # every other row is the pass's own and read
    computed = shared.count + sum(len(table) - shared.count for _, table, _ in given)
    assert computed == 1 + len({w for s in sentences for w in s})
    for a, b in zip(alone, together, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_the_shared_words_are_at_most_as_many_as_the_largest_pass_reads():
    """Words spread evenly over a chunk's passes would make every pass's table hold half the chunk: the shared words
    are those read by the most passes, at most as many as the largest pass reads; the rest are each pass's own."""
    from elmo_core.bilm.inference import shared_first

    order, n_shared, most_own = shared_first([{"a", "b"}, {"c", "d"}, {"a", "c"}, {"b", "d"}])
    assert (order, n_shared, most_own) == (["a", "b", "c", "d"], 2, 2)  # all four shared by two passes: two kept
    order, n_shared, most_own = shared_first([{"a", "b", "z"}, {"c", "d", "z"}, {"a", "c", "z"}, {"b", "d"}])
    assert order[:3] == ["a", "b", "z"] and n_shared == 3 and most_own == 2  # z, read by three, comes first


@pytest.mark.parametrize("gate_kernel", [True, False], ids=["C gates", "PyTorch gates"])
def test_the_shared_rows_input_gates_are_kept_from_the_chunks_first_pass(model, gate_kernel):
    """The second pass of a chunk does not recompute its shared rows' input gates: given other numbers in those rows,
    it still gets the first pass's, with the C gate kernel and without."""
    from elmo_core.bilm.inference import SharedRows
    from elmo_core.bilm.kernels import fused_gates

    if gate_kernel and not fused_gates.available():
        pytest.skip(fused_gates.describe())
    table = model.token_embeddings(["<pad>", "the", "cat", "sat"])
    ids = torch.tensor([[1, 2, 3, 1]])
    other = table.clone()
    other[1:3] = torch.randn(2, table.shape[1])  # "the" and "cat" as another pass would never hold them
    try:
        assert model.prepare("fp32", gate_kernel=gate_kernel).cpu_cells
        with torch.no_grad():
            exact = model.token_rows(ids, token_table=table)[0]
            shared = SharedRows(count=3, capacity=len(table) + 2)
            model.token_rows(ids, token_table=table, shared=shared)
            kept = model.token_rows(ids, token_table=other, shared=shared)[0]
            recomputed = model.token_rows(ids, token_table=other)[0]
    finally:
        model.prepare("fp32")
    for a, b in zip(exact[1:], kept[1:], strict=True):  # the LSTM layers; layer 0 is the table itself
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    assert not torch.allclose(exact[1], recomputed[1], atol=1e-3)  # the other numbers do change a recomputation


def _stateful(model, carry: StateCarry, batch):
    """One call of bilm-tf's stateful protocol: the carried state in, the new state kept."""
    out = model(batch_to_ids(batch), state=carry.take(len(batch)))
    carry.keep(out["state"])
    return out


def test_stateful_carries_state_per_row(model):
    a, b = SENTENCES[0], SENTENCES[2]
    carry = StateCarry()
    first = model.embed_sentences([a, b], carry=carry)
    second = model.embed_sentences([a, b], carry=carry)
    assert not np.allclose(first[0], second[0], atol=1e-3)  # state changed the second pass
    np.testing.assert_allclose(first[0][0], second[0][0])  # layer 0 is context-free
    carry.reset()
    np.testing.assert_allclose(model.embed_sentences([a, b], carry=carry)[1], first[1], atol=1e-6)
    np.testing.assert_allclose(model.embed_sentences([a, b], stateful=True)[1], first[1], atol=1e-6)  # a fresh carry


def test_rows_beyond_a_smaller_batch_keep_their_state(model):
    a, b, c = SENTENCES[0], SENTENCES[2], SENTENCES[1]
    carry = StateCarry()
    _stateful(model, carry, [a, b, c])
    expected = _stateful(model, carry, [a, b, c])["activations"][2]

    carry = StateCarry()
    _stateful(model, carry, [a, b, c])
    _stateful(model, carry, [["Hello", "world"]])  # touches row 0 only
    got = _stateful(model, carry, [a, b, c])["activations"][2]
    assert torch.allclose(got[1:], expected[1:], atol=1e-6)
    assert not torch.allclose(got[0], expected[0], atol=1e-3)


def test_a_larger_batch_starts_new_rows_from_zero(model):
    carry = StateCarry()
    _stateful(model, carry, [SENTENCES[0]])
    got = _stateful(model, carry, [SENTENCES[0], SENTENCES[2]])["activations"][2][1, :11]
    fresh = model(batch_to_ids([SENTENCES[2]]))["activations"][2][0]
    assert torch.allclose(got, fresh, atol=1e-6)


def test_clipping_bounds_the_outputs_without_skip_connections():
    bilm = _random_model(use_skip_connections=False, proj_clip=0.05, cell_clip=0.1)
    with torch.no_grad():
        for name, p in bilm.named_parameters():
            p.mul_(20.0) if "weight" in name else None
        out = bilm(batch_to_ids(SENTENCES))["activations"]
    assert float(out[1].abs().max()) <= 0.05 + 1e-7 and float(out[2].abs().max()) <= 0.05 + 1e-7


def test_nn_lstm_is_chosen_for_a_model_without_clips_and_equals_the_cells():
    """``kernels.choose`` picks PyTorch's nn.LSTM for an unclipped model (and says so); it gives the numbers of the
    reference cell and of the CPU cells, the carried state included."""
    bilm = _random_model(seed=3, cell_clip=None, proj_clip=None)
    batches = [SENTENCES, SENTENCES[:2], [[], ["a", "b", "c"]], SENTENCES[::-1]]
    runs = {}
    for name, choices in {"nn.LSTM": {}, "cells": {"nn_lstm": False}}.items():
        kernels = bilm.prepare("fp32", **choices)
        assert kernels.nn_lstm == (name == "nn.LSTM")
        assert ("PyTorch's nn.LSTM" in str(kernels)) == (name == "nn.LSTM")
        carry = StateCarry()
        with torch.no_grad():  # stateful, so the carried states are compared too
            runs[name] = ([_stateful(bilm, carry, batch)["activations"] for batch in batches], carry.state)
    bilm.kernels = None  # nothing chosen: the reference cell
    carry = StateCarry()
    with torch.no_grad():
        runs["reference"] = ([_stateful(bilm, carry, batch)["activations"] for batch in batches], carry.state)
    (fused, fused_state), *others = runs.values()
    for outputs, state in others:
        for x, y in zip(sum(fused, []), sum(outputs, [])):
            assert torch.allclose(x, y, atol=1e-5)
        for x, y in zip(fused_state, state):
            assert torch.allclose(x, y, atol=1e-5)
    assert "PyTorch's nn.LSTM" in str(bilm.prepare_training())  # training takes it too
    assert not bilm.prepare("int8").nn_lstm  # int8's products run in the CPU cells only


def test_nn_lstm_refuses_a_clipped_model():
    with pytest.raises(ValueError, match="cannot clip"):
        _random_model().prepare("fp32", nn_lstm=True)
    assert not _random_model().prepare("fp32").nn_lstm


def test_the_backward_lstm_reads_each_row_reversed_within_its_length():
    index = torch.arange(12).view(2, 6)
    packing = Packing.of(torch.tensor([4, 6]))
    forward, backward = packing.read(index, None)
    rows, steps = (packing.position(torch.tensor([r] * n), torch.arange(n)) for r, n in ((0, 4), (1, 6)))
    assert backward[rows].tolist() == [3, 2, 1, 0] and backward[steps].tolist() == [11, 10, 9, 8, 7, 6]
    assert forward[rows].tolist() == [0, 1, 2, 3] and forward[steps].tolist() == [6, 7, 8, 9, 10, 11]


def test_gradients_flow_in_training_mode():
    bilm = _random_model().train()
    out = bilm(batch_to_ids(SENTENCES))["activations"]
    sum(layer.sum() for layer in out).backward()
    grads = {n: p.grad for n, p in bilm.named_parameters() if p.requires_grad}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    assert not bilm.lstm.forward_layers[0].bias_hh_l0.requires_grad  # the constant forget +1


def test_char_cnn_truncation_keeps_the_max_exact():
    """The CNN stops after the longest word + the widest filter; the full 50 positions give the same values (up to
    float rounding: the reference is plain Conv1d, the model runs a channels-last conv2d)."""
    bilm = _random_model(seed=5)
    cnn = bilm.token_encoder.char_cnn
    ids = batch_to_ids([["a", "bb", "longer-word", "é" * 5, "<S>"]])[0]
    with torch.no_grad():
        fast = cnn(ids)
        x = cnn.char_embedding(ids).transpose(1, 2)  # all 50 positions, through plain Conv1d
        full = torch.cat([cnn.activation(conv(x).amax(-1)) for conv in cnn.convs], -1)
    assert torch.allclose(fast, full, atol=1e-6, rtol=0)


def test_cached_inference_weights_give_the_reference_kernel_s_numbers(model):
    ids = batch_to_ids(SENTENCES)
    with torch.no_grad():
        fast = model(ids)["activations"]
    prepared = model.kernels
    assert prepared is not None and prepared.cpu_cells  # chosen by the first call without gradients
    try:
        with torch.no_grad():
            model.kernels = None  # the reference cell
            plain = model(ids)["activations"]
    finally:
        model.kernels = prepared
    for x, y in zip(fast, plain):
        assert torch.allclose(x, y, atol=1e-6)


def test_packed_step_weights_give_the_bmm_numbers_in_both_precisions(model):
    """The oneDNN-packed per-step products (packed.py) are the same products as bmm, as rows drop out step by step."""
    from elmo_core.bilm.kernels import packed as packed_module

    assert packed_module.packing_available() == torch.backends.mkldnn.is_available()  # never silently off
    sentences = [s * 3 for s in SENTENCES]  # 15, 6 and 33 tokens: the active rows shrink twice
    prepared = model.kernels
    try:
        packed = {}
        for precision in cpu_precisions():  # the fixture's weights are far below the size that pays: force it
            assert "yes (hh, hr, cat)" in str(model.prepare(precision, min_packed=0))
            packed[precision] = model.embed_sentences(sentences, precision=precision)
        for precision, vectors in packed.items():
            assert "packed for oneDNN no" in str(model.prepare(precision, min_packed=None))
            assert_same_vectors(vectors, model.embed_sentences(sentences, precision=precision), precision, 1e-5)
    finally:
        model.kernels = prepared


@needs_native_bf16
def test_token_encoder_bf16_weights_cast_once_give_autocast_s_numbers(model):
    ids = batch_to_ids(SENTENCES).view(-1, 50)
    encoder = model.token_encoder
    kernels = model.prepare("bf16")
    try:
        with torch.no_grad():
            cached = kernels.token_encoder(encoder)(ids)
            assert kernels.token_encoder(encoder) is kernels.token_encoder(encoder)  # made once
            assert kernels.token_encoder(encoder).highways[0].carry.weight.dtype == torch.bfloat16
            with torch.autocast("cpu", dtype=torch.bfloat16):
                cast_per_call = encoder(ids)
    finally:
        model.prepare("fp32")
    assert cached.dtype == torch.bfloat16 and torch.equal(cached, cast_per_call)


def test_elmo_lstm_rows_of_length_zero_keep_their_state():
    bilm = _random_model(seed=6)
    ids = batch_to_ids([["a", "b", "c", "d"], [], ["e", "f"]])  # no boundaries added with two streams
    state = tuple(torch.randn_like(s) for s in bilm.lstm.zero_state(3, torch.device("cpu")))
    with torch.no_grad():
        out = bilm(ids, state, backward_inputs=ids)
    outputs, (h, c) = out["activations"][1:], out["state"]
    assert torch.equal(h[:, :, 1], state[0][:, :, 1]) and torch.equal(c[:, :, 1], state[1][:, :, 1])
    assert not torch.allclose(h[:, :, 0], state[0][:, :, 0])
    assert all(float(layer[1].abs().max()) == 0.0 for layer in outputs)
    assert all(float(layer[2, 2:].abs().max()) == 0.0 for layer in outputs)


def test_the_boundary_rows_follow_the_token_encoder_s_weights():
    """A pass given a token table adds <S> and </S> from rows kept between passes: they must be the rows of the
    weights as they are now (after a training step or a load), as a fresh model with these weights computes them."""
    model = _random_model()
    sentence = [["a", "b", "c"]]
    before = model.embed_sentences(sentence)[0]
    with torch.no_grad():
        model.token_encoder.char_cnn.char_embedding.weight.mul_(1.5)  # an in-place step: the same tensor, changed
    after = model.embed_sentences(sentence)[0]
    fresh = _random_model()
    fresh.load_state_dict(model.state_dict())
    np.testing.assert_allclose(after, fresh.embed_sentences(sentence)[0], atol=1e-6, rtol=0)
    assert not np.allclose(before[1], after[1], atol=1e-4)


def test_the_word_cache_drops_the_least_recently_used_never_the_batch_s_own():
    """``WordCache`` (and the ONNX server's ``OnnxWords``, through the same ``WordRows``): past its bytes the words
    used longest ago go first; a word used again becomes recent; a batch larger than the cache keeps all its words;
    only missing words are computed, and a kept row is the word's layer 0."""
    from elmo_core.bilm.inference import WordCache

    model = _random_model()
    row_bytes = model.config.lstm.projection_dim * 4
    cache = WordCache(model, max_bytes=3 * row_bytes)
    cache.table(["a", "b"])
    cache.table(["c", "d"])
    assert list(cache.rows.rows) == ["b", "c", "d"] and cache.missed == 2
    cache.table(["b", "e"])
    assert list(cache.rows.rows) == ["d", "b", "e"] and cache.missed == 1
    table = cache.table(["p", "q", "r", "s"])
    assert list(cache.rows.rows) == ["p", "q", "r", "s"] and cache.missed == 4
    torch.testing.assert_close(table.table[1:], model.token_embeddings(["p", "q", "r", "s"]), atol=1e-6, rtol=0)
