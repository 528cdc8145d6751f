"""Weight I/O: bilm-tf HDF5 in and out, bit-exact round trips, and errors that name the dataset."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from elmo_core import BiLM, batch_to_ids
from elmo_core.bilm.initialization import init_bilm_tf
from elmo_core.config import ModelConfig, tiny
from elmo_core.errors import ConfigError, WeightFileError


def _datasets(path: Path) -> dict[str, np.ndarray]:
    out = {}
    with h5py.File(path) as f:
        f.visititems(lambda name, obj: out.__setitem__(name, obj[...]) if isinstance(obj, h5py.Dataset) else None)
    return out


@pytest.mark.parametrize("fixture", ["allennlp_elmo", "bilm_tf/model"])
def test_round_trip_is_bit_exact(fixture, tmp_path):
    from tests.conftest import FIXTURES

    src = FIXTURES / fixture
    bilm = BiLM.from_pretrained(str(src / "options.json"), str(src / "lm_weights.hdf5"))
    bilm.save_pretrained(str(tmp_path / "out"))
    original, written = _datasets(src / "lm_weights.hdf5"), _datasets(tmp_path / "out" / "weights.hdf5")
    assert sorted(original) == sorted(written)
    for name, value in original.items():
        assert written[name].dtype == np.float32 and written[name].shape == value.shape, name
        assert written[name].tobytes() == value.astype(np.float32).tobytes(), name
    options = json.loads((tmp_path / "out" / "options.json").read_text())
    assert options["char_cnn"]["n_characters"] == 262
    assert options["lstm"] == json.loads((src / "options.json").read_text())["lstm"]
    # and the reloaded model computes the same thing
    again = BiLM.from_pretrained(str(tmp_path / "out"))
    ids = batch_to_ids([["A", "round", "trip", "."]])
    with torch.no_grad():
        for x, y in zip(bilm(ids)["activations"], again(ids)["activations"]):
            assert torch.equal(x, y)


def test_softmax_and_vocab_are_written_and_read(tmp_path):
    torch.manual_seed(0)
    config = tiny().model_copy(update={"n_tokens_vocab": 7})
    bilm = BiLM(config, vocab=["<S>", "</S>", "<UNK>", "the", "apple", "苹果", "."])
    init_bilm_tf(bilm)
    with torch.no_grad():
        bilm.softmax.bias.normal_()
        bilm.lstm.forward_layers[1].bias_hh_l0.add_(0.25)  # as if training had moved it
    bilm.save_pretrained(str(tmp_path))
    with h5py.File(tmp_path / "weights.hdf5") as f:
        assert f["softmax/W"].shape == (7, 16) and f["softmax/b"].shape == (7,)
    assert (tmp_path / "vocab.txt").read_text(encoding="utf-8").splitlines()[5] == "苹果"
    loaded = BiLM.from_pretrained(str(tmp_path))
    assert loaded.config.n_tokens_vocab == 7 and loaded.vocab == bilm.vocab
    assert torch.equal(loaded.softmax.weight, bilm.softmax.weight)
    ids = batch_to_ids([["the", "apple"]])
    with torch.no_grad():
        assert torch.allclose(bilm(ids)["activations"][2], loaded(ids)["activations"][2], atol=1e-6)


def test_options_without_softmax_key_pick_it_up_from_the_file(tmp_path, allennlp_dir):
    torch.manual_seed(0)
    bilm = BiLM(tiny().model_copy(update={"n_tokens_vocab": 5}))
    bilm.save_pretrained(str(tmp_path))
    options = json.loads((tmp_path / "options.json").read_text())
    del options["n_tokens_vocab"]
    (tmp_path / "options.json").write_text(json.dumps(options))
    assert BiLM.from_pretrained(str(tmp_path)).config.n_tokens_vocab == 5


def _copy_fixture(src: Path, dst: Path) -> Path:
    dst.mkdir()
    shutil.copy(src / "options.json", dst / "options.json")
    shutil.copy(src / "lm_weights.hdf5", dst / "weights.hdf5")
    return dst


def test_missing_dataset_is_named(tmp_path, allennlp_dir):
    model = _copy_fixture(allennlp_dir, tmp_path / "m")
    with h5py.File(model / "weights.hdf5", "a") as f:
        del f["RNN_1/RNN/MultiRNNCell/Cell1/LSTMCell/W_P_0"]
    with pytest.raises(
        WeightFileError, match=r"'RNN_1/RNN/MultiRNNCell/Cell1/LSTMCell/W_P_0' is missing \(expected shape \(64, 16\)"
    ):
        BiLM.from_pretrained(str(model))


def test_wrong_shape_names_dataset_and_both_shapes(tmp_path, allennlp_dir):
    model = _copy_fixture(allennlp_dir, tmp_path / "m")
    with h5py.File(model / "weights.hdf5", "a") as f:
        del f["CNN/W_cnn_2"]
        f["CNN/W_cnn_2"] = np.zeros((1, 3, 4, 15), np.float32)
    with pytest.raises(WeightFileError, match=r"'CNN/W_cnn_2' has shape \(1, 3, 4, 15\), expected \(1, 3, 4, 16\)"):
        BiLM.from_pretrained(str(model))


def test_options_that_contradict_the_weights(tmp_path, allennlp_dir):
    model = _copy_fixture(allennlp_dir, tmp_path / "m")
    options = json.loads((model / "options.json").read_text())
    options["lstm"]["dim"] = 128
    (model / "options.json").write_text(json.dumps(options))
    with pytest.raises(
        WeightFileError, match=r"LSTMCell/W_0' has shape \(32, 256\), expected \(32, 512\).*options do not match"
    ):
        BiLM.from_pretrained(str(model))


def test_bad_options_and_missing_files(tmp_path, allennlp_dir):
    (tmp_path / "options.json").write_text('{"lstm": {"dim": 8,')
    with pytest.raises(ConfigError, match="options.json:1: not valid JSON"):
        BiLM.from_pretrained(str(tmp_path))
    (tmp_path / "options.json").write_text('{"lstm": {"dim": 8}}')
    with pytest.raises(ConfigError, match="word-input biLMs are not supported"):
        BiLM.from_pretrained(str(tmp_path))
    shutil.copy(allennlp_dir / "options.json", tmp_path / "options.json")
    with pytest.raises(WeightFileError, match="weights.hdf5: weight file not found"):
        BiLM.from_pretrained(str(tmp_path))
    (tmp_path / "weights.hdf5").write_bytes(b"not hdf5 at all")
    with pytest.raises(WeightFileError, match="not a readable HDF5 file"):
        BiLM.from_pretrained(str(tmp_path))


def test_presets_match_the_published_parameter_counts():
    from elmo_core.config import medium, original, small

    def published_count(config: ModelConfig) -> int:
        """Weights as bilm-tf counts them: no frozen forget +1 (bias_hh), char_embed without our zero row."""
        bilm = BiLM(config)
        total = sum(p.numel() for n, p in bilm.named_parameters() if not n.endswith("bias_hh_l0"))
        return total - config.char_cnn.embedding.dim

    assert published_count(original()) == 93_600_848  # docs/elmo-format.md §1
    assert abs(published_count(small()) - 13.6e6) / 13.6e6 < 0.01
    assert abs(published_count(medium()) - 28.0e6) / 28.0e6 < 0.01
