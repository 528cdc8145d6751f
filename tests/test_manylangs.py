"""ELMoForManyLangs' released models (``docs/elmo-format.md`` §9): a released folder runs in every command with their
numbers, converts to a model folder that keeps its dictionaries, fine-tunes, and a bad one fails in one line.

The folders are built here from the format description (§9.1: the files, keys and shapes; never their code), with
random weights, Chinese, accented and unknown characters, a whitespace symbol in ``char.dic`` and tokens over the
character limit. Two references: ``reference_layers``, their network written out from §9.2 step by step, and (slow,
where ``elmoformanylangs`` installs) their own ``Embedder.sents2elmo`` on a fresh embedder.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from elmo_core.errors import ElmoError
from tests.helpers import ROOT, cpu_precisions, run_elmo

SMALL = {  # a network config of their schema, small enough for a test
    "encoder": {"name": "elmo", "projection_dim": 16, "cell_clip": 3, "proj_clip": 3, "dim": 32, "n_layers": 2},
    "token_embedder": {
        **{"name": "cnn", "activation": "relu", "filters": [[1, 4], [2, 8], [3, 16], [4, 32]], "n_highway": 2},
        **{"word_dim": 6, "char_dim": 8, "max_characters_per_token": 50},
    },
    "classifier": {"name": "sampled_softmax", "n_samples": 8192},
    "dropout": 0.1,
}
WORDS = ["我们", "喜欢", "吃", "苹果", "。", "café", "naïve", "Zürich", "the", "apple", "a\u3000b", "x" * 60, "长" * 55]
SENTENCES = [
    ["我们", "喜欢", "吃", "苹果", "。"],
    ["café", "naïve", "Zürich", "Ωmega≈", "the"],  # a word and characters never seen
    ["the", "apple", "x" * 60, "长" * 55, "y" * 70],  # tokens over the 48-character limit, known and not
    ["a\u3000b", "<bos>", "苹果们"],  # the whitespace symbol of char.dic; their boundary word inside a sentence
    ["。"],
]
CHAR_SPECIALS = ["<bos>", "<eos>", "<oov>", "<pad>", "<bow>", "<eow>"]
TRAINING_ARGS = {
    **{"seed": 1, "gpu": 3, "train_path": "/corpora/raw", "valid_path": None, "test_path": None},
    **{"word_embedding": None, "optimizer": "adam", "lr": 0.001, "lr_decay": 0.8, "model": "/models/x.model"},
    **{"batch_size": 32, "max_epoch": 10, "clip_grad": 5, "max_sent_len": 20, "min_count": 3},
    **{"max_vocab_size": 150000, "save_classify_layer": False, "valid_size": 0, "eval_steps": 10000},
}


def write_release(
    folder: Path, network: dict, words: list[str], seed: int = 0, legacy: bool = False, beside: bool = True
) -> Path:
    """A released folder (§9.1) with random weights: config.json naming the network config by a path on another
    machine, the network config in the folder (``beside``; else the published defaults must serve), char.dic and
    word.dic in their trainer's order, and the two state dicts (``legacy``: PyTorch's old serialization, as 2018's)."""
    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    emb, enc = network["token_embedder"], network["encoder"]
    chars: dict[str, int] = {}
    for c in (c for w in words for c in w[: emb["max_characters_per_token"] - 2]):
        chars.setdefault(c, len(chars))
    for special in CHAR_SPECIALS:
        chars[special] = len(chars)
    vocab = {w: i for i, w in enumerate(["<oov>", "<bos>", "<eos>", "<pad>"])}
    for w in words:
        vocab.setdefault(w[: emb["max_characters_per_token"] - 2], len(vocab))
    (folder / "char.dic").write_text("".join(f"{c}\t{i}\n" for c, i in chars.items()), encoding="utf-8")
    (folder / "word.dic").write_text("".join(f"{w}\t{i}\n" for w, i in vocab.items()), encoding="utf-8")
    name = "cnn_50_100_512_4096_sample.json" if not beside else "net_small.json"
    args = {**TRAINING_ARGS, "config_path": f"/home/publisher/work/{name}"}
    (folder / "config.json").write_text(json.dumps(args), encoding="utf-8")
    if beside:
        (folder / name).write_text(json.dumps(network), encoding="utf-8")

    def rand(*shape: int, scale: float) -> torch.Tensor:
        return (torch.rand(*shape, generator=gen) * 2 - 1) * scale

    f, p, h = sum(n for _, n in emb["filters"]), enc["projection_dim"], enc["dim"]
    te = {"word_emb_layer.embedding.weight": rand(len(vocab), emb["word_dim"], scale=0.5)} if emb["word_dim"] else {}
    te["char_emb_layer.embedding.weight"] = rand(len(chars), emb["char_dim"], scale=0.5)
    for i, (width, count) in enumerate(emb["filters"]):
        te[f"convolutions.{i}.weight"] = rand(count, emb["char_dim"], width, scale=0.5)
        te[f"convolutions.{i}.bias"] = rand(count, scale=0.1)
    for k in range(emb["n_highway"]):
        te[f"highways._layers.{k}.weight"] = rand(2 * f, f, scale=1.0 / f**0.5)
        te[f"highways._layers.{k}.bias"] = rand(2 * f, scale=0.5)
    te["projection.weight"] = rand(p, emb["word_dim"] + f, scale=1.0 / (emb["word_dim"] + f) ** 0.5)
    te["projection.bias"] = rand(p, scale=0.1)
    lstms = {}
    for layer in range(enc["n_layers"]):
        for side in ("forward", "backward"):
            lstms[f"{side}_layer_{layer}.input_linearity.weight"] = rand(4 * h, p, scale=1.0 / p**0.5)
            lstms[f"{side}_layer_{layer}.state_linearity.weight"] = rand(4 * h, p, scale=1.0 / p**0.5)
            lstms[f"{side}_layer_{layer}.state_linearity.bias"] = rand(4 * h, scale=0.5)
            lstms[f"{side}_layer_{layer}.state_projection.weight"] = rand(p, h, scale=1.0 / h**0.5)
    options = {"_use_new_zipfile_serialization": False} if legacy else {}
    torch.save(te, folder / "token_embedder.pkl", **options)
    torch.save(lstms, folder / "encoder.pkl", **options)
    return folder


# ----- their network, written out from the format description (§9.2) ----------------------------------------


def _their_dic(path: Path) -> dict[str, int]:
    found = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        fields = line.strip().split("\t")
        if len(fields) == 1:
            fields.insert(0, "\u3000")
        found[fields[0]] = int(fields[1])
    return found


def _lstm(weights: dict, prefix: str, xs: torch.Tensor, clip: float) -> torch.Tensor:
    w_in, w_state = weights[f"{prefix}.input_linearity.weight"], weights[f"{prefix}.state_linearity.weight"]
    bias, w_proj = weights[f"{prefix}.state_linearity.bias"], weights[f"{prefix}.state_projection.weight"]
    h, c, out = torch.zeros(w_proj.shape[0]), torch.zeros(w_proj.shape[1]), []
    for x in xs:
        i, f, g, o = (w_in @ x + w_state @ h + bias).chunk(4)
        c = (torch.sigmoid(i) * torch.tanh(g) + torch.sigmoid(f) * c).clamp(-clip, clip)
        h = (w_proj @ (torch.sigmoid(o) * torch.tanh(c))).clamp(-clip, clip)
        out.append(h)
    return torch.stack(out)


def reference_layers(folder: Path, sentence: list[str], network: dict = SMALL) -> np.ndarray:
    """(3, n, 2P): one sentence through their network, token by token, from the description alone."""
    te = torch.load(folder / "token_embedder.pkl", weights_only=True)
    enc = torch.load(folder / "encoder.pkl", weights_only=True)
    chars, words = _their_dic(folder / "char.dic"), _their_dic(folder / "word.dic")
    emb, cfg = network["token_embedder"], network["encoder"]
    limit = emb["max_characters_per_token"]
    tokens = ["<bos>", *(t[: limit - 2] for t in sentence), "<eos>"]
    rows = torch.full((len(tokens), limit), chars["<pad>"])
    for r, token in enumerate(tokens):
        spelled = [chars[token]] if token in ("<bos>", "<eos>") else [chars.get(c, chars["<oov>"]) for c in token]
        rows[r, : len(spelled) + 2] = torch.tensor([chars["<eow>"], *spelled, chars["<bow>"]])
    x = te["char_emb_layer.embedding.weight"][rows].transpose(1, 2)
    convolved = []
    for i in range(len(emb["filters"])):
        y = torch.nn.functional.conv1d(x, te[f"convolutions.{i}.weight"], te[f"convolutions.{i}.bias"])
        convolved.append(torch.relu(y.max(dim=-1).values))
    hw = torch.cat(convolved, dim=-1)
    n_filters = hw.shape[1]
    for k in range(emb["n_highway"]):
        a, g = (hw @ te[f"highways._layers.{k}.weight"].T + te[f"highways._layers.{k}.bias"]).split(n_filters, dim=1)
        hw = torch.sigmoid(g) * hw + (1 - torch.sigmoid(g)) * torch.relu(a)
    word_ids = torch.tensor([words.get(t, words["<oov>"]) for t in tokens])
    joined = torch.cat([te["word_emb_layer.embedding.weight"][word_ids], hw], dim=-1)
    e = joined @ te["projection.weight"].T + te["projection.bias"]
    layers, fwd, bwd = [torch.cat([e, e], -1)], e, e
    for layer in range(cfg["n_layers"]):
        out_f = _lstm(enc, f"forward_layer_{layer}", fwd, cfg["cell_clip"])
        out_b = _lstm(enc, f"backward_layer_{layer}", bwd.flip(0), cfg["cell_clip"]).flip(0)
        if layer:
            out_f, out_b = out_f + fwd, out_b + bwd
        layers.append(torch.cat([out_f, out_b], -1))
        fwd, bwd = out_f, out_b
    return torch.stack(layers)[:, 1:-1].numpy()


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> Path:
    return write_release(tmp_path_factory.mktemp("manylangs") / "zhs.model", SMALL, WORDS)


@pytest.fixture(scope="module")
def expected(release) -> list[np.ndarray]:
    with torch.no_grad():
        return [reference_layers(release, s) for s in SENTENCES]


@pytest.fixture(autouse=True)
def _model_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("ELMO_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "model-cache"))


# ----- characters and dictionaries ------------------------------------------------------------------------


def test_a_token_is_read_as_their_batcher_frames_and_cuts_it(release):
    """The row of ids a token becomes (§9.2): the swapped markers, code points not bytes, <oov>, the cut at
    max_chars − 2 for the characters and the word alike, and the whitespace symbol their loader reads as U+3000."""
    from elmo_core.text.chars import tokens_to_char_array
    from elmo_core.text.manylangs_chars import Dictionaries

    dics = Dictionaries.read(release, 50)
    c, w = _their_dic(release / "char.dic"), _their_dic(release / "word.dic")
    assert c["\u3000"] == dics.chars["\u3000"]  # its line is "\u3000<TAB>id": strip() leaves the id alone
    row = dics.row("Zürich")
    assert row[0] - 1 == c["<eow>"] and row[7] - 1 == c["<bow>"] and row[8] - 1 == c["<pad>"]
    assert [i - 1 for i in row[1:7]] == [c[ch] for ch in "Zürich"] and row[-1] - 1 == w["Zürich"]
    assert [i - 1 for i in dics.row("Ω")[1:3]] == [c["<oov>"], c["<bow>"]] and dics.row("Ω")[-1] - 1 == w["<oov>"]
    long = dics.row("长" * 55)
    assert len(long) == 51 and long[49] - 1 == c["<bow>"] and long[-1] - 1 == w["长" * 48]
    assert [i - 1 for i in dics.row("<bos>")[:4]] == [c["<eow>"], c["<bos>"], c["<bow>"], c["<pad>"]]
    read_back = dics.from_bytes(tokens_to_char_array(["Zürich", "<S>", "</S>"]))  # bilm-tf's ids, read back
    assert read_back[0].tolist() == list(row) and read_back[1].tolist() == list(dics.row("<bos>"))


def test_layers_equal_their_network_written_out_from_the_description(release, expected):
    """Every layer of every sentence, through ``BiLM.from_pretrained`` on the released folder: equal to §9.2 step
    by step within 1e-5 in fp32; an empty sentence has no rows."""
    from elmo_core.bilm.model import BiLM

    bilm = BiLM.from_pretrained(str(release))
    got = bilm.embed_sentences([*SENTENCES, []])
    for ours, theirs in zip(got, expected):
        np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=0)
    assert got[-1].shape == (3, 0, 32)


@pytest.mark.slow
@pytest.mark.parametrize("legacy", [True, False], ids=["2018-serialization", "zip-serialization"])
def test_layers_equal_their_own_embedder(tmp_path, legacy):
    """Against their package (``elmoformanylangs``, a fresh ``Embedder``'s first call, one batch): every layer
    (``output_layer=-2``) and their average (``-1``, the plain mean) within 1e-5; the network config found beside."""
    embedder_module = pytest.importorskip("elmoformanylangs")
    from elmo_core.runtime import Output, Runtime

    folder = write_release(tmp_path / "de.model", SMALL, WORDS, seed=3, legacy=legacy)
    layers = embedder_module.Embedder(str(folder)).sents2elmo(SENTENCES, output_layer=-2)
    average = embedder_module.Embedder(str(folder)).sents2elmo(SENTENCES, output_layer=-1)
    runtime = Runtime.open(str(folder))
    for ours, theirs in zip(runtime.embed(SENTENCES), layers, strict=True):
        np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=0)
    for ours, theirs in zip(runtime.embed(SENTENCES, Output.of("mix")), average, strict=True):
        np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=0)


# ----- every command ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_every_command_gives_their_numbers(tmp_path, release, expected):
    """``elmo embed`` (every layer, and the default mix: their ``output_layer=-1``, the plain mean), a server's model
    process, the probes, the AllenNLP drop-in (``ElmoEmbedder(folder, folder)``, ``Elmo(folder, None)`` on
    ``batch_to_ids``) and ``elmo info``: the released folder as it is, their numbers within 1e-5."""
    from elmo_core.allennlp import Elmo, ElmoEmbedder, batch_to_ids
    from elmo_core.options import WsdConfig
    from elmo_core.serve.api import Batch, Output
    from elmo_core.serve.compute import BatchEmbedder
    from elmo_core.vectors.probe import embed_all, load_model

    text = tmp_path / "text.txt"
    text.write_text("\n".join(" ".join(s) for s in SENTENCES[:3]) + "\n", encoding="utf-8")
    env = {**os.environ, "ELMO_CACHE_DIR": os.environ["ELMO_CACHE_DIR"]}
    for layers in ("all", "mix"):
        out = tmp_path / f"table-{layers}"
        done = run_elmo(
            "embed", "--model", str(release), "--input", str(text), "--out", str(out), "--layers", layers, env=env
        )
        assert done.returncode == 0, done.stderr[-2000:]
        table = pq.read_table(out).to_pandas()
        for i, sentence in enumerate(SENTENCES[:3]):
            rows = table[table.text == " ".join(sentence)].sort_values("token_index")
            assert rows.token.tolist() == sentence
            columns = ["layer_0", "layer_1", "layer_2"] if layers == "all" else ["elmo"]
            got = np.stack([np.stack(rows[c].to_numpy()) for c in columns])
            want = expected[i] if layers == "all" else expected[i].mean(0, keepdims=True)
            np.testing.assert_allclose(got, want, atol=1e-5, rtol=0, err_msg=f"embed --layers {layers}")

    from elmo_core.runtime import resolve_model

    served_by = BatchEmbedder(resolve_model(str(release)).pinned(), "cpu", "fp32", "asked for fp32", 4096)
    batch = Batch(1, SENTENCES, [0] * 5, [Output("layers", encoding="base64")])
    served = served_by.run(batch).answer(batch)  # computed, then encoded as the model process's answer thread does
    for i, want in enumerate(expected):
        got = np.frombuffer(base64.b64decode(served.embeddings[i][1:-1]), dtype="<f4").reshape(served.shapes[i])
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0, err_msg="serve")

    probed: dict[int, np.ndarray] = {}
    embed_all(load_model(WsdConfig(model=str(release), out=str(tmp_path / "probe"))), SENTENCES, probed.setdefault)
    embedder = ElmoEmbedder(str(release), str(release))
    acts, mask = embedder.batch_to_embeddings(SENTENCES)
    mixed = Elmo(str(release), None, 1, dropout=0.0, scalar_mix_parameters=[0.0, 0.0, 0.0])(batch_to_ids(SENTENCES))
    for i, (want, dropped_in) in enumerate(zip(expected, embedder.embed_batch(SENTENCES), strict=True)):
        n = len(SENTENCES[i])
        np.testing.assert_allclose(probed[i], want, atol=1e-5, rtol=0, err_msg="probe")
        np.testing.assert_allclose(dropped_in, want, atol=1e-5, rtol=0, err_msg="ElmoEmbedder")
        if i != 2:  # bytes cut at 48 lose what their 48-character cut keeps (docs §9.3): sentence 2 has such tokens
            np.testing.assert_allclose(acts[i, :, :n], want, atol=1e-5, rtol=0, err_msg="batch_to_ids")
            mix = mixed["elmo_representations"][0][i, :n].detach().numpy()
            np.testing.assert_allclose(mix, want.mean(0), atol=1e-5, rtol=0, err_msg="Elmo")
    assert int(mask.sum()) == sum(map(len, SENTENCES))

    info = run_elmo("info", str(release), env=env)
    assert info.returncode == 0 and "zhs.model: 2x32_16, 60 filters" in info.stdout, info.stdout + info.stderr


@pytest.mark.slow
def test_chinese_text_with_the_chinese_tokenizer(tmp_path, release):
    """Raw Chinese, unsegmented as their models never saw it, cut into words by ``--tokenizer chinese`` (jieba)
    before their dictionaries read it: the table's tokens are jieba's, the vectors those of the words."""
    jieba = pytest.importorskip("jieba")
    text = tmp_path / "zh.txt"
    text.write_text("我们喜欢吃苹果。\n", encoding="utf-8")
    env = {**os.environ, "ELMO_CACHE_DIR": os.environ["ELMO_CACHE_DIR"]}
    out = tmp_path / "zh-table"
    args = ["embed", "--model", str(release), "--input", str(text), "--out", str(out), "--tokenizer", "chinese"]
    done = run_elmo(*args, "--layers", "all", env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = pq.read_table(out).to_pandas().sort_values("token_index")
    words = [w for w in jieba.lcut("我们喜欢吃苹果。") if w.strip()]
    assert rows.token.tolist() == words == SENTENCES[0]
    got = np.stack([np.stack(rows[f"layer_{k}"].to_numpy()) for k in range(3)])
    np.testing.assert_allclose(got, reference_layers(release, words), atol=1e-5, rtol=0)


@pytest.mark.slow
def test_a_release_is_converted_once_and_then_resolved_without_torch(tmp_path):
    """The first resolve converts the folder into the model cache; a second process finds it there without importing
    torch (the server's HTTP process resolves models), and a changed file makes a new entry."""
    folder = write_release(tmp_path / "sv.model", SMALL, WORDS, seed=5)
    code = (
        "import json, sys; from elmo_core.runtime import resolve_model; r = resolve_model(sys.argv[1]); "
        "print(json.dumps([r.origin, str(r.options), 'torch' in sys.modules]))"
    )
    env = {**os.environ, "ELMO_CACHE_DIR": str(tmp_path / "cache")}

    def resolve() -> list:
        done = subprocess.run(
            [sys.executable, "-c", code, str(folder)], env=env, cwd=ROOT, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout.strip().splitlines()[-1])

    first, second = resolve(), resolve()
    assert "converted in" in first[0] and "cached in" in second[0] and first[1] == second[1]
    assert second[2] is False
    assert (Path(first[1]).parent / "char.dic").exists() and (Path(first[1]).parent / "word.dic").exists()
    write_release(folder, SMALL, WORDS, seed=6)  # new weights in the same folder
    assert "converted in" in resolve()[0]


@pytest.mark.slow
def test_exported_it_is_a_model_folder_that_mlflow_registers(tmp_path, release, expected, monkeypatch):
    """``elmo export --run RELEASE`` converts it, char.dic and word.dic kept beside options.json (with its
    ``manylangs`` section) and weights.hdf5; the folder, registered in MLflow, opens as ``models:/NAME/1`` and as the
    pyfunc model (the plain mean of the layers, their ``output_layer=-1``) with their numbers."""
    import mlflow
    import pandas as pd

    from elmo_core.runtime import Runtime
    from elmo_core.tracking import MLflowTracker

    out = tmp_path / "exported"
    done = run_elmo("export", "--run", str(release), "--out", str(out), env=dict(os.environ))
    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(p.name for p in out.iterdir()) == ["char.dic", "options.json", "weights.hdf5", "word.dic"]
    options = json.loads((out / "options.json").read_text())
    chars, words = len(_their_dic(release / "char.dic")), len(_their_dic(release / "word.dic"))
    assert options["manylangs"] == {"n_characters": chars, "n_words": words, "word_dim": 6}
    assert (out / "char.dic").read_text(encoding="utf-8") == (release / "char.dic").read_text(encoding="utf-8")

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    tracker = MLflowTracker(experiment="manylangs-test", tracking_uri=uri)
    assert tracker.log_model_dir(out, "zhs") == "models:/zhs/1"
    tracker.close()
    for got, want in zip(Runtime.open("models:/zhs/1").embed(SENTENCES), expected, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    predicted = mlflow.pyfunc.load_model("models:/zhs/1").predict(
        pd.DataFrame({"sentence": [" ".join(s) for s in SENTENCES[:2]]})
    )
    for got, want in zip(predicted, expected, strict=False):
        np.testing.assert_allclose(np.array(got), want.mean(0), atol=1e-5, rtol=0)


# ----- bad folders -----------------------------------------------------------------------------------------


def _damaged(tmp_path: Path, release: Path, name: str) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    for path in release.iterdir():
        (folder / path.name).write_bytes(path.read_bytes())
    return folder


def _network(folder: Path) -> Path:
    return folder / "net_small.json"


def _edit_json(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


BAD = {
    "truncated encoder.pkl": (
        "encoder.pkl",
        lambda f: (f / "encoder.pkl").write_bytes((f / "encoder.pkl").read_bytes()[:3000]),
    ),
    "missing char.dic": ("char.dic", lambda f: (f / "char.dic").unlink()),
    "missing word.dic": ("word.dic", lambda f: (f / "word.dic").unlink()),
    "unknown key in config.json": ("config.json", lambda f: _edit_json(f / "config.json", lambda d: d.update(foo=1))),
    "unknown key in the network config": (
        "net_small.json",
        lambda f: _edit_json(_network(f), lambda d: d["encoder"].update(peepholes=True)),
    ),
    "a table that does not fit": (
        "token_embedder.pkl",
        lambda f: torch.save(
            {**torch.load(f / "token_embedder.pkl"), "projection.bias": torch.zeros(7)}, f / "token_embedder.pkl"
        ),
    ),
}


@pytest.mark.parametrize("damage", sorted(BAD))
def test_a_bad_folder_fails_in_one_line_that_names_the_file(tmp_path, release, damage):
    from elmo_core.runtime import resolve_model

    name, spoil = BAD[damage]
    folder = _damaged(tmp_path, release, "bad.model")
    spoil(folder)
    with pytest.raises(ElmoError) as caught:
        resolve_model(str(folder))
    message = str(caught.value)
    assert "\n" not in message and str(folder / name) in message, message


class _RunsCode:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


@pytest.mark.slow
def test_a_pickle_that_would_run_code_is_refused_and_exits_2(tmp_path, release):
    """``torch.load(weights_only=True)``: the file is refused before anything in it runs; the CLI's one line, exit 2."""
    folder = _damaged(tmp_path, release, "evil.model")
    marker = tmp_path / "ran"
    torch.save({"projection.bias": _RunsCode(marker)}, folder / "token_embedder.pkl")
    done = run_elmo("info", str(folder), env={**os.environ, "ELMO_CACHE_DIR": str(tmp_path / "cache")})
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2 and not marker.exists()
    assert last.startswith(f"elmo info: error: {folder / 'token_embedder.pkl'}: refused"), last


# ----- fine-tuning and precisions ------------------------------------------------------------------------------


def test_fine_tuning_keeps_their_dictionaries_and_adds_the_new_words(tmp_path, release, expected):
    """``for_vocabulary``: a fresh softmax over the corpus's words; char.dic and word.dic kept and grown by the new
    words and characters (new rows at the end), so known text keeps their numbers; a training step (the trainer's
    two streams of bilm-tf char ids) reaches the new words' rows; saved, it opens with the grown dictionaries."""
    from elmo_core.bilm.fine_tune import for_vocabulary
    from elmo_core.bilm.model import BiLM
    from elmo_core.text.chars import tokens_to_char_array

    bilm = BiLM.from_pretrained(str(release))
    vocab = ["<S>", "</S>", "<UNK>", "我们", "新词", "Ærø", "apple"]
    tuned = for_vocabulary(bilm, vocab)
    words, chars = tuned.dictionaries.words, tuned.dictionaries.chars
    assert tuned.softmax.weight.shape == (7, 16) and tuned.vocab == vocab
    assert {k: words[k] for k in bilm.dictionaries.words} == bilm.dictionaries.words
    assert {k: chars[k] for k in bilm.dictionaries.chars} == bilm.dictionaries.chars
    assert words["新词"] == len(bilm.dictionaries.words) and words["Ærø"] == words["新词"] + 1
    assert {"新", "词", "Æ", "ø"} <= set(chars) - set(bilm.dictionaries.chars) and "<S>" not in words
    tuned.eval()
    for got, want in zip(tuned.embed_sentences(SENTENCES), expected, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)

    tuned.train()
    window = torch.from_numpy(tokens_to_char_array(["<S>", "新词", "我们", "Ærø", "</S>"])).long()[None]
    out = tuned(window, backward_inputs=window.flip(1), dropout=0.1)
    sum(layer.square().sum() for layer in out["activations"][1:]).backward()
    grad = tuned.token_encoder.word_embedding.weight.grad
    assert grad[words["新词"]].abs().sum() > 0 and grad[words["Ærø"]].abs().sum() > 0

    tuned.save_pretrained(str(tmp_path / "tuned"))
    again = BiLM.from_pretrained(str(tmp_path / "tuned"))
    assert again.dictionaries.words == words and again.vocab == vocab and again.config == tuned.config


@pytest.mark.slow
def test_elmo_train_fine_tunes_a_release_on_a_users_corpus(tmp_path, release):
    """``elmo train --init-from zhs.model`` as a user runs it on their corpus: it trains, and the model it exports
    opens with their dictionaries grown by the corpus's new words, a softmax over the corpus's vocabulary."""
    from elmo_core.runtime import Runtime

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"我们 喜欢 新词 {i} 。\n" for i in range(60)))
    steps = [
        ("ingest", str(corpus), "--out", str(tmp_path / "ingest"), "--heldout-fraction", "0.1"),
        ("vocab", "--corpus", str(tmp_path / "ingest"), "--db", str(tmp_path / "vocab" / "vocab.duckdb")),
        ("train", "--data", str(tmp_path / "vocab"), "--out", str(tmp_path / "run"), "--init-from", str(release),
         "--max-steps", "2", "--batch-size", "2", "--unroll-steps", "5", "--n-negative-samples-batch", "8",
         "--tracking", "none"),
    ]  # fmt: skip
    for args in steps:
        done = run_elmo(*args)
        assert done.returncode == 0, done.stderr[-2000:]
    tuned = Runtime.open(str(tmp_path / "run" / "model")).bilm
    published = Runtime.open(str(release)).bilm
    vocab = (tmp_path / "vocab" / "vocab.txt").read_text(encoding="utf-8").split()
    assert tuned.vocab == vocab and tuned.softmax.weight.shape[0] == len(vocab)
    assert "新词" in tuned.dictionaries.words and "新词" not in published.dictionaries.words
    kept = {k: tuned.dictionaries.words[k] for k in published.dictionaries.words}
    assert kept == published.dictionaries.words
    # `elmo export` of the run's checkpoint builds the same model, dictionaries and all, and says what it wrote
    done = run_elmo("export", "--run", str(tmp_path / "run"), "--out", str(tmp_path / "exported"))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "(char.dic, options.json, vocab.txt, weights.hdf5, word.dic)" in done.stdout
    again = Runtime.open(str(tmp_path / "exported"))
    assert again.bilm.dictionaries == tuned.dictionaries and again.bilm.config == tuned.config
    sentences = [["我们", "喜欢", "新词", "。"], ["没见过", "的", "字"]]
    for got, want in zip(again.embed(sentences), Runtime.open(str(tmp_path / "run" / "model")).embed(sentences)):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("precision", [p for p in (*cpu_precisions(), "int8") if p != "fp32"])
def test_other_precisions_run_as_for_any_model(release, expected, precision):
    """bf16 (where native) and int8 run a released folder as any model: close to their fp32 numbers."""
    from elmo_core.runtime import Runtime

    runtime = Runtime.open(str(release), precision=precision)
    for got, want in zip(runtime.embed(SENTENCES), expected, strict=True):
        cosine = (got * want).sum(-1) / (np.linalg.norm(got, axis=-1) * np.linalg.norm(want, axis=-1))
        assert cosine.min() > 0.99, precision


def test_the_network_config_is_found_in_the_folder_beside_it_or_among_the_published(tmp_path):
    """``config_path`` names a file on the publisher's machine: its name is looked for in the folder, then beside the
    folder, then among the published defaults (their 2x4096_512 network); another name is refused naming it."""
    from elmo_core.bilm.manylangs import network_of, published_network

    folder = write_release(tmp_path / "nl.model", SMALL, WORDS[:3], beside=False)
    network, where = network_of(folder)
    assert network == published_network() and where == "the published cnn_50_100_512_4096_sample.json"
    assert network["encoder"]["dim"] == 4096 and network["token_embedder"]["word_dim"] == 100
    (tmp_path / "cnn_50_100_512_4096_sample.json").write_text(json.dumps(SMALL))
    assert network_of(folder) == (SMALL, str(tmp_path / "cnn_50_100_512_4096_sample.json"))
    (folder / "cnn_50_100_512_4096_sample.json").write_text(json.dumps(SMALL))
    assert network_of(folder)[1] == str(folder / "cnn_50_100_512_4096_sample.json")
    _edit_json(folder / "config.json", lambda d: d.update(config_path="/elsewhere/mine.json"))
    with pytest.raises(ElmoError, match="mine.json is neither in"):
        network_of(folder)


def test_for_a_bilm_tf_model_the_fresh_softmax_is_the_trainers_own():
    """``for_vocabulary`` on a bilm-tf model: what the trainer's fine-tuning built before (a new model of the config
    with the softmax's rows, the weights but the softmax loaded, ``init_softmax``), draw for draw."""
    from elmo_core.bilm.fine_tune import for_vocabulary
    from elmo_core.bilm.initialization import init_softmax
    from elmo_core.bilm.model import BiLM
    from tests.helpers import random_tiny_model

    bilm, vocab, counts = random_tiny_model(seed=2), ["<S>", "</S>", "<UNK>", "apple", "pie"], np.arange(5.0)
    torch.manual_seed(7)
    before = BiLM(bilm.config.model_copy(update={"n_tokens_vocab": 5}), vocab=vocab)
    before.load_state_dict({k: v for k, v in bilm.state_dict().items() if not k.startswith("softmax.")}, strict=False)
    init_softmax(before, counts)
    torch.manual_seed(7)
    now = for_vocabulary(bilm, vocab, counts)
    assert now.training and now.dictionaries is None and now.vocab == vocab
    for key, value in before.state_dict().items():
        torch.testing.assert_close(now.state_dict()[key], value, rtol=0, atol=0, msg=key)
