"""ELMoForManyLangs' released models (HIT-SCIR, ``docs/elmo-format.md`` §9) ⇄ this project's biLM, one function per
direction; this module never builds a model.

A released folder (``zhs.model``, ``de.model``, …)::

    config.json          their training command's arguments; ``config_path`` names the network config
    char.dic, word.dic   their dictionaries (``text.manylangs_chars``)
    token_embedder.pkl   the token layer's state dict: word and char tables, convolutions, highways, projection
    encoder.pkl          the LSTMs' state dict

The network config is not in the archives (``config_path`` is a path on the publisher's machine): its file name is
looked for in the folder, then beside it, then among the published defaults shipped here (``NETWORKS``). The
``.pkl`` files are read as plain state dicts (``torch.load(weights_only=True)``): a pickle that would run code is
refused. Their conventions, converted here and nowhere else:

* the char table: their rows after a zero row 0 (ids + 1, as ``manylangs_chars`` spells them);
* highways: AllenNLP's ``Linear(F, 2F)`` holds [transform; gate] and gates the *input*,
  y = g·x + (1 − g)·relu(A x); ours gates the transform with σ(W_carry x), so W_carry = −W_gate, b_carry = −b_gate;
* LSTMs (AllenNLP's ``LstmCellWithProjection``, gates i, f, g, o as ours): ``input_linearity`` = ``weight_ih``,
  ``state_linearity`` = ``weight_hh`` with the bias, ``state_projection`` = ``weight_hr``; their bias holds the
  whole forget-gate bias, ours keeps TensorFlow's +1 in ``bias_hh``: ``bias_ih`` = their bias − that +1.

In this project's world such a model is a model folder like any other (``write_model``, ``convert_release``):
options.json with a ``manylangs`` section, weights.hdf5 in bilm-tf's names plus ``word_embed`` (W, D_w), with
``char_embed`` (C, D_c) their char table and ``CNN_proj/W_proj`` (D_w + F, P), and their ``char.dic``/``word.dic``.
"""

from __future__ import annotations

import io
import json
import pickle
import zipfile
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch
from pydantic import ValidationError

from elmo_core.bilm.weights import (
    _lstm_keys,
    _lstm_prefix,
    _open,
    _Reader,
    _reorder_gates,
    forget_gate_bias,
    read_model_files,
    weights_image,
    write_model_files,
)
from elmo_core.config import (
    CharCNNConfig,
    CharEmbeddingConfig,
    LstmConfig,
    ManyLangsConfig,
    ModelConfig,
    read_options,
    resolve_model_files,
)
from elmo_core.errors import ConfigError, WeightFileError
from elmo_core.text.manylangs_chars import RELEASE_CONFIG, Dictionaries, is_release, spelling
from elmo_core.text.vocab_file import read_vocab_file

__all__ = ["Dictionaries", "NETWORKS", "convert_release", "is_release", "read_model", "read_release", "spelling"]

TOKEN_EMBEDDER, ENCODER = "token_embedder.pkl", "encoder.pkl"


def published_network() -> dict[str, Any]:
    """The network every published ELMoForManyLangs model was trained with (their README: the same settings for
    all languages): the original ELMo's 2x4096_512 biLM over the char CNN of 2048 filters, 50-wide characters and a
    100-wide word embedding beside it."""
    filters = [[1, 32], [2, 32], [3, 64], [4, 128], [5, 256], [6, 512], [7, 1024]]
    return {
        "encoder": {"name": "elmo", "projection_dim": 512, "cell_clip": 3, "proj_clip": 3, "dim": 4096, "n_layers": 2},
        "token_embedder": {
            **{"name": "cnn", "activation": "relu", "filters": filters, "n_highway": 2},
            **{"word_dim": 100, "char_dim": 50, "max_characters_per_token": 50},
        },
        "classifier": {"name": "sampled_softmax", "n_samples": 8192},
        "dropout": 0.1,
    }


# The network configs their package ships, by the file name a release's config.json gives (both hold the same).
NETWORKS = {"cnn_50_100_512_4096_sample.json": published_network, "cnn_0_100_512_4096_sample.json": published_network}

# What a network config may hold (their trainer's keys); anything else is refused rather than ignored.
NETWORK_KEYS = {
    "encoder": {"name", "projection_dim", "cell_clip", "proj_clip", "dim", "n_layers"},
    "token_embedder": {
        "name",
        "activation",
        "filters",
        "n_highway",
        "word_dim",
        "char_dim",
        "max_characters_per_token",
    },
    "classifier": {"name", "n_samples"},
    "dropout": None,
}
# config.json: the arguments of their training command (``biLM.py train``), as it dumps them.
TRAINING_KEYS = {
    *("seed", "gpu", "train_path", "valid_path", "test_path", "config_path", "word_embedding", "optimizer", "lr"),
    *("lr_decay", "model", "batch_size", "max_epoch", "clip_grad", "max_sent_len", "min_count", "max_vocab_size"),
    *("save_classify_layer", "valid_size", "eval_steps"),
}


# ----- the network config ---------------------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: missing; a released ELMoForManyLangs model has it") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


def _unknown(found: dict[str, Any], known: set[str], where: str) -> None:
    extra = sorted(set(found) - known)
    if extra:
        raise ConfigError(f"{where}: unknown keys {', '.join(map(repr, extra))}; expected some of {sorted(known)}")


def network_of(folder: Path) -> tuple[dict[str, Any], str]:
    """A release's network config and where it came from: the file ``config.json`` names, looked for in the
    folder, beside it, at the path as written, then among the published defaults (``NETWORKS``)."""
    args_path = folder / RELEASE_CONFIG
    args = _read_json(args_path)
    _unknown(args, TRAINING_KEYS, str(args_path))
    if not isinstance(args.get("config_path"), str):
        raise ConfigError(f"{args_path}: no config_path naming the network config")
    name = Path(args["config_path"]).name
    for candidate in (folder / name, folder.parent / name, folder / args["config_path"]):
        if candidate.is_file():
            return _read_json(candidate), str(candidate)
    if name in NETWORKS:
        return NETWORKS[name](), f"the published {name}"
    raise ConfigError(
        f"{args_path}: its network config {name} is neither in {folder} nor beside it, and is not one of the "
        f"published ones ({', '.join(NETWORKS)}); put {name} into {folder}"
    )


def model_config(network: dict[str, Any], source: str, n_characters: int, n_words: int) -> ModelConfig:
    """Their network config (checked key by key) and table sizes ─► a ``ModelConfig`` with a ``manylangs`` section."""
    _unknown(network, set(NETWORK_KEYS), source)
    for section, known in NETWORK_KEYS.items():
        if known is not None:
            _unknown(network.get(section) or {}, known, f"{source} [{section}]")
    try:
        enc, emb = network["encoder"], network["token_embedder"]
        if enc.get("name", "elmo").lower() != "elmo" or emb.get("name", "cnn").lower() != "cnn":
            raise ConfigError(
                f"{source}: encoder {enc.get('name')!r} with token_embedder {emb.get('name')!r}; only their published "
                "'elmo' encoder over the 'cnn' token embedder runs here"
            )
        if not emb["char_dim"]:
            raise ConfigError(f"{source}: char_dim 0 (a word-only token layer) is not supported")
        char_cnn = CharCNNConfig(
            embedding=CharEmbeddingConfig(dim=emb["char_dim"]),
            filters=emb["filters"],
            n_highway=emb["n_highway"],
            activation=emb["activation"],
            max_characters_per_token=emb["max_characters_per_token"],
        )
        lstm = LstmConfig(
            dim=enc["dim"],
            projection_dim=enc["projection_dim"],
            n_layers=enc["n_layers"],
            cell_clip=enc.get("cell_clip") or None,  # their falsy clip is no clip
            proj_clip=enc.get("proj_clip") or None,
        )
        if lstm.projection_dim >= lstm.dim:
            raise ConfigError(f"{source}: projection_dim {lstm.projection_dim} must be below dim {lstm.dim}")
        words = ManyLangsConfig(
            n_characters=n_characters, n_words=n_words if emb["word_dim"] else 0, word_dim=emb["word_dim"]
        )
        return ModelConfig(char_cnn=char_cnn, lstm=lstm, manylangs=words)
    except KeyError as exc:
        raise ConfigError(f"{source}: no {exc.args[0]!r}") from None
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise ConfigError(f"{source}: invalid: {problems}") from None
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{source}: invalid: {exc}") from None


# ----- their .pkl files ─► a state dict ------------------------------------------------------------------


def read_pkl(path: Path) -> dict[str, torch.Tensor]:
    """One of their ``.pkl`` files as the plain state dict it is. A truncated or damaged file, and a pickle that
    would build anything but tensors (run code), are refused in one line."""
    if not path.is_file():
        raise WeightFileError(f"{path}: missing; a released ELMoForManyLangs model has {TOKEN_EMBEDDER} and {ENCODER}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        reason = next((line.strip() for line in str(exc).splitlines() if "unsupported" in line.lower()), "")
        if "Weights only load failed" in str(exc) and reason:
            raise WeightFileError(
                f"{path}: refused: not a plain state dict, loading it would run code ({reason})"
            ) from None
        raise WeightFileError(f"{path}: truncated or damaged ({str(exc).splitlines()[0]})") from None
    except (EOFError, RuntimeError, ValueError, OSError, zipfile.BadZipFile) as exc:
        first = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise WeightFileError(f"{path}: truncated or damaged, not a whole PyTorch file ({first})") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise WeightFileError(f"{path}: expected a state dict of tensors, found {type(state).__name__}")
    return {key: value.float() for key, value in state.items()}


class _Pkl:
    """A state dict read key by key, with errors that name the file, the key and the shape expected."""

    def __init__(self, path: Path, source: str) -> None:
        self.path, self.source, self.state, self.used = path, source, read_pkl(path), set()

    def rows(self, key: str) -> int:
        if key not in self.state:
            raise WeightFileError(f"{self.path}: no {key!r}")
        return int(self.state[key].shape[0])

    def get(self, key: str, shape: tuple[int, ...]) -> torch.Tensor:
        if key not in self.state:
            raise WeightFileError(f"{self.path}: no {key!r} (expected shape {shape})")
        found = self.state[key]
        if tuple(found.shape) != shape:
            raise WeightFileError(
                f"{self.path}: {key!r} has shape {tuple(found.shape)}, expected {shape} by {self.source}; the network "
                "config does not fit these weights"
            )
        self.used.add(key)
        return found

    def check_all_used(self) -> None:
        extra = sorted(set(self.state) - self.used)
        if extra:
            raise WeightFileError(f"{self.path}: keys the network config has no place for: {', '.join(extra[:8])}")


def _token_layer(config: ModelConfig, te: _Pkl) -> dict[str, torch.Tensor]:
    cnn, ml, p = config.char_cnn, config.manylangs, config.lstm.projection_dim
    assert ml is not None
    d_c, f = cnn.embedding.dim, cnn.n_filters
    table = te.get("char_emb_layer.embedding.weight", (ml.n_characters, d_c))
    state = {"token_encoder.char_cnn.char_embedding.weight": torch.cat([table.new_zeros(1, d_c), table])}
    for i, (width, count) in enumerate(cnn.filters):  # Conv1d (out, in, width), as ours
        state[f"token_encoder.char_cnn.convs.{i}.weight"] = te.get(f"convolutions.{i}.weight", (count, d_c, width))
        state[f"token_encoder.char_cnn.convs.{i}.bias"] = te.get(f"convolutions.{i}.bias", (count,))
    for k in range(cnn.n_highway):
        w, b = te.get(f"highways._layers.{k}.weight", (2 * f, f)), te.get(f"highways._layers.{k}.bias", (2 * f,))
        ours = f"token_encoder.highways.{k}"
        state[f"{ours}.transform.weight"], state[f"{ours}.transform.bias"] = w[:f], b[:f]
        state[f"{ours}.carry.weight"], state[f"{ours}.carry.bias"] = -w[f:], -b[f:]  # σ(−z) = 1 − σ(z)
    words = (ml.n_words, ml.word_dim)
    table = te.get("word_emb_layer.embedding.weight", words) if ml.word_dim else torch.zeros(1, 0)
    state["token_encoder.word_embedding.weight"] = table
    state["token_encoder.projection.weight"] = te.get("projection.weight", (p, ml.word_dim + f))
    state["token_encoder.projection.bias"] = te.get("projection.bias", (p,))
    return state


def _lstms(config: ModelConfig, enc: _Pkl) -> dict[str, torch.Tensor]:
    p, h = config.lstm.projection_dim, config.lstm.dim
    forget = forget_gate_bias(h)
    state = {}
    for direction, layer, key in _lstm_keys(config):
        theirs = f"{('forward', 'backward')[direction]}_layer_{layer}"
        state[f"{key}.weight_ih_l0"] = enc.get(f"{theirs}.input_linearity.weight", (4 * h, p))
        state[f"{key}.weight_hh_l0"] = enc.get(f"{theirs}.state_linearity.weight", (4 * h, p))
        state[f"{key}.bias_ih_l0"] = enc.get(f"{theirs}.state_linearity.bias", (4 * h,)) - forget
        state[f"{key}.bias_hh_l0"] = forget.clone()
        state[f"{key}.weight_hr_l0"] = enc.get(f"{theirs}.state_projection.weight", (p, h))
    return state


def read_release(folder: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor], Dictionaries]:
    """A released folder ─► (its ``ModelConfig``, a ``BiLM`` state dict, its dictionaries); refused in one line that
    names the file where a file is missing, truncated, or does not fit the network config."""
    folder = Path(folder)
    network, source = network_of(folder)
    te, enc = _Pkl(folder / TOKEN_EMBEDDER, source), _Pkl(folder / ENCODER, source)
    words = (network.get("token_embedder") or {}).get("word_dim")
    n_words = te.rows("word_emb_layer.embedding.weight") if words else 0
    config = model_config(network, source, te.rows("char_emb_layer.embedding.weight"), n_words)
    dics = Dictionaries.read(folder, config.char_cnn.max_characters_per_token, words=bool(words))
    _check_fits(dics, config, folder)
    state = {**_token_layer(config, te), **_lstms(config, enc)}
    te.check_all_used()
    enc.check_all_used()
    return config, state, dics


def _check_fits(dics: Dictionaries, config: ModelConfig, folder: Path) -> None:
    ml = config.manylangs
    assert ml is not None
    if dics.n_chars > ml.n_characters:
        raise WeightFileError(
            f"{folder}/char.dic: ids reach {dics.n_chars - 1}, the char table has {ml.n_characters} rows"
        )
    if dics.n_words > max(ml.n_words, 1 if not ml.word_dim else 0):
        raise WeightFileError(f"{folder}/word.dic: ids reach {dics.n_words - 1}, the word table has {ml.n_words} rows")


# ----- this project's model folder with their dictionaries --------------------------------------------------


def _t(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array))


def _project_state(path: Path, config: ModelConfig) -> dict[str, torch.Tensor]:
    """weights.hdf5 of a ManyLangs model folder (``write_model``) ─► a state dict: bilm-tf's names and conventions
    (``weights.py``) with their table sizes, and ``word_embed``."""
    cnn, ml, p, h = config.char_cnn, config.manylangs, config.lstm.projection_dim, config.lstm.dim
    assert ml is not None
    d_c, f, enc = cnn.embedding.dim, cnn.n_filters, "token_encoder"
    state: dict[str, torch.Tensor] = {}
    with _open(path) as file:
        r = _Reader(file, str(path))
        table = r.get("char_embed", (ml.n_characters, d_c), f"char.dic's {ml.n_characters} ids × {d_c}")
        state[f"{enc}.char_cnn.char_embedding.weight"] = _t(np.concatenate([np.zeros((1, d_c), np.float32), table]))
        for i, (width, count) in enumerate(cnn.filters):
            kernel = r.get(f"CNN/W_cnn_{i}", (1, width, d_c, count), f"filter {i}")
            state[f"{enc}.char_cnn.convs.{i}.weight"] = _t(kernel[0].transpose(2, 1, 0))
            state[f"{enc}.char_cnn.convs.{i}.bias"] = _t(r.get(f"CNN/b_cnn_{i}", (count,), f"filter {i}"))
        for k in range(cnn.n_highway):
            for name in ("carry", "transform"):
                w = r.get(f"CNN_high_{k}/W_{name}", (f, f), f"highway {k}")
                state[f"{enc}.highways.{k}.{name}.weight"] = _t(w.T)
                state[f"{enc}.highways.{k}.{name}.bias"] = _t(r.get(f"CNN_high_{k}/b_{name}", (f,), f"highway {k}"))
        words = r.get("word_embed", (max(ml.n_words, 1), ml.word_dim), "word.dic's ids × word_dim")
        state[f"{enc}.word_embedding.weight"] = _t(words)
        state[f"{enc}.projection.weight"] = _t(r.get("CNN_proj/W_proj", (ml.word_dim + f, p), "[word; char CNN]").T)
        state[f"{enc}.projection.bias"] = _t(r.get("CNN_proj/b_proj", (p,), "projection"))
        for direction, layer, key in _lstm_keys(config):
            prefix, why = _lstm_prefix(direction, layer), f"lstm layer {layer}"
            w0 = _reorder_gates(r.get(f"{prefix}/W_0", (2 * p, 4 * h), why), axis=1)
            state[f"{key}.weight_ih_l0"], state[f"{key}.weight_hh_l0"] = _t(w0[:p].T), _t(w0[p:].T)
            state[f"{key}.bias_ih_l0"] = _t(_reorder_gates(r.get(f"{prefix}/B", (4 * h,), why), axis=0))
            state[f"{key}.bias_hh_l0"] = forget_gate_bias(h)
            state[f"{key}.weight_hr_l0"] = _t(r.get(f"{prefix}/W_P_0", (h, p), why).T)
        if config.n_tokens_vocab is not None:
            state["softmax.weight"] = _t(r.get("softmax/W", (config.n_tokens_vocab, p), "softmax"))
            state["softmax.bias"] = _t(r.get("softmax/b", (config.n_tokens_vocab,), "softmax"))
    return state


def read_model(
    options_or_dir: str | Path, weight_file: str | Path | None = None, vocab_file: str | Path | None = None
) -> tuple[ModelConfig, dict[str, torch.Tensor], list[str] | None, Dictionaries | None]:
    """(config, state dict, vocabulary, dictionaries) of any model ``BiLM.from_pretrained`` loads: a released
    ELMoForManyLangs folder (``read_release``), a model folder with its dictionaries (``write_model``), or bilm-tf's
    files (``weights.read_model_files``; dictionaries None)."""
    if is_release(options_or_dir):
        config, state, dics = read_release(options_or_dir)
        return config, state, None, dics
    options, weights, vocab_path = resolve_model_files(options_or_dir, weight_file, vocab_file)
    config = read_options(options)
    if config.manylangs is None:
        return (*read_model_files(options_or_dir, weight_file, vocab_file), None)
    if not weights.exists():
        raise WeightFileError(f"{weights}: weight file not found")
    with _open(weights) as f:
        if config.n_tokens_vocab is None and "softmax/W" in f:
            config = config.model_copy(update={"n_tokens_vocab": int(f["softmax/W"].shape[0])})
    dics = Dictionaries.read(
        options.parent, config.char_cnn.max_characters_per_token, words=config.manylangs.word_dim > 0
    )
    _check_fits(dics, config, options.parent)
    vocab = read_vocab_file(vocab_path) if vocab_path is not None else None
    return config, _project_state(weights, config), vocab, dics


def write_model(
    directory: str | Path,
    config: ModelConfig,
    state_dict: dict[str, torch.Tensor],
    vocab: list[str] | None = None,
    dics: Dictionaries | None = None,
) -> None:
    """A model folder: bilm-tf's (``weights.write_model_files``), or with a ManyLangs model's ``dics`` its
    options.json (a ``manylangs`` section), weights.hdf5 (+ ``word_embed``), char.dic, word.dic (+ vocab.txt);
    whole or not at all, its size checked first."""
    if dics is None:
        write_model_files(directory, config, state_dict, vocab)
        return
    image = _with_words(weights_image(config, state_dict), state_dict["token_encoder.word_embedding.weight"])
    more_bytes = 64 * (len(dics.chars) + len(dics.words or ())) + (1 << 20)
    write_model_files(directory, config, state_dict, vocab, image=image, more=dics.write, more_bytes=more_bytes)


def _with_words(image: bytes, words: torch.Tensor) -> bytes:
    """bilm-tf's weights image with the word table added as ``word_embed`` (made in memory, as ``weights_image``)."""
    with h5py.File(f"words-{id(image)}.hdf5", "w", driver="core", backing_store=False) as f:
        with h5py.File(io.BytesIO(image), "r") as source:
            for name in _datasets(source):
                f.create_dataset(name, data=source[name][...])
        f.create_dataset("word_embed", data=words.detach().float().cpu().numpy())
        f.flush()
        return f.id.get_file_image()


def _datasets(group: h5py.Group, prefix: str = "") -> list[str]:
    names = []
    for name, item in group.items():
        names += _datasets(item, f"{prefix}{name}/") if isinstance(item, h5py.Group) else [f"{prefix}{name}"]
    return names


def convert_release(folder: str | Path, out: str | Path) -> ModelConfig:
    """A released folder ─► a model folder of this project that keeps their dictionaries (``write_model``): what
    every command opens, MLflow registers and ``models:/`` serves. Returns its config."""
    config, state, dics = read_release(folder)
    write_model(out, config, state, None, dics)
    return config
