"""The AllenNLP drop-in (elmo_core.allennlp) against reference numbers only: AllenNLP's golden stateful fixtures,
the identities its documentation states, a state dict laid out as AllenNLP's own loader lays out the weights,
the HDF5 layout its readers expect, and code written against ``allennlp.*`` imports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from elmo_core import BiLM
from elmo_core.allennlp import (
    Elmo,
    ElmoEmbedder,
    ScalarMix,
    _ElmoBiLm,
    batch_to_ids,
    remove_sentence_boundaries,
)
from elmo_core.allennlp.commands import LAZY_SENTENCES
from elmo_core.errors import ConfigError, InputError
from tests.helpers import needs_native_bf16, run_elmo

ROOT = Path(__file__).resolve().parent.parent
SENTENCES = [["I", "ate", "an", "apple", "."], ["苹果", "手机"], [], ["The", "quick", "brown", "fox", "jumps"]]


@pytest.fixture(scope="module")
def files(allennlp_dir) -> tuple[str, str]:
    return str(allennlp_dir / "options.json"), str(allennlp_dir / "lm_weights.hdf5")


def _golden(allennlp_dir: Path, k: int, i: int) -> np.ndarray:
    with h5py.File(allennlp_dir / f"lm_embeddings_{k}.hdf5") as f:
        return np.concatenate([f[str(i)][0], f[str(i)][1]], axis=-1)


def _top_layers(call, fixture_sentences) -> list[list[np.ndarray]]:
    """The fixtures' protocol: batch i is sentences[0][i], [1][i], [2][i]; each row's top layer, trimmed."""
    tops = []
    with torch.no_grad():
        for i in range(10):
            batch = [fixture_sentences[k][i].split() for k in range(3)]
            top = call(batch)
            tops.append([top[k][: len(batch[k])] for k in range(3)])
    return tops


def _worst(tops, allennlp_dir) -> float:
    return max(float(np.abs(tops[i][k] - _golden(allennlp_dir, k, i)).max()) for i in range(10) for k in range(3))


# ----- state --------------------------------------------------------------------------------------------------


def test_stateful_elmo_reproduces_allennlp_s_three_consecutive_calls(files, allennlp_dir, fixture_sentences):
    """``stateful=True`` is AllenNLP call for call: its golden files, made by carrying the state across batches."""
    elmo = Elmo(*files, 1, dropout=0.0, scalar_mix_parameters=[-1e4, -1e4, 1e4], stateful=True)  # the top layer
    tops = _top_layers(lambda b: elmo(batch_to_ids(b))["elmo_representations"][0].numpy(), fixture_sentences)
    assert _worst(tops, allennlp_dir) < 1e-5
    elmo.reset_states()
    again = elmo(batch_to_ids([fixture_sentences[k][0].split() for k in range(3)]))["elmo_representations"][0]
    assert np.abs(again[0, : len(fixture_sentences[0][0].split())].detach().numpy() - tops[0][0]).max() < 1e-6


def test_stateful_elmo_embedder_reproduces_the_golden_files_and_stateless_differs(
    files, allennlp_dir, fixture_sentences
):
    stateful = ElmoEmbedder(*files, stateful=True)
    assert (
        _worst(_top_layers(lambda b: [x[-1] for x in stateful.embed_batch(b)], fixture_sentences), allennlp_dir) < 1e-5
    )
    stateless = ElmoEmbedder(*files)
    assert (
        _worst(_top_layers(lambda b: [x[-1] for x in stateless.embed_batch(b)], fixture_sentences), allennlp_dir) > 0.1
    )


def test_stateless_is_allennlp_after_a_reset_and_independent_of_the_batch(files):
    """Default: every sentence from zero state, so its vectors equal AllenNLP's first call, alone or in a batch."""
    stateless, stateful = _ElmoBiLm(*files), _ElmoBiLm(*files, stateful=True)
    ids = batch_to_ids(SENTENCES)
    with torch.no_grad():
        for _ in range(2):
            ours = stateless(ids)["activations"]
        stateful.reset_states()
        reference = stateful(ids)["activations"]
        alone = stateless(batch_to_ids(SENTENCES[:1]))["activations"]
    for x, y, z in zip(ours, reference, alone):
        assert torch.allclose(x, y, atol=1e-6)
        assert torch.allclose(x[:1, : z.shape[1]], z, atol=1e-6)


def test_stateful_rows_beyond_a_smaller_batch_keep_their_state(files):
    bilm = _ElmoBiLm(*files, stateful=True)
    with torch.no_grad():
        bilm(batch_to_ids(SENTENCES))
        before = [s.clone() for s in bilm._elmo_lstm._states]
        bilm(batch_to_ids(SENTENCES[:2]))
        after = bilm._elmo_lstm._states
    for old, new in zip(before, after):
        assert torch.equal(old[:, :, 2:], new[:, :, 2:]) and not torch.equal(old[:, :, :2], new[:, :, :2])


# ----- outputs ------------------------------------------------------------------------------------------------


def test_elmo_outputs_mask_boundaries_and_shapes(files):
    elmo = Elmo(*files, 2, dropout=0.0)
    ids = batch_to_ids(SENTENCES)
    with torch.no_grad():
        out = elmo(ids)
        kept = Elmo(*files, 1, dropout=0.0, keep_sentence_boundaries=True)(ids)
        nested = elmo(ids.view(2, 2, *ids.shape[1:]))
        bilm_out = elmo._elmo_lstm(ids)
    assert isinstance(out["elmo_representations"], list) and len(out["elmo_representations"]) == 2
    assert out["mask"].dtype == torch.bool and out["mask"].tolist() == (ids > 0).any(-1).tolist()
    assert out["elmo_representations"][0].shape == (4, 5, elmo.get_output_dim())
    assert kept["elmo_representations"][0].shape == (4, 7, 32) and kept["mask"].sum(1).tolist() == [7, 4, 2, 7]
    assert nested["elmo_representations"][0].shape == (2, 2, 5, 32) and nested["mask"].shape == (2, 2, 5)
    # a mix with initial weights 0 and gamma 1 is the plain average of the layers, boundaries removed
    average = sum(bilm_out["activations"]) / 3
    trimmed, mask = remove_sentence_boundaries(average, bilm_out["mask"])
    assert torch.allclose(out["elmo_representations"][0], trimmed, atol=1e-6) and torch.equal(mask, out["mask"])
    assert float(out["elmo_representations"][0][2].abs().max()) == 0.0  # the empty sentence


def test_layer_norm_uses_one_mean_and_variance_over_the_unmasked_batch(files):
    """AllenNLP's ``_masked_layer_norm``: per layer, one mean and (biased) variance of every unmasked value in the
    batch; here they come from torch's own ``mean`` / ``var`` of those values, and the mixed layers are compared
    with ``torch.nn.functional.layer_norm`` of the same values at every unmasked position."""
    elmo = Elmo(*files, 1, dropout=0.0, do_layer_norm=True)
    ids = batch_to_ids(SENTENCES)
    with torch.no_grad():
        got = elmo(ids)["elmo_representations"][0]
        bilm_out = elmo._elmo_lstm(ids)
    keep = bilm_out["mask"].bool()
    normed, flat = [], []
    for layer in bilm_out["activations"]:
        values = layer[keep]  # (unmasked tokens, dim)
        normed.append((layer - values.mean()) / torch.sqrt(values.var(unbiased=False) + 1e-12))
        flat.append(torch.nn.functional.layer_norm(values.reshape(-1), (values.numel(),), eps=1e-12))
    want, _ = remove_sentence_boundaries(sum(normed) / 3, bilm_out["mask"])
    assert torch.allclose(got, want, atol=1e-5)  # padding positions included, as AllenNLP computes them
    mixed = (sum(flat) / 3).view(-1, got.shape[-1])  # unmasked rows, boundaries included, in order
    inner = torch.zeros_like(keep)
    inner[:, 1:-1] = keep[:, 2:]  # the rows that survive the boundaries' removal (each row's last is </S>)
    kept, _ = remove_sentence_boundaries(inner.unsqueeze(-1).float(), bilm_out["mask"])
    rows_kept = keep.clone()
    rows_kept[torch.arange(len(keep)), keep.sum(1) - 1] = False  # </S>
    rows_kept[:, 0] = False  # <S>
    assert torch.allclose(got[kept.squeeze(-1).bool()], mixed[rows_kept[keep]], atol=1e-5)


def test_dropout_runs_after_the_boundaries_are_removed_and_only_in_training(files):
    elmo = Elmo(*files, 1, dropout=0.5)
    ids = batch_to_ids(SENTENCES)
    with torch.no_grad():
        evaluated = elmo.eval()(ids)["elmo_representations"][0]
        trained = elmo.train()(ids)["elmo_representations"][0]
    kept = trained != 0
    assert 0.3 < float(kept[evaluated != 0].float().mean()) < 0.7
    assert torch.allclose(trained[kept], 2 * evaluated[kept], atol=1e-6)


def test_fixed_scalar_mix_parameters_are_not_trained(files):
    fixed = Elmo(*files, 1, scalar_mix_parameters=[0.0, 0.0, 1.0])
    learned = Elmo(*files, 1)
    assert not any(p.requires_grad for p in fixed.scalar_mix_0.parameters())
    assert all(p.requires_grad for p in learned.scalar_mix_0.parameters())
    initial = [float(p.detach()) for p in learned.scalar_mix_0.scalar_parameters]
    assert float(learned.scalar_mix_0.gamma.detach()) == 1.0 and initial == [0.0] * 3


def test_vocab_to_cache_word_inputs_give_the_char_cnn_s_numbers(files):
    vocab = ["@@PADDING@@", *sorted({t for s in SENTENCES for t in s})]
    elmo = Elmo(*files, 1, dropout=0.0, vocab_to_cache=vocab)
    index = {w: i for i, w in enumerate(vocab)}
    words = torch.zeros(len(SENTENCES), 5, dtype=torch.long)
    for b, sentence in enumerate(SENTENCES):
        words[b, : len(sentence)] = torch.tensor([index[t] for t in sentence], dtype=torch.long)
    ids = batch_to_ids(SENTENCES)
    with torch.no_grad():
        cached = elmo(ids, words)
        chars = elmo(ids)
        fallback = elmo(ids, words + 1000)  # ids past the cache: AllenNLP falls back to the char CNN
    assert torch.equal(cached["mask"], chars["mask"])
    assert torch.allclose(cached["elmo_representations"][0], chars["elmo_representations"][0], atol=1e-6)
    assert torch.allclose(fallback["elmo_representations"][0], chars["elmo_representations"][0], atol=1e-6)
    assert "_elmo_lstm._word_embedding.weight" in elmo.state_dict()


def test_module_replaces_the_bilm_and_files_with_it_are_refused(files):
    bilm = _ElmoBiLm(*files)
    assert Elmo(None, None, 1, module=bilm)._elmo_lstm is bilm
    with pytest.raises(ConfigError, match="not both"):
        Elmo(*files, 1, module=bilm)


@needs_native_bf16
def test_bf16_without_gradients_is_close_to_fp32(files):
    ids = batch_to_ids(SENTENCES)
    with torch.no_grad():
        exact = Elmo(*files, 1, dropout=0.0)(ids)["elmo_representations"][0]
        fast = Elmo(*files, 1, dropout=0.0, precision="bf16")(ids)["elmo_representations"][0]
    real = exact.abs().sum(-1) > 0
    cosine = torch.nn.functional.cosine_similarity(exact[real], fast[real].float(), dim=-1)
    assert float(cosine.min()) > 0.999


# ----- saved models -------------------------------------------------------------------------------------------


def _allennlp_state_dict(options_file: str, weight_file: str) -> dict[str, torch.Tensor]:
    """The biLM's weights as AllenNLP's own loaders lay them out from weights.hdf5 (written here from the format's
    description, independently of weights.py): the state dict of a model that holds AllenNLP's ``Elmo``."""
    options = json.loads(Path(options_file).read_text())
    cell, n_filters = options["lstm"]["dim"], sum(n for _, n in options["char_cnn"]["filters"])
    out: dict[str, torch.Tensor] = {}
    with h5py.File(weight_file) as f:
        char = f["char_embed"][...]
        out["_token_embedder._char_embedding_weights"] = np.concatenate([np.zeros((1, char.shape[1])), char])
        for i in range(len(options["char_cnn"]["filters"])):
            out[f"_token_embedder.char_conv_{i}.weight"] = np.transpose(f["CNN"][f"W_cnn_{i}"][...][0], (2, 1, 0))
            out[f"_token_embedder.char_conv_{i}.bias"] = f["CNN"][f"b_cnn_{i}"][...]
        for k in range(options["char_cnn"]["n_highway"]):
            high = f[f"CNN_high_{k}"]
            weight = [high["W_transform"][...].T, -high["W_carry"][...].T]
            out[f"_token_embedder._highways._layers.{k}.weight"] = np.concatenate(weight)
            out[f"_token_embedder._highways._layers.{k}.bias"] = np.concatenate(
                [high["b_transform"], -high["b_carry"][...]]
            )
        out["_token_embedder._projection.weight"] = f["CNN_proj"]["W_proj"][...].T
        out["_token_embedder._projection.bias"] = f["CNN_proj"]["b_proj"][...]
        for layer in range(options["lstm"]["n_layers"]):
            for direction, name in enumerate(("forward", "backward")):
                tf = f[f"RNN_{direction}"]["RNN"]["MultiRNNCell"][f"Cell{layer}"]["LSTMCell"]
                w = tf["W_0"][...].T  # (4C, in + P), gates i, j, f, o
                order = np.r_[0:cell, 2 * cell : 3 * cell, cell : 2 * cell, 3 * cell : 4 * cell]  # → i, f, j, o
                bias = tf["B"][...].copy()
                bias[2 * cell : 3 * cell] += 1.0  # TensorFlow's forget bias, inside AllenNLP's parameter
                inputs = options["lstm"]["projection_dim"]
                prefix = f"_elmo_lstm.{name}_layer_{layer}."
                out[prefix + "input_linearity.weight"] = w[order, :inputs]
                out[prefix + "state_linearity.weight"] = w[order, inputs:]
                out[prefix + "state_linearity.bias"] = bias[order]
                out[prefix + "state_projection.weight"] = tf["W_P_0"][...].T
    assert out["_token_embedder._highways._layers.0.weight"].shape == (2 * n_filters, n_filters)
    return {f"_elmo_lstm.{k}": torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32)) for k, v in out.items()}


def test_a_state_dict_with_allennlp_s_keys_loads_strictly_and_gives_the_golden_numbers(
    files, allennlp_dir, fixture_sentences
):
    theirs = _allennlp_state_dict(*files)
    theirs |= {"scalar_mix_0.gamma": torch.tensor([1.0])}
    theirs |= {f"scalar_mix_0.scalar_parameters.{i}": torch.tensor([v]) for i, v in enumerate([-1e4, -1e4, 1e4])}
    elmo = Elmo(*files, 1, dropout=0.0, stateful=True)
    with torch.no_grad():
        for p in elmo.parameters():
            p.normal_()  # nothing of the files' numbers left: only the state dict can bring them back
    elmo.load_state_dict(theirs, strict=True)
    tops = _top_layers(lambda b: elmo(batch_to_ids(b))["elmo_representations"][0].numpy(), fixture_sentences)
    assert _worst(tops, allennlp_dir) < 1e-5
    saved = elmo.state_dict()  # what AllenNLP's Elmo loads: the same keys, the same tensors
    assert sorted(saved) == sorted(theirs)
    assert all(torch.allclose(saved[k], theirs[k], atol=1e-6) for k in theirs)


class Tagger(torch.nn.Module):
    """A downstream model over Elmo, as AllenNLP's taggers hold it."""

    def __init__(self, files: tuple[str, str], requires_grad: bool) -> None:
        super().__init__()
        self.elmo = Elmo(*files, 1, requires_grad=requires_grad, dropout=0.0)
        self.out = torch.nn.Linear(self.elmo.get_output_dim(), 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.elmo(ids)["elmo_representations"][0])


@pytest.mark.parametrize("requires_grad", [False, True])
def test_a_tagger_over_elmo_trains_and_the_bilm_learns_only_when_asked(files, requires_grad):
    torch.manual_seed(0)
    tagger = Tagger(files, requires_grad)
    ids, mask = batch_to_ids(SENTENCES), (batch_to_ids(SENTENCES) > 0).any(-1)
    tags = torch.randint(0, 3, mask.shape)
    optimizer = torch.optim.Adam([p for p in tagger.parameters() if p.requires_grad], lr=0.05)
    losses = []
    for _ in range(8):
        loss = torch.nn.functional.cross_entropy(tagger(ids)[mask], tags[mask])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0]
    bilm = [(n, p) for n, p in tagger.named_parameters() if "_bilm" in n]
    assert bilm and all(p.requires_grad == requires_grad for _, p in bilm)  # every one of them, as in AllenNLP
    assert [n for n, p in bilm if (p.grad is not None) != requires_grad] == []  # each learns only when asked
    assert tagger.elmo.scalar_mix_0.gamma.grad is not None
    restored = Tagger(files, requires_grad)
    restored.load_state_dict(tagger.state_dict(), strict=True)
    with torch.no_grad():
        assert torch.allclose(restored(ids), tagger(ids), atol=1e-5)


# ----- ElmoEmbedder -------------------------------------------------------------------------------------------


def test_embedder_batches_sentences_and_files_as_allennlp_0_9(files, tmp_path):
    embedder = ElmoEmbedder(*files)
    vectors = embedder.embed_batch(SENTENCES)
    assert [v.shape for v in vectors] == [(3, 5, 32), (3, 2, 32), (3, 0, 32), (3, 5, 32)]
    assert all(v.dtype == np.float32 for v in vectors)
    activations, mask = embedder.batch_to_embeddings(SENTENCES)
    assert activations.shape == (4, 3, 5, 32) and mask.dtype == torch.long and mask.sum(1).tolist() == [5, 2, 0, 5]
    assert np.allclose(activations[0, :, :5].numpy(), vectors[0], atol=1e-6)
    assert np.allclose(embedder.embed_sentence(SENTENCES[0]), vectors[0], atol=1e-6)
    pulled: list[list[str]] = []

    def sentences(n: int):
        for i in range(n):
            pulled.append(SENTENCES[i % 4])
            yield SENTENCES[i % 4]

    lazy = embedder.embed_sentences(sentences(12), batch_size=2)
    assert pulled == []  # a generator, as AllenNLP's: nothing read before the first vector is asked for
    assert all(np.allclose(x, vectors[i % 4], atol=1e-6) for i, x in enumerate(lazy))
    pulled.clear()
    bounded = embedder.embed_sentences(sentences(LAZY_SENTENCES + 5))
    next(bounded)
    assert len(pulled) == LAZY_SENTENCES  # read ahead to sort by length, but bounded
    pulled.clear()
    in_order = ElmoEmbedder(*files, stateful=True).embed_sentences(sentences(200))
    assert np.allclose(next(in_order), vectors[0], atol=1e-6)
    assert len(pulled) == 64  # stateful: AllenNLP's batches of its default size, in the given order
    assert embedder.cuda_device == -1


@pytest.mark.parametrize("output_format", ["all", "top", "average"])
def test_embed_file_writes_allennlp_s_hdf5_layout(files, tmp_path, output_format):
    lines = [" ".join(s) for s in SENTENCES if s]
    source = tmp_path / "in.txt"
    source.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.hdf5"
    ElmoEmbedder(*files).embed_file(source.open(), str(out), output_format)
    reference = ElmoEmbedder(*files).embed_batch([line.split() for line in lines])
    with h5py.File(out) as f:
        assert sorted(f) == sorted([*map(str, range(len(lines))), "sentence_to_index"])
        index = json.loads(f["sentence_to_index"][0])
        assert index == {line: str(i) for i, line in enumerate(lines)}
        for i, want in enumerate(reference):
            want = {"all": want, "top": want[-1], "average": want.mean(0)}[output_format]
            assert f[str(i)].dtype == np.float32 and f[str(i)].shape == want.shape
            assert np.allclose(f[str(i)][...], want, atol=1e-6)


def test_embed_file_sentence_keys_forgetting_and_bad_lines(files, tmp_path):
    embedder = ElmoEmbedder(*files)
    (tmp_path / "in.txt").write_text("a b\nc\n")
    embedder.embed_file((tmp_path / "in.txt").open(), str(tmp_path / "keys.hdf5"), "top", use_sentence_keys=True)
    with h5py.File(tmp_path / "keys.hdf5") as f:
        assert sorted(f) == ["a b", "c"] and f["a b"].shape == (2, 32)
    embedder.embed_file((tmp_path / "in.txt").open(), str(tmp_path / "forget.hdf5"), forget_sentences=True)
    with h5py.File(tmp_path / "forget.hdf5") as f:
        assert sorted(f) == ["0", "1"]
    (tmp_path / "blank.txt").write_text("a b\n\nc\n")
    with pytest.raises(InputError, match=r"blank.txt:2: a blank line"):
        embedder.embed_file((tmp_path / "blank.txt").open(), str(tmp_path / "x.hdf5"))
    (tmp_path / "twice.txt").write_text("a b\nc\na b\n")
    with pytest.raises(InputError, match=r"twice.txt:3: a duplicate sentence"):
        embedder.embed_file((tmp_path / "twice.txt").open(), str(tmp_path / "y.hdf5"), use_sentence_keys=True)


def test_the_default_urls_name_the_two_files_to_fetch():
    with pytest.raises(ConfigError, match=r"nothing is downloaded here; fetch https://.*options.json and https://"):
        ElmoEmbedder()


def test_the_allennlp_elmo_command_writes_the_same_file(files, tmp_path):
    (tmp_path / "in.txt").write_text("I ate an apple .\nHi\n")
    result = run_elmo(
        "allennlp-elmo",
        str(tmp_path / "in.txt"),
        str(tmp_path / "out.hdf5"),
        "--average",
        "--options-file",
        files[0],
        "--weight-file",
        files[1],
    )
    assert result.returncode == 0, result.stderr
    assert "2 sentences" in result.stdout
    want = ElmoEmbedder(*files).embed_batch([["I", "ate", "an", "apple", "."], ["Hi"]])
    with h5py.File(tmp_path / "out.hdf5") as f:
        assert np.allclose(f["0"][...], want[0].mean(0), atol=1e-6) and f["1"].shape == (1, 32)


# ----- install() ----------------------------------------------------------------------------------------------

SNIPPET = """
import elmo_core.allennlp
assert elmo_core.allennlp.install()
import torch
from allennlp.modules import Elmo, ScalarMix
from allennlp.modules.elmo import _ElmoBiLm, batch_to_ids
from allennlp.modules.scalar_mix import ScalarMix as Mix
from allennlp.nn.util import remove_sentence_boundaries
import allennlp.commands.elmo
from allennlp.commands.elmo import DEFAULT_OPTIONS_FILE, ElmoEmbedder

elmo = Elmo(__OPTIONS__, __WEIGHTS__, 2, dropout=0)
out = elmo(batch_to_ids([["I", "ate", "an", "apple"], ["Hi"]]))
assert [r.shape for r in out["elmo_representations"]] == [torch.Size([2, 4, 32])] * 2 and Mix is ScalarMix
embedder = allennlp.commands.elmo.ElmoEmbedder(__OPTIONS__, __WEIGHTS__, -1)
assert embedder.embed_sentence(["Hi"]).shape == (3, 1, 32) and DEFAULT_OPTIONS_FILE.startswith("https://")
from allennlp.common.checks import ConfigurationError
try:  # downstream code catches AllenNLP's ConfigurationError around a wrongly sized mix
    ScalarMix(3, initial_scalar_parameters=[0.0])
except ConfigurationError as e:
    assert isinstance(e, ValueError) and "initial_scalar_parameters" in str(e) and "--" not in str(e)
else:
    raise AssertionError("no ConfigurationError")
print("ran", type(elmo).__module__)
"""


def test_code_written_against_allennlp_runs_after_install(files):
    code = SNIPPET.replace("__OPTIONS__", repr(files[0])).replace("__WEIGHTS__", repr(files[1]))
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "ran elmo_core.allennlp.modules" in result.stdout


def test_scalar_mix_and_batch_to_ids_have_allennlp_s_signatures():
    mix = ScalarMix(3, do_layer_norm=False, initial_scalar_parameters=[0.0, 1.0, 2.0], trainable=False)
    tensors = [torch.full((1, 2, 4), float(v)) for v in range(3)]
    weights = torch.softmax(torch.tensor([0.0, 1.0, 2.0]), 0)
    assert torch.allclose(mix(tensors), sum(w * t for w, t in zip(weights, tensors)))
    ids = batch_to_ids([["<S>", "a"]])
    assert ids.shape == (1, 2, 50) and ids[0, 0, :3].tolist() == [259, 257, 260]


def test_the_bilm_s_weights_match_ours_key_for_key(files):
    """Our BiLM and the drop-in hold the same numbers: the keys translate and back without loss."""
    bilm = BiLM.from_pretrained(*files)
    theirs = _ElmoBiLm(*files).state_dict()
    back = _ElmoBiLm(*files)
    back.load_state_dict(theirs, strict=True)
    ours = {k: v for k, v in bilm.state_dict().items() if not k.startswith("softmax")}
    for key, value in back._bilm.state_dict().items():
        assert torch.allclose(value, ours[key], atol=1e-7), key


def test_install_changes_nothing_where_allennlp_is_importable_and_says_so_once(tmp_path):
    """A package named allennlp on the path (as an installed AllenNLP would be): it stays the one imported."""
    (tmp_path / "allennlp").mkdir()
    (tmp_path / "allennlp" / "__init__.py").write_text("REAL = True\n")
    code = (
        "import logging, sys; logging.basicConfig(level=logging.WARNING); sys.path.insert(0, sys.argv[1])\n"
        "import elmo_core.allennlp as drop_in\n"
        "assert drop_in.install() is False and drop_in.install() is False\n"
        "import allennlp; assert allennlp.REAL and 'allennlp.modules' not in sys.modules; print('kept')"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "kept" in result.stdout and result.stderr.count("AllenNLP is installed") == 1


def test_without_gradients_the_fast_kernels_run_and_with_them_the_reference(files, monkeypatch):
    from elmo_core.bilm.kernels import fused_gates, step_loop

    if not fused_gates.available():
        pytest.skip(fused_gates.describe())
    calls: list[int] = []
    kernel, loop = fused_gates.lstm_gates, step_loop.lstm_steps
    monkeypatch.setattr(fused_gates, "lstm_gates", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    monkeypatch.setattr(step_loop, "lstm_steps", lambda *a, **k: calls.append(1) or loop(*a, **k))
    elmo = Elmo(*files, 1, dropout=0.0, requires_grad=True)
    ids = batch_to_ids(SENTENCES)
    with torch.no_grad():
        fast = elmo(ids)["elmo_representations"][0]
    assert calls  # the C kernels ran (the step loop, or the gates where it is off)
    calls.clear()
    exact = elmo(ids)["elmo_representations"][0]
    assert not calls and exact.requires_grad  # the differentiable reference
    assert torch.allclose(fast, exact.detach(), atol=1e-5)


def test_an_all_padding_row_runs_its_boundaries_and_updates_its_state_as_allennlp_does(files):
    """AllenNLP 2.10.1, run on this very case: the padding row's mask is [True, True, False] (``<S> </S>``) and its
    carried state changes. The drop-in does the same."""
    bilm = _ElmoBiLm(*files, stateful=True)
    with torch.no_grad():
        bilm(batch_to_ids([["a", "b"], ["c", "d", "e"]]))
        before = [s.clone() for s in bilm._elmo_lstm._states]
        ids = batch_to_ids([["x"], ["y"]])
        ids[1] = 0
        out = bilm(ids)
    assert out["mask"][1].tolist() == [True, True, False]
    assert all(not torch.equal(b[:, :, 1], a[:, :, 1]) for b, a in zip(before, bilm._elmo_lstm._states))
