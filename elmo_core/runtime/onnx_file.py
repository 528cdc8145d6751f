"""A model reference as one ONNX file (``elmo onnx``): resolved as every command resolves a model (a folder, the
published files, ``models:/…``, ``runs:/…``), built by ``bilm.onnx_export``, and written whole: a temporary file
renamed into place, so a reader never finds half a file, and a full disk leaves nothing behind.

The file's metadata names the model exactly (``elmo.model``: ``models:/elmo/3`` where ``@champion`` was asked;
``elmo.model_id``: its files' hash; ``elmo.identity``: the whole identity as JSON), the exporter and the opset.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from elmo_core.bilm.model import BiLM
from elmo_core.bilm.onnx_export import OPSET, build
from elmo_core.errors import OutputError
from elmo_core.fileio import atomic_path, format_bytes, require_space
from elmo_core.options import OnnxConfig
from elmo_core.runtime.reference import ModelRef, resolve_model

log = logging.getLogger(__name__)


def _exporter(onnx_version: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        ours = version("elmo-pipeline")
    except PackageNotFoundError:  # run from a checkout that was never installed
        ours = "unknown"
    return f"elmo-pipeline {ours} (elmo_core.bilm.onnx_export), onnx {onnx_version}"


def parameter_bytes(bilm: BiLM) -> int:
    """The biLM's float32 parameters in bytes, the softmax left out (the exported graph has none)."""
    return sum(p.numel() * 4 for name, p in bilm.named_parameters() if not name.startswith("softmax"))


@dataclass(frozen=True)
class OnnxFile:
    path: Path
    model: ModelRef
    file_bytes: int
    parameter_bytes: int

    def line(self) -> str:
        ratio = self.file_bytes / max(self.parameter_bytes, 1)
        return (
            f"onnx: {self.model.exact} -> {self.path} ({format_bytes(self.file_bytes)}, {ratio:.3f}x its float32 "
            f"parameters; opset {OPSET}; input char_ids (batch, tokens, 50), outputs layers and mask)"
        )


def export_onnx(config: OnnxConfig) -> OnnxFile:
    """Write ``config.model`` as one ONNX file at ``config.out`` (module docstring); an existing file is refused
    unless ``overwrite``, in one line, before the model is read."""
    import onnx

    out = Path(config.out)
    if out.is_dir():
        raise OutputError(f"{out}: is a folder; --out takes the .onnx file to write")
    if out.exists() and not config.overwrite:
        raise OutputError(f"{out}: exists; give another --out, or --overwrite to replace it")
    ref = resolve_model(config.model)
    bilm = BiLM.from_pretrained(str(ref.options), str(ref.weights), vocab_file=str(ref.vocab) if ref.vocab else None)
    identity = ref.identity()
    metadata = {
        "elmo.model": ref.exact,
        "elmo.model_id": ref.model_id,
        "elmo.identity": json.dumps(identity, sort_keys=True),
        "elmo.exporter": _exporter(onnx.__version__),
    }
    model = build(bilm, metadata)
    out.parent.mkdir(parents=True, exist_ok=True)
    require_space(out.parent, model.ByteSize(), "the ONNX file")
    with atomic_path(out) as tmp:
        onnx.save(model, str(tmp))
    exported = OnnxFile(out, ref, out.stat().st_size, parameter_bytes(bilm))
    log.info("%s", exported.line())
    return exported
