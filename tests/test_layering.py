"""Dependencies point one way: flows → elmo_core; elmo_core never imports Prefect, and MLflow only on use."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_elmo_core_imports_without_prefect_or_mlflow():
    code = ("import sys, elmo_core, elmo_core.cli, elmo_core.train, elmo_core.embed, elmo_core.ingest, elmo_core.query, "
            "elmo_core.batches, elmo_core.tracking; bad = [m for m in ('prefect', 'mlflow', 'flows') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_no_module_of_elmo_core_imports_flows_or_prefect():
    for path in (ROOT / "elmo_core").glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for name in names:
                assert not name.startswith(("flows", "prefect")), f"{path.name} imports {name}"
                if name.startswith("mlflow"):
                    assert path.name in {"tracking.py", "mlflow_model.py"}, f"{path.name} imports {name}"
