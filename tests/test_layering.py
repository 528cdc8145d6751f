"""Dependencies point one way: flows → elmo_core; elmo_core never imports Prefect, and MLflow only in tracking; and
inside elmo_core every module imports only modules below it on the data path (no cycles, no lazy imports upward)."""

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# elmo_core from the bottom up, in rooms (a module or a package): a room may import only rooms listed before it,
# and inside a package (ROOMS below) likewise; what sits below the package is open to all of it.
LAYERS = [
    "errors",
    "defaults",  # one default per runtime decision (torch-free)
    "cpu",
    "heap",  # this process's C heap: large buffers reused
    "word_rows",  # rows kept by word, least recently used dropped first (both word caches' rule, torch-free)
    "fileio",
    "progress",
    "precision",
    "ranks",
    "tracking",  # plumbing; tracking: MLflow behind a small interface (runs, model URIs)
    "events",  # Prefect behind one function: a promotion announced
    "text",  # text and character ids
    "config",
    "options",
    "stage",  # the model config and presets, every stage's options, the stage protocol and its local runner
    "flags",  # a stage's options as command-line flags
    "ingest",
    "data",  # text → Parquet → DuckDB vocab → batches
    "bilm",
    "__init__",  # the network: weights, running over sentences, kernels, the model (the package exports it)
    "runtime",  # how a model runs in a process: reference, placement, output, the engine
    "train",  # training, on one process or launched on several
    "vectors",  # embeddings, the nearest-neighbour index, queries, probes
    "allennlp",  # AllenNLP's ELMo surface on this project
    "serve",  # vectors on request over HTTP
    "cli",  # entry points
]

# inside the packages, bottom up likewise
ROOMS = {
    "text": ["chars", "manylangs_chars", "tokenize", "wordnet", "vocab_file", "corpus", "__init__"],
    "ingest": ["inputs", "readers", "shards", "manifest", "run", "__init__"],
    "data": ["vocab", "batches", "prefetch", "__init__"],
    "bilm": [
        *("weights", "manylangs", "inference", "lstm_math", "kernels", "packing", "lstm", "model", "scalar_mix"),
        *("initialization", "softmax", "fine_tune", "onnx_export", "__init__"),
    ],
    "bilm.kernels": [
        *("switches", "cache", "packed", "int8", "fused_gates", "step_loop", "trained_step", "char_cnn", "cells"),
        *("cuda_graphs", "layer_steps", "choice", "__init__"),
    ],
    "train": [
        *("lineage", "checkpoint", "budget", "objective", "evaluate", "export", "ddp", "recipe", "plan", "run"),
        "loop",
        "promote",
        "launch",
        "mlflow_model",
        "__init__",
    ],
    "runtime": ["reference", "placement", "output", "engine", "info", "onnx_file", "__init__"],
    # the index (ann): a part of an embedding job
    "vectors": ["ann", "sources", "unit_file", "embed", "tables", "probe", "demo", "query", "__init__"],
    "vectors.ann": ["files", "table", "build", "search", "__init__"],
    "allennlp": ["keys", "modules", "commands", "__init__"],
    "serve": [
        *("api", "encode", "compute", "onnx_compute", "workers", "versions", "metrics", "middleware", "batcher"),
        *("app", "run", "__init__"),
    ],
}


def _exists(dotted: str) -> bool:
    path = ROOT / "elmo_core" / dotted.replace(".", "/")
    return path.is_dir() or path.with_suffix(".py").exists()


def _room_of(path: Path) -> tuple[str, ...]:
    """``elmo_core/bilm/kernels/choice.py`` → ("bilm", "kernels", "choice"); a package's ``__init__`` keeps it."""
    return path.relative_to(ROOT / "elmo_core").with_suffix("").parts


def _targets(path: Path) -> set[tuple[str, ...]]:
    """The elmo_core rooms a file imports (at module level or inside functions), as paths below elmo_core; a
    package's own ``__init__`` is the package's path plus "__init__"."""
    found: set[tuple[str, ...]] = set()

    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "elmo_core":
            for alias in node.names:
                dotted = f"{node.module}.{alias.name}"
                sub = ".".join(dotted.split(".")[1:])
                if _exists(sub):  # a module or package imported by name
                    found.add(tuple(sub.split(".")))
                else:  # a name from a module, or from a package's __init__
                    module = tuple(node.module.split(".")[1:])
                    package = (ROOT / "elmo_core" / "/".join(module)).is_dir()
                    found.add((*module, "__init__") if package else module)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("elmo_core."):
                    found.add(tuple(alias.name.split(".")[1:]))
    return found


def _order(package: tuple[str, ...]) -> list[str]:
    return LAYERS if not package else ROOMS[".".join(package)]


def _upward(path: Path) -> list[str]:
    """Imports of ``path`` that reach a room at or above its own, inside the first package they share."""
    room, bad = _room_of(path), []
    for target in _targets(path):
        shared = 0
        while shared < min(len(room), len(target)) and room[shared] == target[shared]:
            shared += 1
        if shared == len(target) or shared == len(room):  # itself, or its own package
            continue
        order = _order(room[:shared])
        if order.index(target[shared]) >= order.index(room[shared]):
            bad.append(".".join(target))
    return sorted(bad)


def test_every_module_has_a_room():
    for package in ["", *ROOMS]:
        folder = ROOT / "elmo_core" / package.replace(".", "/")
        present = {p.stem for p in folder.glob("*.py")} | {p.parent.name for p in folder.glob("*/__init__.py")}
        assert sorted(present) == sorted(_order(tuple(package.split(".")) if package else ())), package or "elmo_core"


def test_lower_rooms_never_import_higher_ones():
    for path in sorted((ROOT / "elmo_core").rglob("*.py")):
        upward = _upward(path)
        assert not upward, f"{path.relative_to(ROOT)} imports {upward}, which sit at or above it in LAYERS/ROOMS"


def test_the_layering_check_sees_an_upward_import(tmp_path):
    """The check itself: a model module importing the trainer, or the kernels importing the model, is caught."""
    bad = ROOT / "elmo_core" / "bilm" / "kernels" / "_probe_upward.py"
    try:
        bad.write_text("from elmo_core.bilm import model\nfrom elmo_core.train import loop\n")
        ROOMS["bilm.kernels"].insert(0, "_probe_upward")
        assert _upward(bad) == ["bilm.model", "train.loop"]
    finally:
        ROOMS["bilm.kernels"].remove("_probe_upward")
        bad.unlink()


def test_weights_never_builds_a_model():
    imported = {".".join(t) for t in _targets(ROOT / "elmo_core" / "bilm" / "weights.py")}
    assert not imported & {"bilm.model", "bilm.inference", "__init__"}


def test_elmo_core_imports_without_prefect_or_mlflow():
    modules = "elmo_core, elmo_core.cli, elmo_core.train.loop, elmo_core.vectors.embed, elmo_core.vectors.query"
    code = (
        f"import sys, {modules}, elmo_core.ingest, elmo_core.data.batches, elmo_core.tracking, elmo_core.stage; "
        "bad = [m for m in ('prefect', 'mlflow', 'flows') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def _import_names(node: ast.AST) -> list[str]:
    """The modules an import statement names (none for any other node)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    return [node.module or ""] if isinstance(node, ast.ImportFrom) else []


def test_no_module_of_elmo_core_imports_flows_or_prefect():
    """Nor Prefect, but for the one function that announces a promotion (``events.py``), inside it: the library
    imports without Prefect as without MLflow."""
    for path in (ROOT / "elmo_core").rglob("*.py"):
        tree = ast.parse(path.read_text())
        top = {id(node) for node in tree.body}
        for node in ast.walk(tree):
            names = _import_names(node)
            for name in names:
                assert not name.startswith("flows"), f"{path.name} imports {name}"
                if name.startswith("prefect"):
                    assert path.name == "events.py" and id(node) not in top, f"{path.name} imports {name}"
                if name.startswith("mlflow"):
                    assert path.name in {"tracking.py", "mlflow_model.py"}, f"{path.name} imports {name}"


def _modules_loaded_by(code: str) -> list[str]:
    probe = (
        f"import sys\n{code}\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('duckdb', 'pyarrow', 'prefect', 'mlflow', 'flows')"
        " or m in STAGES))"
    )
    rooms = "('ingest', 'data.vocab', 'train.loop', 'vectors.embed', 'vectors.probe', 'vectors.query', 'data.batches')"
    stages = f"STAGES = {{'elmo_core.' + s for s in {rooms}}}"
    result = subprocess.run(
        [sys.executable, "-c", stages + "\n" + probe], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return ast.literal_eval(result.stdout.strip().splitlines()[-1])


def test_the_model_imports_without_the_data_stack():
    """``from elmo_core import BiLM`` (and the kernels) load neither DuckDB, pyarrow, Prefect nor MLflow."""
    assert (
        _modules_loaded_by("import elmo_core\nfrom elmo_core import BiLM, batch_to_ids\nimport elmo_core.bilm.kernels")
        == []
    )


def test_the_allennlp_drop_in_imports_without_the_data_stack():
    assert (
        _modules_loaded_by("import elmo_core.allennlp\nelmo_core.allennlp.install()\nimport allennlp.modules.elmo")
        == []
    )


def test_elmo_help_imports_no_stage_module():
    code = "import elmo_core.cli as cli\ntry:\n    cli.main(['--help'])\nexcept SystemExit:\n    pass"
    loaded = _modules_loaded_by(code)
    assert not [m for m in loaded if m.startswith(("elmo_core.", "duckdb", "prefect", "mlflow"))], loaded


def test_no_file_over_600_lines_no_function_over_60_no_class_over_200():
    """The sizes a reader can hold in mind (a long function is several steps that want names; a long file, several
    rooms)."""
    too_long = []
    for path in [*(ROOT / "elmo_core").rglob("*.py"), *(ROOT / "flows").rglob("*.py")]:
        text = path.read_text(encoding="utf-8")
        if len(text.splitlines()) > 600:
            too_long.append(f"{path.relative_to(ROOT)}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            lines = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and lines > 60:
                too_long.append(f"{path.relative_to(ROOT)}: {node.name}() {lines} lines")
            if isinstance(node, ast.ClassDef) and lines > 200:
                too_long.append(f"{path.relative_to(ROOT)}: class {node.name} {lines} lines")
    assert not too_long


RUNNERS = [ROOT / "elmo_core" / "cli.py", *sorted((ROOT / "flows").glob("*.py"))]
COMPUTE = {"torch", "faiss", "numpy", "duckdb", "pyarrow", "h5py"}
SQL = re.compile(r"\b(SELECT|INSERT|CREATE\s+(TABLE|VIEW))\b", re.IGNORECASE)


def _runner_breaches(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = _import_names(node)
        found += [f"imports {n}" for n in names if n.split(".")[0] in COMPUTE]
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and SQL.search(node.value):
            found.append(f"SQL {node.value[:40]!r}")
    return found


def test_the_runners_hold_no_compute_and_no_sql():
    """The CLI and the flows run the core's stages and print or publish what they return: no torch, faiss, numpy,
    DuckDB or pyarrow of their own, and no SQL (the core owns its tables' queries)."""
    breaches = {str(p.relative_to(ROOT)): b for p in RUNNERS if (b := _runner_breaches(p))}
    assert not breaches


def test_the_runner_check_sees_torch_and_sql(tmp_path):
    probe = tmp_path / "runner.py"
    probe.write_text('import torch\nQUERY = "SELECT token FROM emb"\n')
    assert _runner_breaches(probe) == ["imports torch", "SQL 'SELECT token FROM emb'"]


def test_the_flows_let_prefect_read_their_annotations():
    """Prefect reads a flow's parameter annotations at run time: no flow module defers them."""
    deferred = [p.name for p in RUNNERS if "from __future__ import annotations" in p.read_text(encoding="utf-8")]
    assert deferred in ([], ["cli.py"])
