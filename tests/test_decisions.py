"""Each decision about how a model runs is made in one room: the model a reference names, the device, the precision,
the threads, the token budget and the kernels. A scan of ``elmo_core/`` and ``flows/`` finds every call of a
function that makes one of them, every environment variable that switches one, and every default written for one,
outside the places allowed; a planted stray of each kind is caught. The test prints, per decision, the rooms that
make it: one each.

What "making a decision" means here: calling the function that decides it. ``runtime/`` calls them (that is its
job); a few modules define them or probe a capability they rest on, and are named below with why."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# decision -> {the function that makes it: the modules besides runtime/ that may call it (why, in a comment)}
DECISIONS: dict[str, dict[str, set[str]]] = {
    "model": {
        "lookup_model": {  # a plan's lookup: the registry, the folder, the cache read, nothing written
            "vectors/embed.py",  # the embedding job's plan; the claim fetches what is not here (ModelLookup.fetch)
            "vectors/probe.py",  # the probe's plan line; its model is pinned first (ProbeStage.settle)
            "train/plan.py",  # the fine-tuned model's shape, of the pinned init_from
            "train/evaluate.py",  # elmo perplexity's plan
            "vectors/tables.py",  # a refresh's plan: the version pinned, its table's folder named
        },
        "resolve_model": {  # the files, fetched where they are not here: work, under a claim
            "train/loop.py",  # the pinned init_from's files, in each rank
            "serve/run.py",  # the server's HTTP process, once at start and once per reload (serve/versions.py)
        },
        "pin_reference": {  # settle(); a refresh asks which version an alias names now, in its plan and its switch
            *("vectors/probe.py", "train/launch.py", "train/evaluate.py", "train/promote.py", "vectors/tables.py"),
        },
        "registered_version": {"train/promote.py"},  # tracking.py's: the runtime's lookup; a promotion reads runs
        "download_model": set(),
    },
    "device": {
        "pick_device": set(),  # precision.py's; runtime.place is its one caller
        "place": {
            "vectors/embed.py",  # the embedding job's plan
            "train/plan.py",  # the training plan
            "train/loop.py",  # a rank's device before its process group starts
            "train/launch.py",  # whether the launched ranks share the CPU's cores
            "vectors/probe.py",  # the probe's plan
            "train/evaluate.py",  # elmo perplexity's plan
        },
        "device_count": set(),  # runtime.placement.visible_gpus
        "is_available": {
            "precision.py",  # pick_device and native_bf16: the capabilities the decision reads
            "bilm/kernels/cuda_graphs.py",  # a kernel's own "can I run here"
            "bilm/kernels/packed.py",  # torch.backends.mkldnn.is_available, likewise
        },
    },
    "precision": {
        "resolve_precision": {  # precision.py's; runtime.place calls it
            "bilm/model.py",  # the model's own API (prepare("bf16")) takes a name: resolved once, then the chooser
        },
        "int8_engine": {"precision.py", "bilm/kernels/int8.py", "bilm/kernels/choice.py"},  # one cached choice, read
    },
    "threads": {
        "set_num_threads": {"cpu.py"},  # apply_thread_share, which runtime.take_threads calls
        "apply_thread_share": set(),  # cpu.py's; runtime.take_threads calls it
        "worker_env": {  # the share of the cores, decided by cpu.worker_env; the starters hand it to what they start
            "stage.py",
            "serve/workers.py",
            "train/launch.py",
            "flows/embed.py",
        },
        "omp_set_num_threads": {"vectors/ann/build.py"},  # faiss takes the share its process was given
    },
    "token budget": {
        "token_budget": set(),  # runtime.engine: the CPU's 8,192 or a GPU's share of its memory
        "cuda_budget": set(),
    },
    "kernels": {
        "choose": {"bilm/model.py"},  # BiLM.prepare, which the runtime calls once
        "choose_training": {"bilm/model.py"},  # prepare_training, as the run starts (a plan only reads)
    },
}

# an environment variable that switches a decision: the one module that reads it
ENVIRONMENT = {
    "ELMO_NO_PACKED_WEIGHTS": "bilm/kernels/switches.py",
    "ELMO_NO_FUSED_GATES": "bilm/kernels/switches.py",
    "ELMO_NO_STEP_LOOP": "bilm/kernels/switches.py",
    "ELMO_NO_LAYER_STEPS": "bilm/kernels/switches.py",
    "ELMO_NO_COMPILE": "bilm/kernels/switches.py",
    "ELMO_NO_CUDA_GRAPHS": "bilm/kernels/switches.py",
    "ELMO_CACHE_DIR": "fileio.py",
    "ELMO_CPU_ISA": "cpu.py",
    "ELMO_TORCH_THREADS": "cpu.py",
    "ELMO_ALLOW_EMULATED_BF16": "precision.py",
    "CUDA_VISIBLE_DEVICES": "runtime/placement.py",
    "ONEDNN_MAX_CPU_ISA": "precision.py",
}

DEFAULTED = ("precision", "device")  # parameters and fields whose default is one of defaults.py's, never a literal
DEFAULT_EXCEPTIONS = {
    ("bilm/model.py", "device"),
    ("allennlp/modules.py", "device"),
}  # a torch module starts on the CPU


def _called(node: ast.Call) -> str:
    f = node.func
    return f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")


def _env_names(node: ast.AST, constants: dict[str, str]) -> list[str]:
    """Environment variables read at ``node``: os.environ.get(X), os.getenv(X), os.environ[X]; X a string or a
    module constant naming one."""

    def name_of(arg: ast.AST) -> str | None:
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            return arg.value
        if isinstance(arg, ast.Name):
            return constants.get(arg.id)
        return None

    found = []
    if isinstance(node, ast.Call) and node.args:
        f = node.func
        reads = isinstance(f, ast.Attribute) and (
            (f.attr == "get" and isinstance(f.value, ast.Attribute) and f.value.attr == "environ") or f.attr == "getenv"
        )
        if reads and (name := name_of(node.args[0])):
            found.append(name)
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "environ":
        if isinstance(node.ctx, ast.Load) and (name := name_of(node.slice)):
            found.append(name)
    return found


def _constants(tree: ast.Module) -> dict[str, str]:
    """Module-level NAME = "string" (an environment variable's name kept as a constant)."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    out[target.id] = node.value.value
    return out


def _literal_defaults(tree: ast.Module) -> list[tuple[str, str]]:
    """(name, value) of every ``precision``/``device`` parameter or pydantic field given a string literal default."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            positional = args.posonlyargs + args.args
            pairs = list(zip(positional[len(positional) - len(args.defaults) :], args.defaults))
            pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
            found += [
                (a.arg, d.value)
                for a, d in pairs
                if a.arg in DEFAULTED and isinstance(d, ast.Constant) and isinstance(d.value, str)
            ]
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id in DEFAULTED:
            value = node.value
            if isinstance(value, ast.Call) and _called(value) == "Field" and value.args:
                value = value.args[0]
            if isinstance(value, ast.Constant) and isinstance(value.value, str) and value.value:
                found.append((node.target.id, value.value))
    return found


def scan(roots: dict[str, Path]) -> tuple[list[str], dict[str, set[str]], dict[str, set[str]]]:
    """Over ``roots`` (prefix: folder): the strays found; per decision the rooms that decide it (runtime/, and any
    stray), and the rooms allowed to ask for it (they call the deciding function with what the runtime gave them)."""
    allowed = {fn: where for calls in DECISIONS.values() for fn, where in calls.items()}
    decision_of = {fn: decision for decision, calls in DECISIONS.items() for fn in calls}
    strays: list[str] = []
    makers: dict[str, set[str]] = {decision: set() for decision in DECISIONS}
    deciders: dict[str, set[str]] = {decision: {"runtime/"} for decision in DECISIONS}
    calls: set[tuple[str, str]] = set()
    for prefix, root in roots.items():
        for path in sorted(root.rglob("*.py")):
            where = prefix + path.relative_to(root).as_posix()
            tree = ast.parse(path.read_text(encoding="utf-8"))
            constants = _constants(tree)
            for node in ast.walk(tree):
                for name in _env_names(node, constants):
                    if name in ENVIRONMENT and ENVIRONMENT[name] != where:
                        strays.append(f"{where} reads {name} (only {ENVIRONMENT[name]} does)")
                if not isinstance(node, ast.Call):
                    continue
                name = _called(node)
                if name == "from_pretrained":  # a model loaded, then prepared: the runtime's (and the model's own)
                    owner = getattr(node.func, "value", None)
                    if getattr(owner, "id", "") in ("BiLM", "cls") and not where.startswith("runtime/"):
                        if where not in ("bilm/model.py", "train/loop.py"):  # a fine-tune's start, of a pinned model
                            strays.append(f"{where} calls from_pretrained")
                if name not in allowed or where.startswith("runtime/"):
                    continue
                if where in allowed[name]:
                    makers[decision_of[name]].add(where)
                    calls.add((name, where))
                else:
                    strays.append(f"{where} calls {name}")
                    deciders[decision_of[name]].add(where)
            for field, value in _literal_defaults(tree):
                if (where, field) not in DEFAULT_EXCEPTIONS:
                    strays.append(f"{where} writes {field}={value!r} as a default (defaults.py has it)")
    scanned = set(roots) == {"", "flows/"} and all(r.name in ("elmo_core", "flows") for r in roots.values())
    for name, where in ((n, w) for n, ws in allowed.items() for w in ws) if scanned else ():
        if (name, where) not in calls:  # the list says who asks; one that no longer does is taken off it
            strays.append(f"DECISIONS lists {where} for {name}, which it no longer calls")
    return sorted(set(strays)), deciders, makers


def test_every_decision_is_made_in_one_room(capsys: pytest.CaptureFixture[str]) -> None:
    strays, deciders, askers = scan({"": ROOT / "elmo_core", "flows/": ROOT / "flows"})
    with capsys.disabled():
        print()
        for decision, rooms in deciders.items():
            print(f"{decision:<13} decided in {len(rooms)} place(s): {', '.join(sorted(rooms))}", end="; ")
            print(f"asked of it by {len(askers[decision])} (listed in DECISIONS, with why)")
    assert strays == []
    assert all(len(rooms) == 1 for rooms in deciders.values())


def test_the_scan_catches_a_planted_stray_of_each_kind(tmp_path: Path) -> None:
    """A copy of the embedding stage and a flow that decide for themselves: each decision, an environment switch
    read outside its module, and a default written as a literal."""
    (tmp_path / "core" / "vectors").mkdir(parents=True)
    (tmp_path / "flows").mkdir()
    (tmp_path / "core" / "vectors" / "embed.py").write_text(
        "import os\nimport torch\nfrom elmo_core.precision import resolve_precision\n"
        "from elmo_core.runtime.engine import token_budget\nfrom elmo_core.bilm.kernels import choose\n"
        "p = resolve_precision('auto', 'cpu')\ntorch.set_num_threads(2)\nn = torch.cuda.device_count()\n"
        "budget = token_budget(torch.device('cpu'), None)\nk = choose(torch.device('cpu'), p, None)\n"
        "SWITCH = 'ELMO_NO_FUSED_GATES'\noff = os.environ.get(SWITCH) == '1'\n"
        "def run(model, precision='bf16'): ...\n"
    )
    (tmp_path / "flows" / "embed.py").write_text(
        "import torch\nfrom elmo_core.runtime.reference import resolve_model\n"
        "m = resolve_model('models:/elmo/latest')\nok = torch.cuda.is_available()\n"
    )
    strays, deciders, _ = scan({"": tmp_path / "core", "flows/": tmp_path / "flows"})
    assert deciders["precision"] == {"runtime/", "vectors/embed.py"} and deciders["model"] == {
        "runtime/",
        "flows/embed.py",
    }
    assert strays == [
        "flows/embed.py calls is_available",
        "flows/embed.py calls resolve_model",
        "vectors/embed.py calls choose",
        "vectors/embed.py calls device_count",
        "vectors/embed.py calls resolve_precision",
        "vectors/embed.py calls set_num_threads",
        "vectors/embed.py calls token_budget",
        "vectors/embed.py reads ELMO_NO_FUSED_GATES (only bilm/kernels/switches.py does)",
        "vectors/embed.py writes precision='bf16' as a default (defaults.py has it)",
    ]


def test_every_options_model_defaults_to_the_shared_defaults() -> None:
    """Every stage's options take the device and precision defaults from ``defaults.py``: change one there and every
    command, flow and config follows."""
    from pydantic import BaseModel

    from elmo_core import defaults, options

    models = [m for m in vars(options).values() if isinstance(m, type) and issubclass(m, BaseModel)]
    seen = 0
    for model in models:
        for name, field in model.model_fields.items():
            if name == "device":
                assert field.default == defaults.DEFAULT_DEVICE, model.__name__
                seen += 1
            elif name == "precision":
                want = (
                    defaults.DEFAULT_TRAINING_PRECISION
                    if "Train" in model.__name__
                    else defaults.DEFAULT_INFERENCE_PRECISION
                )
                assert field.default == want, model.__name__
                seen += 1
    assert seen >= 8
