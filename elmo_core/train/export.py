"""A training run ─► a bilm-tf/AllenNLP model directory (options.json, weights.hdf5 with its softmax, vocab.txt):
its newest valid checkpoint, or the best weights where it trained with ``export: best``.

A checkpoint's model directory is complete or absent (``bilm.weights.write_model_files``): refused in one line before
the first byte where it does not fit, written beside the target and renamed into place, and what an export that died
left there is removed by the next."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from torch import Tensor

from elmo_core.bilm.manylangs import convert_release, is_release
from elmo_core.bilm.model import BiLM
from elmo_core.config import ModelConfig
from elmo_core.data.vocab import VOCAB_NAME_IN_DATA, read_vocab_file
from elmo_core.errors import CheckpointError
from elmo_core.options import ExportConfig, TrainConfig, validate
from elmo_core.stage import WholeStage
from elmo_core.text.manylangs_chars import Dictionaries
from elmo_core.train.checkpoint import (
    BestWeights,
    Checkpoint,
    checkpoint_dir,
    list_checkpoints,
    load_checkpoint,
    load_newest_valid,
)


def latest_checkpoint(out: str | Path) -> Path | None:
    """The newest checkpoint file of a run folder (not verified; see ``checkpoint.load_newest_valid``)."""
    found = list_checkpoints(out)
    return found[-1] if found else None


@dataclass(frozen=True)
class Exported:
    """What an export wrote: the step and file its weights came from (a release: step 0, the folder) and the
    model folder, whose files its line names as they are on disk."""

    step: int
    source: Path
    out: Path
    release: bool = False

    def line(self) -> str:
        files = ", ".join(sorted(p.name for p in self.out.iterdir()))
        what = f"the ELMoForManyLangs release {self.source}" if self.release else f"step {self.step} of {self.source}"
        return f"export: {what} -> {self.out} ({files})"


def export_checkpoint(checkpoint_or_run: str | Path, out: str | Path) -> Exported:
    """A checkpoint (or a run folder: its newest valid checkpoint, or with ``export: best`` its best weights, as the
    run itself exports) ─► a bilm-tf/AllenNLP model directory; a fine-tuned ELMoForManyLangs model's keeps its
    dictionaries, as the checkpoint holds them.

    A released ELMoForManyLangs folder is converted instead (step 0): a model directory that keeps its char.dic and
    word.dic (``bilm.manylangs.convert_release``), ready for MLflow."""
    source = Path(checkpoint_or_run)
    if is_release(source):
        convert_release(source, out)
        return Exported(0, source, Path(out), release=True)
    if source.is_dir():
        found = load_newest_valid(source)
        if found is None:
            raise CheckpointError(f"{source}: no checkpoint in {checkpoint_dir(source)}")
        path, payload = found
    else:
        path, payload = source, load_checkpoint(source)
    checkpoint = Checkpoint.from_payload(payload)
    config = validate(TrainConfig, json.loads(checkpoint.config), source=str(path))
    step, weights = checkpoint.step, checkpoint.model
    best = BestWeights.on_disk(source, checkpoint.step) if source.is_dir() and config.export == "best" else None
    if best is not None:
        path, step, weights = best[0], best[1]["step"], best[1]["model"]
    vocab = read_vocab_file(Path(config.data) / VOCAB_NAME_IN_DATA)
    bilm = _built_as_trained(checkpoint, config, weights, vocab, path)
    bilm.save_pretrained(str(out))
    return Exported(step, path, Path(out))


def _built_as_trained(
    checkpoint: Checkpoint, config: TrainConfig, weights: dict[str, Tensor], vocab: list[str], path: Path
) -> BiLM:
    """The biLM as the run built it (the checkpoint's architecture and dictionaries; a checkpoint written before
    they were kept: the TrainConfig's architecture), holding ``weights``."""
    if checkpoint.architecture:
        architecture = ModelConfig.model_validate_json(checkpoint.architecture)
    else:
        architecture = config.architecture(weights["softmax.weight"].shape[0])
    dics = Dictionaries.from_state(checkpoint.dictionaries, str(path)) if checkpoint.dictionaries else None
    bilm = BiLM(architecture, vocab=vocab, dics=dics)
    try:
        bilm.load_state_dict(weights)
    except RuntimeError as exc:
        raise CheckpointError(
            f"{path}: its weights do not fit the model it describes ({str(exc).splitlines()[0][:160]}); "
            "export the run's own model folder instead"
        ) from None
    return bilm


class ExportStage(WholeStage):
    """Export as a stage, one unit: ``Exported`` (the step, the file or release it came from, the folder)."""

    name = "export"

    def decide(self, config: ExportConfig) -> list[str]:
        """Which checkpoint would be exported (the newest on disk, verified when the work reads it)."""
        source = Path(config.checkpoint or config.run)  # type: ignore[arg-type]
        if is_release(source):
            return [f"convert the ELMoForManyLangs release {source} -> {config.out} (its char.dic and word.dic kept)"]
        newest = latest_checkpoint(source) if source.is_dir() else source
        if newest is None:
            raise CheckpointError(f"{source}: no checkpoint in {checkpoint_dir(source)}")
        best = " (or its best weights, where it trained with export: best)" if source.is_dir() else ""
        return [f"export {newest}{best} -> {config.out}"]

    def work(self, config: ExportConfig) -> Exported:
        return export_checkpoint(config.checkpoint or config.run, config.out)  # type: ignore[arg-type]
