"""The biLM against the outputs the original TensorFlow code produced (tests/fixtures, atol 1e-5)."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from elmo_core import BiLM, batch_to_ids
from elmo_core.bilm.inference import TokenCache
from elmo_core.data.vocab import read_vocab_file

ATOL = 1e-5


def _expected(path: Path, i: int) -> np.ndarray:
    with h5py.File(path) as f:
        return np.concatenate([f[str(i)][0], f[str(i)][1]], axis=-1)


def _max_protocol_error(
    bilm: BiLM, sentences, expected_pattern: Path, to_ids=batch_to_ids, stateful=True, token_table=None
) -> float:
    """The fixtures' stateful protocol: batch i holds sentences[0][i], [1][i], [2][i]; state carried by row."""
    state = None
    worst = 0.0
    with torch.no_grad():
        for i in range(10):
            batch = [sentences[k][i].split() for k in range(3)]
            out = bilm(to_ids(batch), state=state, token_table=token_table)
            state = out["state"] if stateful else None
            top = out["activations"][-1]
            for k in range(3):
                got = top[k, : len(batch[k])].numpy()
                want = _expected(Path(str(expected_pattern).format(k=k)), i)
                assert got.shape == want.shape
                worst = max(worst, float(np.abs(got - want).max()))
    return worst


@pytest.fixture(scope="module")
def bilm_tf_model(bilm_tf_dir) -> BiLM:
    return BiLM.from_pretrained(
        str(bilm_tf_dir / "model" / "options.json"), str(bilm_tf_dir / "model" / "lm_weights.hdf5")
    )


@pytest.fixture(scope="module")
def allennlp_model(allennlp_dir) -> BiLM:
    return BiLM.from_pretrained(str(allennlp_dir / "options.json"), str(allennlp_dir / "lm_weights.hdf5"))


def test_bilm_tf_fixture_without_skip_connections(bilm_tf_model, bilm_tf_dir, fixture_sentences):
    assert not bilm_tf_model.config.lstm.use_skip_connections
    err = _max_protocol_error(bilm_tf_model, fixture_sentences, bilm_tf_dir / "model" / "lm_embeddings_{k}.hdf5")
    assert err < ATOL


def test_allennlp_fixture_with_skip_connections(allennlp_model, allennlp_dir, fixture_sentences):
    assert allennlp_model.config.lstm.use_skip_connections
    err = _max_protocol_error(allennlp_model, fixture_sentences, allennlp_dir / "lm_embeddings_{k}.hdf5")
    assert err < ATOL


def test_zero_state_per_batch_does_not_match_the_fixture(allennlp_model, allennlp_dir, fixture_sentences):
    """The fixture really tests state carrying: stateless calls are off by far more than the tolerance."""
    err = _max_protocol_error(
        allennlp_model, fixture_sentences, allennlp_dir / "lm_embeddings_{k}.hdf5", stateful=False
    )
    assert err > 0.5


def test_context_independent_token_embeddings(allennlp_model, allennlp_dir):
    vocab = read_vocab_file(allennlp_dir / "vocab_test.txt")
    assert len(vocab) == 458
    with h5py.File(allennlp_dir / "elmo_token_embeddings.hdf5") as f:
        expected = f["embedding"][...]
    got = allennlp_model.token_embeddings(vocab).numpy()
    assert np.abs(got - expected).max() < ATOL


def test_token_input_mode_reproduces_the_fixture(allennlp_dir, fixture_sentences):
    bilm = BiLM.from_pretrained(str(allennlp_dir / "options.json"), str(allennlp_dir / "lm_weights.hdf5"))
    cache = TokenCache(bilm, read_vocab_file(allennlp_dir / "vocab_test.txt"))
    err = _max_protocol_error(
        bilm, fixture_sentences, allennlp_dir / "lm_embeddings_{k}.hdf5", to_ids=cache.ids, token_table=cache.table
    )
    assert err < ATOL


def test_layer_zero_is_the_token_embedding_twice(allennlp_model):
    sentence = ["The", "apple", "fell", "."]
    layers = allennlp_model.embed_sentences([sentence])[0]
    emb = allennlp_model.token_embeddings(sentence).numpy()
    assert np.allclose(layers[0], np.concatenate([emb, emb], axis=-1), atol=1e-6)
