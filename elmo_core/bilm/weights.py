"""bilm-tf / AllenNLP weight files: ``weights.hdf5`` ⇄ a ``BiLM`` state dict, one function per direction.

The HDF5 file is flat: float32 datasets named after the TF variables (``docs/elmo-format.md`` §3). Every
TensorFlow convention is converted here and nowhere else:

* ``char_embed`` has 261 rows (raw ids); the model's table has a zero row 0 for the +1 scheme.
* conv kernels are TF ``[1, width, in, out]``; PyTorch ``Conv1d`` wants ``[out, in, width]``.
* dense kernels are ``x @ W`` (in × out); ``nn.Linear`` stores ``W.T``.
* LSTM ``W_0`` is ``[input rows; recurrent rows] × 4H`` with gate blocks **i, j, f, o**; PyTorch splits it into
  ``weight_ih``/``weight_hh`` with blocks **i, f, g(=j), o**. ``B`` lacks TF's run-time forget-gate +1, which
  the state dict keeps in the (frozen) ``bias_hh``, so load → save is bit-exact. ``W_P_0`` (H × P) is ``weight_hr.T``.

Only the ``ModelConfig`` and the state-dict key names are needed here: this module never builds a model. A model
folder is written whole or not at all, and its size is checked against the free space first (``write_model_files``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np
import torch

from elmo_core.config import (
    OPTIONS_NAME,
    VOCAB_NAME,
    WEIGHTS_NAME,
    ModelConfig,
    read_options,
    resolve_model_files,
    write_options,
)
from elmo_core.errors import WeightFileError, disk_full
from elmo_core.fileio import atomic_folder, atomic_path, disk_full_error, require_space
from elmo_core.text.vocab_file import read_vocab_file, write_vocab_file

_GATES_TF_TO_TORCH = (0, 2, 1, 3)  # i, j, f, o → i, f, j, o (self-inverse)


def _lstm_prefix(direction: int, layer: int) -> str:
    return f"RNN_{direction}/RNN/MultiRNNCell/Cell{layer}/LSTMCell"


def _reorder_gates(x: np.ndarray, axis: int) -> np.ndarray:
    blocks = np.split(x, 4, axis=axis)
    return np.concatenate([blocks[i] for i in _GATES_TF_TO_TORCH], axis=axis)


def forget_gate_bias(hidden: int) -> torch.Tensor:
    """TensorFlow's constant +1 on the forget gate, as a bias vector in PyTorch gate order (i, f, g, o)."""
    one = torch.zeros(4 * hidden)
    one[hidden : 2 * hidden] = 1.0
    return one


def _lstm_keys(config: ModelConfig) -> list[tuple[int, int, str]]:
    """(direction, layer, state-dict prefix) of every LSTM, in the order bilm-tf numbers them."""
    return [
        (d, layer, f"lstm.{side}_layers.{layer}")
        for d, side in enumerate(("forward", "backward"))
        for layer in range(config.lstm.n_layers)
    ]


class _Reader:
    """Reads datasets by name and checks their shapes, with errors that name the file and dataset."""

    def __init__(self, f: h5py.File, path: str) -> None:
        self.f, self.path = f, path

    def has(self, name: str) -> bool:
        return name in self.f and isinstance(self.f[name], h5py.Dataset)

    def get(self, name: str, shape: tuple[int, ...], why: str, aliases: tuple[str, ...] = ()) -> np.ndarray:
        for candidate in (name, *aliases):
            if self.has(candidate):
                data = self.f[candidate]
                if tuple(data.shape) != shape:
                    raise WeightFileError(
                        f"{self.path}: dataset '{candidate}' has shape {tuple(data.shape)}, expected {shape} "
                        f"({why}); the options do not match these weights"
                    )
                return np.asarray(data[...], dtype=np.float32)
        raise WeightFileError(f"{self.path}: dataset '{name}' is missing (expected shape {shape}, {why})")


def read_weights(path: str | Path, config: ModelConfig) -> dict[str, torch.Tensor]:
    """A complete ``BiLM`` state dict for ``config`` from a bilm-tf ``weights.hdf5`` (softmax when the file has it)."""
    path = str(path)
    cnn, lstm = config.char_cnn, config.lstm
    d_c, n_filters, p, h = cnn.embedding.dim, cnn.n_filters, lstm.projection_dim, lstm.dim
    state: dict[str, torch.Tensor] = {}
    with _open(path) as f:
        r = _Reader(f, path)
        char_embed = r.get("char_embed", (261, d_c), f"261 raw char ids × char_cnn.embedding.dim {d_c}")
        state["token_encoder.char_cnn.char_embedding.weight"] = torch.from_numpy(
            np.concatenate([np.zeros((1, d_c), np.float32), char_embed])
        )
        for i, (width, count) in enumerate(cnn.filters):
            why = f"char_cnn.filters[{i}] = [{width}, {count}]"
            kernel = r.get(f"CNN/W_cnn_{i}", (1, width, d_c, count), why)
            state[f"token_encoder.char_cnn.convs.{i}.weight"] = torch.from_numpy(
                np.ascontiguousarray(kernel[0].transpose(2, 1, 0))
            )
            state[f"token_encoder.char_cnn.convs.{i}.bias"] = torch.from_numpy(r.get(f"CNN/b_cnn_{i}", (count,), why))
        for k in range(cnn.n_highway):
            why = f"highway {k} of width {n_filters}"
            for name in ("carry", "transform"):
                w = r.get(f"CNN_high_{k}/W_{name}", (n_filters, n_filters), why)
                state[f"token_encoder.highways.{k}.{name}.weight"] = torch.from_numpy(np.ascontiguousarray(w.T))
                state[f"token_encoder.highways.{k}.{name}.bias"] = torch.from_numpy(
                    r.get(f"CNN_high_{k}/b_{name}", (n_filters,), why)
                )
        if n_filters != p:
            why = f"{n_filters} filters → projection_dim {p}"
            state["token_encoder.projection.weight"] = torch.from_numpy(
                np.ascontiguousarray(r.get("CNN_proj/W_proj", (n_filters, p), why).T)
            )
            state["token_encoder.projection.bias"] = torch.from_numpy(r.get("CNN_proj/b_proj", (p,), why))
        for direction, layer, key in _lstm_keys(config):
            prefix = _lstm_prefix(direction, layer)
            # bilm-tf's 1-layer training graph has no MultiRNNCell; accept its dumped names too
            alias = (f"RNN_{direction}/RNN/LSTMCell",) if lstm.n_layers == 1 else ()
            why = f"lstm layer {layer}: input {p} + recurrent {p} rows, 4 × dim {h} columns"
            w0 = _reorder_gates(r.get(f"{prefix}/W_0", (2 * p, 4 * h), why, tuple(f"{a}/W_0" for a in alias)), axis=1)
            b = _reorder_gates(r.get(f"{prefix}/B", (4 * h,), why, tuple(f"{a}/B" for a in alias)), axis=0)
            state[f"{key}.weight_ih_l0"] = torch.from_numpy(np.ascontiguousarray(w0[:p].T))
            state[f"{key}.weight_hh_l0"] = torch.from_numpy(np.ascontiguousarray(w0[p:].T))
            state[f"{key}.bias_ih_l0"] = torch.from_numpy(b)
            state[f"{key}.bias_hh_l0"] = forget_gate_bias(h)  # TF adds it at run time; the model keeps it here
            if p < h:
                wp = r.get(f"{prefix}/W_P_0", (h, p), f"projection dim {h} → {p}", tuple(f"{a}/W_P_0" for a in alias))
                state[f"{key}.weight_hr_l0"] = torch.from_numpy(np.ascontiguousarray(wp.T))
        if config.n_tokens_vocab is not None or r.has("softmax/W"):
            rows = config.n_tokens_vocab or f["softmax/W"].shape[0]
            why = f"softmax over {rows} vocabulary tokens × projection_dim {p}"
            state["softmax.weight"] = torch.from_numpy(r.get("softmax/W", (rows, p), why))
            state["softmax.bias"] = torch.from_numpy(r.get("softmax/b", (rows,), why))
    return state


def _open(path: str | Path) -> h5py.File:
    try:
        return h5py.File(path, "r")
    except FileNotFoundError:
        raise WeightFileError(f"{path}: weight file not found") from None
    except OSError as exc:
        raise WeightFileError(f"{path}: not a readable HDF5 file ({exc})") from None


def softmax_rows(path: str | Path) -> int | None:
    """Rows of ``softmax/W`` in a weight file, or None when it has no softmax."""
    with _open(path) as f:
        return int(f["softmax/W"].shape[0]) if "softmax/W" in f else None


def weights_image(config: ModelConfig, state_dict: dict[str, torch.Tensor]) -> bytes:
    """bilm-tf's ``weights.hdf5`` layout (plus ``softmax/W``, ``softmax/b`` when present) as the file's bytes, made
    in memory: HDF5 never writes to a disk, so a full one is an ``OSError`` of the plain write after (HDF5's own
    failed writes can end the process in a segmentation fault), and the size is known before the first byte."""
    cfg = config
    sd = {k: v.detach().float().cpu().numpy() for k, v in state_dict.items()}
    with h5py.File(f"weights-{id(sd)}.hdf5", "w", driver="core", backing_store=False) as f:

        def put(name: str, value: np.ndarray) -> None:
            f.create_dataset(name, data=np.ascontiguousarray(value, dtype=np.float32))

        put("char_embed", sd["token_encoder.char_cnn.char_embedding.weight"][1:])
        for i in range(len(cfg.char_cnn.filters)):
            put(f"CNN/W_cnn_{i}", sd[f"token_encoder.char_cnn.convs.{i}.weight"].transpose(2, 1, 0)[None])
            put(f"CNN/b_cnn_{i}", sd[f"token_encoder.char_cnn.convs.{i}.bias"])
        for k in range(cfg.char_cnn.n_highway):
            for name in ("carry", "transform"):
                put(f"CNN_high_{k}/W_{name}", sd[f"token_encoder.highways.{k}.{name}.weight"].T)
                put(f"CNN_high_{k}/b_{name}", sd[f"token_encoder.highways.{k}.{name}.bias"])
        if "token_encoder.projection.weight" in sd:
            put("CNN_proj/W_proj", sd["token_encoder.projection.weight"].T)
            put("CNN_proj/b_proj", sd["token_encoder.projection.bias"])
        forget = forget_gate_bias(cfg.lstm.dim).numpy()
        for direction, layer, key in _lstm_keys(cfg):
            prefix = _lstm_prefix(direction, layer)
            w0 = np.concatenate([sd[f"{key}.weight_ih_l0"], sd[f"{key}.weight_hh_l0"]], axis=1).T
            bias = sd[f"{key}.bias_ih_l0"]
            extra = sd[f"{key}.bias_hh_l0"] - forget
            if extra.any():  # trained models may have moved bias_hh; fold it in (never adds -0.0 to 0.0)
                bias = bias + extra
            put(f"{prefix}/W_0", _reorder_gates(w0, axis=1))
            put(f"{prefix}/B", _reorder_gates(bias, axis=0))
            if f"{key}.weight_hr_l0" in sd:
                put(f"{prefix}/W_P_0", sd[f"{key}.weight_hr_l0"].T)
        if "softmax.weight" in sd:
            put("softmax/W", sd["softmax.weight"])
            put("softmax/b", sd["softmax.bias"])
        f.flush()
        return f.id.get_file_image()


def write_weights(config: ModelConfig, state_dict: dict[str, torch.Tensor], path: str | Path) -> None:
    """Write bilm-tf's ``weights.hdf5`` (``weights_image``) atomically."""
    image = weights_image(config, state_dict)
    with atomic_path(path) as tmp:
        tmp.write_bytes(image)


def read_model_files(
    options_or_dir: str | Path, weight_file: str | Path | None = None, vocab_file: str | Path | None = None
) -> tuple[ModelConfig, dict[str, torch.Tensor], list[str] | None]:
    """(config, state dict, vocabulary or None) of ``options.json`` + ``weights.hdf5`` (+ ``vocab.txt``)."""
    options_path, weight_path, vocab_path = resolve_model_files(options_or_dir, weight_file, vocab_file)
    config = read_options(options_path)
    if not weight_path.exists():
        raise WeightFileError(f"{weight_path}: weight file not found")
    if config.n_tokens_vocab is None:
        rows = softmax_rows(weight_path)
        if rows is not None:
            config = config.model_copy(update={"n_tokens_vocab": rows})
    vocab = read_vocab_file(vocab_path) if vocab_path is not None else None
    return config, read_weights(weight_path, config), vocab


def write_model_files(
    directory: str | Path,
    config: ModelConfig,
    state_dict: dict[str, torch.Tensor],
    vocab: list[str] | None = None,
    *,
    image: bytes | None = None,
    more: Callable[[Path], None] | None = None,
    more_bytes: int = 0,
) -> None:
    """options.json + weights.hdf5 (+ vocab.txt) that bilm-tf and AllenNLP load unchanged. The folder appears
    complete or not at all (``atomic_folder``: written beside it, then renamed into place; temporaries of an export
    that died are removed), and one that would not fit is refused before the first byte (``require_space``).
    ``image``: the weight file's bytes where the caller made them; ``more(folder)`` writes further files of about
    ``more_bytes`` (an ELMoForManyLangs model's dictionaries) into the folder before it appears."""
    directory = Path(directory)
    image = image if image is not None else weights_image(config, state_dict)
    words = "".join(f"{token}\n" for token in vocab).encode() if vocab is not None else b""
    needed = len(image) + len(words) + more_bytes + 16 * 1024  # + options.json, file system blocks
    require_space(directory, needed, "the model")
    try:
        with atomic_folder(directory) as tmp:
            write_options(config, tmp / OPTIONS_NAME)
            with atomic_path(tmp / WEIGHTS_NAME) as weights:
                weights.write_bytes(image)
            if more is not None:
                more(tmp)
            if vocab is not None:
                write_vocab_file(vocab, tmp / VOCAB_NAME)
    except OSError as exc:
        if not disk_full(exc):
            raise
        kept = f"{directory} is as it was" if directory.exists() else f"no half of {directory} was left"
        raise disk_full_error(directory, kept, exc) from exc
