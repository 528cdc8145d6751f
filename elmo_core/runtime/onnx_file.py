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
from elmo_core.errors import ConfigError, OutputError
from elmo_core.fileio import atomic_folder, atomic_path, format_bytes, require_space
from elmo_core.options import OnnxConfig
from elmo_core.runtime.reference import REGISTERED, ModelRef, resolve_model

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
    input_width: int = 50  # a ManyLangs model's file takes its own rows: its chars, then the word

    def line(self) -> str:
        ratio = self.file_bytes / max(self.parameter_bytes, 1)
        return (
            f"onnx: {self.model.exact} -> {self.path} ({format_bytes(self.file_bytes)}, {ratio:.3f}x its float32 "
            f"parameters; opset {OPSET}; input char_ids (batch, tokens, {self.input_width}), outputs layers and mask)"
        )


def _target(config: OnnxConfig, name: str | None) -> tuple[Path, Path | None]:
    """(the .onnx file, the Triton model folder or None), refused in one line before the model is read: neither
    asked for, a folder where the file goes, something already there (without ``overwrite``)."""
    if (config.out is None) == (config.triton is None):
        raise ConfigError("give --out FILE.onnx, or --triton DIR (a Triton model repository), not both")
    if config.triton is not None:
        folder = Path(config.triton) / (name or "elmo")
        if folder.exists() and not config.overwrite:
            raise OutputError(f"{folder}: exists; give another --triton DIR, or --overwrite to replace it")
        return folder / "1" / "model.onnx", folder
    out = Path(config.out)  # type: ignore[arg-type]
    if out.is_dir():
        raise OutputError(f"{out}: is a folder; --out takes the .onnx file to write")
    if out.exists() and not config.overwrite:
        raise OutputError(f"{out}: exists; give another --out, or --overwrite to replace it")
    return out, None


def export_onnx(config: OnnxConfig) -> OnnxFile:
    """Write ``config.model`` as one ONNX file at ``config.out``, or as a Triton model repository's model
    (``config.triton``: ``DIR/NAME/config.pbtxt`` and ``DIR/NAME/1/model.onnx``, NAME the registered name or
    ``elmo``), written whole (module docstring)."""
    import onnx

    registered = REGISTERED.match(config.model)
    out, triton = _target(config, registered["name"] if registered else None)
    ref = resolve_model(config.model)
    if ref.onnx:
        raise ConfigError(f"{config.model}: already an ONNX file; export the model it came from ({ref.exported_from})")
    bilm = BiLM.from_pretrained(str(ref.options), str(ref.weights), vocab_file=str(ref.vocab) if ref.vocab else None)
    metadata = {
        "elmo.model": ref.exact,
        "elmo.model_id": ref.model_id,
        "elmo.identity": json.dumps(ref.identity(), sort_keys=True),
        "elmo.exporter": _exporter(onnx.__version__),
    }
    model = build(bilm, metadata, batch_first=triton is not None)
    require_space(out.parent, model.ByteSize(), "the ONNX file")
    if triton is None:
        out.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(out) as tmp:
            onnx.save(model, str(tmp))
    else:
        with atomic_folder(triton) as tmp:
            (tmp / "1").mkdir()
            onnx.save(model, str(tmp / "1" / "model.onnx"))
            (tmp / "config.pbtxt").write_text(triton_config(triton.name, bilm, ref))
    width = int(bilm.boundary_char_ids.shape[-1])
    exported = OnnxFile(out, ref, out.stat().st_size, parameter_bytes(bilm), width)
    log.info("%s", exported.line())
    return exported


MAX_BATCH_SIZE = 64  # sentences Triton may gather into one run; past it a request waits for the next


def triton_config(name: str, bilm: BiLM, ref: ModelRef) -> str:
    """``config.pbtxt`` for Triton's onnxruntime backend: the tensors without their batch dimension (Triton adds
    it), dynamic batching, and the model's identity as parameters. Requests are batched together only where their
    shapes agree: a client that pads its sentences to a few lengths (padding rows are all zeros; they change no
    other number) lets Triton batch more of them."""
    cfg = bilm.config
    chars, layers, width = cfg.char_cnn.max_characters_per_token, cfg.lstm.n_layers + 1, 2 * cfg.lstm.projection_dim
    return f"""name: "{name}"
backend: "onnxruntime"
max_batch_size: {MAX_BATCH_SIZE}
input [
  {{
    name: "char_ids"
    data_type: TYPE_INT64
    dims: [ -1, {chars} ]
  }}
]
output [
  {{
    name: "layers"
    data_type: TYPE_FP32
    dims: [ {layers}, -1, {width} ]
  }},
  {{
    name: "mask"
    data_type: TYPE_INT64
    dims: [ -1 ]
  }}
]
dynamic_batching {{
  max_queue_delay_microseconds: 2000
}}
parameters {{
  key: "elmo.model"
  value: {{ string_value: "{ref.exact}" }}
}}
parameters {{
  key: "elmo.model_id"
  value: {{ string_value: "{ref.model_id}" }}
}}
"""


def write_beside(bilm: BiLM, model_dir: Path) -> Path | None:
    """``MODEL_DIR.onnx`` beside a training's exported folder, for its MLflow model to carry (``tracking``); None
    where onnx is not installed (the extra ``onnx``). Its metadata names the folder and its content's id: the
    registered version is not known yet (``elmo onnx models:/NAME/N`` names it)."""
    try:
        import onnx
    except ImportError:
        log.info("onnx is not installed: the MLflow model carries no ONNX file (pip install elmo-pipeline[onnx])")
        return None
    ref = resolve_model(str(model_dir))
    metadata = {"elmo.model": ref.exact, "elmo.model_id": ref.model_id, "elmo.exporter": _exporter(onnx.__version__)}
    out = model_dir.with_suffix(".onnx")
    with atomic_path(out) as tmp:
        onnx.save(build(bilm, metadata), str(tmp))
    return out
