"""Typed model configuration with bilm-tf's option names, and the published ELMo sizes as presets.

``ModelConfig`` is exactly what ``options.json`` holds for inference (``char_cnn`` + ``lstm``), plus the
softmax size when the model carries one. It round-trips through ``options.json`` and YAML/JSON files.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from elmo_core.errors import ConfigError, WeightFileError
from elmo_core.fileio import write_text_atomic
from elmo_core.text.chars import MAX_CHARS, N_CHARS

# The char-CNN of every published ELMo (2048 filters in total).
PUBLISHED_FILTERS: list[list[int]] = [[1, 32], [2, 32], [3, 64], [4, 128], [5, 256], [6, 512], [7, 1024]]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class CharEmbeddingConfig(_Strict):
    dim: int = Field(16, gt=0, description="D_c, width of one character's embedding")


class CharCNNConfig(_Strict):
    embedding: CharEmbeddingConfig = CharEmbeddingConfig()
    filters: list[list[int]] = Field(default_factory=lambda: [list(f) for f in PUBLISHED_FILTERS])
    n_highway: int = Field(2, ge=0)
    activation: Literal["relu", "tanh"] = "relu"
    max_characters_per_token: int = Field(MAX_CHARS, ge=3)
    # 262 at inference (a zero padding row), 261 in bilm-tf training files; the model always holds 262.
    n_characters: int = Field(N_CHARS, ge=261, le=262)

    @model_validator(mode="after")
    def _check_filters(self) -> CharCNNConfig:
        for f in self.filters:
            if len(f) != 2 or f[0] <= 0 or f[1] <= 0:
                raise ValueError(f"each filter must be [width, count] with positive ints, got {f}")
            if f[0] > self.max_characters_per_token:
                raise ValueError(f"filter width {f[0]} exceeds max_characters_per_token")
        return self

    @property
    def n_filters(self) -> int:
        return sum(count for _, count in self.filters)


class LstmConfig(_Strict):
    dim: int = Field(4096, gt=0, description="H, LSTM cell size")
    projection_dim: int = Field(512, gt=0, description="P, projected output and token-embedding size")
    n_layers: int = Field(2, gt=0)
    cell_clip: float | None = Field(3.0, description="clip c to +-value; null turns it off")
    proj_clip: float | None = Field(3.0, description="clip projected h to +-value; null turns it off")
    use_skip_connections: bool = True

    @model_validator(mode="after")
    def _check_projection(self) -> LstmConfig:
        if self.projection_dim > self.dim:
            raise ValueError(f"projection_dim {self.projection_dim} must not exceed dim {self.dim}")
        return self

    @property
    def clipped(self) -> bool:
        return self.cell_clip is not None or self.proj_clip is not None


class ManyLangsConfig(_Strict):
    """ELMoForManyLangs' token layer (``docs/elmo-format.md`` §9): characters are ids of the model's ``char.dic`` (whole
    code points) and a word embedding from ``word.dic`` sits beside the char CNN, joined before the projection
    (which such a model always has). Absent for bilm-tf models, whose ``options.json`` never holds it."""

    n_characters: int = Field(gt=0, description="rows of the char table: char.dic's ids")
    n_words: int = Field(0, ge=0, description="rows of the word table: word.dic's ids (0: no word embedding)")
    word_dim: int = Field(0, ge=0, description="width of the word embedding (0: none)")

    @model_validator(mode="after")
    def _check_words(self) -> ManyLangsConfig:
        if (self.n_words == 0) != (self.word_dim == 0):
            raise ValueError(f"a word table has rows and a width: n_words {self.n_words}, word_dim {self.word_dim}")
        return self


class ModelConfig(_Strict):
    """The biLM architecture. Field names are bilm-tf's so ``options.json`` maps 1:1."""

    model_config = ConfigDict(extra="ignore", frozen=True)  # options.json may hold training keys

    char_cnn: CharCNNConfig = CharCNNConfig()
    lstm: LstmConfig = LstmConfig()
    n_tokens_vocab: int | None = Field(None, gt=0, description="softmax rows; None = no softmax")
    manylangs: ManyLangsConfig | None = None  # an ELMoForManyLangs model's token layer; None: bilm-tf's

    @model_validator(mode="after")
    def _check_projection(self) -> ModelConfig:
        if self.char_cnn.n_filters < self.lstm.projection_dim:
            raise ValueError(
                f"char CNN has {self.char_cnn.n_filters} filters, fewer than projection_dim "
                f"{self.lstm.projection_dim} (bilm-tf requires n_filters >= projection_dim)"
            )
        return self

    # ----- options.json ---------------------------------------------------------------------------
    @classmethod
    def from_options(cls, options: dict[str, Any], source: str = "options") -> ModelConfig:
        if "char_cnn" not in options:
            raise ConfigError(
                f"{source}: no 'char_cnn' section; word-input biLMs are not supported "
                "(every published ELMo reads characters)"
            )
        if "lstm" not in options:
            raise ConfigError(f"{source}: no 'lstm' section")
        try:
            return cls.model_validate(options)
        except ValidationError as exc:
            raise ConfigError(f"{source}: invalid options: {exc}") from None

    def to_options(self) -> dict[str, Any]:
        """The ``options.json`` dict that bilm-tf and AllenNLP load (``n_characters`` 262)."""
        options = self.model_dump(exclude_none=False)
        options["char_cnn"]["n_characters"] = N_CHARS
        if self.n_tokens_vocab is None:
            options.pop("n_tokens_vocab")
        if self.manylangs is None:
            options.pop("manylangs")
        return options


def read_options(path: str | Path) -> ModelConfig:
    """Load an ``options.json`` (bilm-tf / AllenNLP) into a ``ModelConfig``."""
    path = Path(path)
    try:
        options = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: options file not found") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg})") from None
    return ModelConfig.from_options(options, source=str(path))


def write_options(config: ModelConfig, path: str | Path) -> None:
    write_text_atomic(path, json.dumps(config.to_options(), indent=2) + "\n")


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML or JSON config file into a dict (stage configs validate it themselves)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: cannot parse: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, found {type(data).__name__}")
    return data


# ----- presets: the published sizes (allennlp.org names them {L}x{H}_{P}_{F}cnn_{k}xhighway) ---------

PresetName = Literal["tiny", "mini", "small", "medium", "original"]


def tiny() -> ModelConfig:
    """The fixture architecture (124 filters, 2x64_16): seconds on CPU, for tests."""
    return ModelConfig(
        char_cnn=CharCNNConfig(
            embedding=CharEmbeddingConfig(dim=4),
            filters=[[1, 4], [2, 8], [3, 16], [4, 32], [5, 64]],
            n_highway=2,
        ),
        lstm=LstmConfig(dim=64, projection_dim=16, n_layers=2),
    )


def mini() -> ModelConfig:
    """2x256_64_240cnn_1xhighway: the main job's CPU-sized model (learns the default corpus in minutes on 2 cores)."""
    return ModelConfig(
        char_cnn=CharCNNConfig(
            embedding=CharEmbeddingConfig(dim=8), filters=[[1, 16], [2, 32], [3, 64], [4, 128]], n_highway=1
        ),
        lstm=LstmConfig(dim=256, projection_dim=64, n_layers=2),
    )


def small() -> ModelConfig:
    """2x1024_128_2048cnn_1xhighway (13.6M parameters)."""
    return ModelConfig(
        char_cnn=CharCNNConfig(n_highway=1),
        lstm=LstmConfig(dim=1024, projection_dim=128, n_layers=2),
    )


def medium() -> ModelConfig:
    """2x2048_256_2048cnn_1xhighway (28.0M parameters)."""
    return ModelConfig(
        char_cnn=CharCNNConfig(n_highway=1),
        lstm=LstmConfig(dim=2048, projection_dim=256, n_layers=2),
    )


def original() -> ModelConfig:
    """2x4096_512_2048cnn_2xhighway (93.6M parameters): the Peters et al. (2018) model."""
    return ModelConfig(
        char_cnn=CharCNNConfig(n_highway=2),
        lstm=LstmConfig(dim=4096, projection_dim=512, n_layers=2),
    )


PRESETS: dict[str, Callable[[], ModelConfig]] = {
    "tiny": tiny,
    "mini": mini,
    "small": small,
    "medium": medium,
    "original": original,
}


def preset(name: PresetName) -> ModelConfig:
    try:
        return PRESETS[name]()
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; expected one of {sorted(PRESETS)}") from None


BUDGET_UNITS = {"s": 1, "m": 60, "h": 3600}


def budget_seconds(budget: str) -> float:
    """``30m``, ``2h``, ``90s`` or bare seconds ─► seconds."""
    text = budget.strip().lower()
    unit = BUDGET_UNITS.get(text[-1:], None)
    try:
        value = float(text[:-1] if unit else text) * (unit or 1)
    except ValueError:
        raise ValueError(f"budget {budget!r}: a number of seconds, or one followed by s, m or h (30m, 2h)") from None
    if value <= 0:
        raise ValueError(f"budget {budget!r}: must be more than nothing")
    return value


# ----- a model's files ------------------------------------------------------------------------------------

OPTIONS_NAME = "options.json"
WEIGHTS_NAME = "weights.hdf5"
VOCAB_NAME = "vocab.txt"


def resolve_model_files(
    options_or_dir: str | Path, weight_file: str | Path | None = None, vocab_file: str | Path | None = None
) -> tuple[Path, Path, Path | None]:
    """(options.json, weights.hdf5, vocab.txt or None) of a model directory, or of the files named."""
    source = Path(options_or_dir)
    if source.is_dir():
        options = source / OPTIONS_NAME
        if weight_file is None:
            candidates = [source / WEIGHTS_NAME, source / "lm_weights.hdf5"]
            weight_file = next((c for c in candidates if c.exists()), candidates[0])
        if vocab_file is None and (source / VOCAB_NAME).exists():
            vocab_file = source / VOCAB_NAME
    else:
        options = source
        if weight_file is None:
            raise WeightFileError(f"{source}: give the weight file too, or a model directory")
    return options, Path(weight_file), Path(vocab_file) if vocab_file is not None else None
