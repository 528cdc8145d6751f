"""Dependencies point one way: flows → elmo_core; elmo_core never imports Prefect, and MLflow only in tracking; and
inside elmo_core every module imports only modules below it on the data path (no cycles, no lazy imports upward)."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# elmo_core from the bottom up: a module may import only modules listed before it.
LAYERS = [
    "errors",
    "cpu",
    "fileio",
    "progress",
    "precision",
    "ranks",  # plumbing
    "chars",
    "config",
    "tokenize",
    "wordnet",
    "options",
    "vocab_file",  # ids, the model config, WordNet's files, every stage's options
    "ingest",
    "vocab",
    "batches",
    "prefetch",  # text → Parquet → DuckDB vocab → batches, made ahead of the step
    "weights",
    "inference",
    "lstm_math",  # the reference LSTM arithmetic, shared by the kernels and the model
    "kernels",  # the CPU's speed kernels (inference, training), a package of their own (PACKAGES below)
    "packing",
    "model",
    "__init__",  # weight files, running over sentences, the network
    "softmax",
    "checkpoint",
    "tracking",
    "train",
    "launch",  # training, on one process or launched on several
    "embed",
    "probe",
    "ann",
    "query",
    "corpus",  # embeddings, the nearest-neighbour index, queries, the default corpus
    "mlflow_model",
    "allennlp",  # AllenNLP's ELMo surface on this project
    "cli",  # entry points
]


# inside the subpackages, bottom up likewise
PACKAGES = {
    "kernels": ["cache", "packed", "int8", "fused_gates", "trained_step", "char_cnn", "cells", "choice", "__init__"],
    "ingest": ["inputs", "readers", "shards", "manifest", "run", "__init__"],
    "allennlp": ["keys", "modules", "commands", "__init__"],
}


def _imported_modules(path: Path) -> set[str]:
    """elmo_core modules a file imports, at module level or inside functions."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.ImportFrom)
            and node.module
            and (node.module == "elmo_core" or node.module.startswith("elmo_core."))
        ):
            if node.module == "elmo_core":  # `from elmo_core import x`: a module, or the package's exports
                found |= {a.name if (ROOT / "elmo_core" / f"{a.name}.py").exists() else "__init__" for a in node.names}
            else:
                found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("elmo_core.")}
    return found


def _source(module: str) -> list[Path]:
    package = ROOT / "elmo_core" / module
    return sorted(package.glob("*.py")) if package.is_dir() else [ROOT / "elmo_core" / f"{module}.py"]


def test_every_module_has_a_layer():
    top = {p.stem for p in (ROOT / "elmo_core").glob("*.py")} | {
        p.parent.name for p in (ROOT / "elmo_core").glob("*/__init__.py")
    }
    assert sorted(top) == sorted(LAYERS)
    for package, modules in PACKAGES.items():
        assert sorted(p.stem for p in (ROOT / "elmo_core" / package).glob("*.py")) == sorted(modules)


def test_lower_modules_never_import_higher_ones():
    for module in LAYERS:
        allowed = set(LAYERS[: LAYERS.index(module)])
        for path in _source(module):
            upward = _imported_modules(path) - allowed - {module}
            assert not upward, f"{path.relative_to(ROOT)} imports {sorted(upward)}, which sit above it in LAYERS"


def test_inside_a_package_lower_modules_never_import_higher_ones():
    for package, modules in PACKAGES.items():
        prefix = f"elmo_core.{package}"
        for module in modules:
            allowed = set(modules[: modules.index(module)])
            for node in ast.walk(ast.parse((ROOT / "elmo_core" / package / f"{module}.py").read_text())):
                if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(prefix):
                    inner = node.module[len(prefix) + 1 :]
                    names = [inner.split(".")[0]] if inner else [a.name for a in node.names]
                    upward = set(names) - allowed - {module}
                    assert not upward, f"elmo_core/{package}/{module}.py imports {sorted(upward)}, above it"


def test_weights_never_builds_a_model():
    assert not _imported_modules(ROOT / "elmo_core" / "weights.py") & {"model", "inference", "__init__"}


def test_elmo_core_imports_without_prefect_or_mlflow():
    code = (
        "import sys, elmo_core, elmo_core.cli, elmo_core.train, elmo_core.embed, elmo_core.ingest, elmo_core.query, "
        "elmo_core.batches, elmo_core.tracking; bad = [m for m in ('prefect', 'mlflow', 'flows') if m in sys.modules]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_no_module_of_elmo_core_imports_flows_or_prefect():
    for path in (ROOT / "elmo_core").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            for name in names:
                assert not name.startswith(("flows", "prefect")), f"{path.name} imports {name}"
                if name.startswith("mlflow"):
                    assert path.name in {"tracking.py", "mlflow_model.py"}, f"{path.name} imports {name}"


def _modules_loaded_by(code: str) -> list[str]:
    probe = (
        f"import sys\n{code}\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('duckdb', 'pyarrow', 'prefect', 'mlflow', 'flows')"
        " or m in STAGES))"
    )
    stages = "STAGES = {'elmo_core.' + s for s in ('ingest', 'vocab', 'train', 'embed', 'probe', 'query', 'batches')}"
    result = subprocess.run(
        [sys.executable, "-c", stages + "\n" + probe], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return ast.literal_eval(result.stdout.strip().splitlines()[-1])


def test_the_model_imports_without_the_data_stack():
    """``from elmo_core import BiLM`` (and the kernels) load neither DuckDB, pyarrow, Prefect nor MLflow."""
    assert (
        _modules_loaded_by("import elmo_core\nfrom elmo_core import BiLM, batch_to_ids\nimport elmo_core.kernels") == []
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


def test_no_function_over_60_lines_no_class_over_200_and_the_model_under_700():
    """The sizes a reader can hold in mind (a long function is several steps that want names)."""
    too_long = []
    for path in [*(ROOT / "elmo_core").rglob("*.py"), *(ROOT / "flows").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            lines = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and lines > 60:
                too_long.append(f"{path.relative_to(ROOT)}: {node.name}() {lines} lines")
            if isinstance(node, ast.ClassDef) and lines > 200:
                too_long.append(f"{path.relative_to(ROOT)}: class {node.name} {lines} lines")
    assert not too_long
    assert len((ROOT / "elmo_core" / "model.py").read_text(encoding="utf-8").splitlines()) <= 700
