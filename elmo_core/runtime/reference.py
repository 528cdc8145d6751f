"""A model reference ─► the files of one model on this machine: the one resolver every command uses.

What a user may name as a model:

    data/export                        a model directory (options.json + weights.hdf5 [+ vocab.txt])
    options.json + --weight-file W     the published files (AllenNLP's and bilm-tf's downloads), named one by one
    models:/elmo/3                     a registered version in the MLflow store
    models:/elmo/latest                its highest version, now
    models:/elmo@champion              the version an alias points at, now
    runs:/RUN/model                    a run's logged model
    zhs.model                          a released ELMoForManyLangs folder (config.json, char.dic, word.dic, *.pkl)

A registered model is downloaded once per machine into the download cache (``$ELMO_CACHE_DIR``, else
``$XDG_CACHE_HOME/elmo``, else ``~/.cache/elmo``), keyed by what identifies its files: the store, the name, the
version, the run that made it and when it was registered (a version number alone repeats when a store is made
anew). ``latest`` and aliases are asked of the registry on every resolve, so they follow the registry; the files of
the version they name are downloaded only the first time. A job or a server therefore resolves its reference once,
when it plans, and keeps the ``ModelRef`` (or its ``exact`` reference, which names the same files for ever): every
process it starts, and every restart of one, loads that, never ``latest`` again (``pin_reference`` for options
that travel as strings). Concurrent resolvers wait for one download (a lock per
entry); an entry appears whole (downloaded beside, then renamed), so a killed download leaves nothing it could
mistake for a model.

A released ELMoForManyLangs folder is converted once into a model folder that keeps its dictionaries
(``bilm.manylangs.convert_release``), in the same cache under ``releases/``, keyed by the folder and the sizes and
times of its files: every command then opens that folder as any other, and only the conversion reads their pickles.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from elmo_core import tracking
from elmo_core.config import OPTIONS_NAME, resolve_model_files
from elmo_core.errors import InputError
from elmo_core.fileio import FolderLock, cache_root
from elmo_core.text.manylangs_chars import is_release

log = logging.getLogger(__name__)

REGISTERED = re.compile(r"^models:/(?P<name>[^/@]+)(?:/(?P<version>[^/]+)|@(?P<alias>[^/]+))/?$")


@dataclass(frozen=True)
class ModelRef:
    """One model's files on this machine, how they were found (``origin``, for the run's line), and the exact model
    they are: ``exact`` names the same files whenever it is resolved again (``models:/NAME/N`` for ``latest`` or an
    alias, the absolute folder for a folder), and a registered model keeps its name, version and the run that made
    it. Pickled whole to the processes a job or server starts, so that none of them resolves the reference again."""

    asked: str
    options: Path
    weights: Path
    vocab: Path | None
    origin: str
    exact: str = ""
    registered: str | None = None  # the registered model's name
    version: str | None = None  # its version
    run_id: str | None = None  # the MLflow run that logged it
    digest: str | None = None  # ``model_id`` as it was when pinned (``pinned``), checked by ``check_unchanged``
    onnx: bool = False  # an ``elmo onnx`` file (``options`` and ``weights`` both name it): ONNX Runtime runs it

    @property
    def directory(self) -> Path:
        return self.options.parent

    @functools.cached_property
    def name(self) -> str:
        """A short name for logs and ``/info``: the exact registered version (``models:/elmo/3`` where
        ``models:/elmo/latest`` was asked), the URI as asked, else the folder's name. Kept once found: a server
        names its model in every answer, and resolving the folder's path each time was a tenth of its HTTP
        process's time."""
        if self.version is not None:
            return self.exact
        return self.asked if tracking.is_model_uri(self.asked) else Path(self.asked).resolve().name

    @property
    def model_id(self) -> str:
        """A short content hash of options.json + weights.hdf5: which model made a vector (tables keep it). An ONNX
        file names the hash of the files it was exported from (its metadata): the same vectors, the same id."""
        if self.onnx:
            return str(onnx_metadata(self.options, *_stamp(self.options)).get("elmo.model_id", "unknown"))
        return _content_id(self.options, self.weights, *_stamp(self.options), *_stamp(self.weights))

    @property
    def exported_from(self) -> str:
        """An ONNX file's source model as its metadata names it (``elmo.model``); any other model is its own."""
        if self.onnx:
            return onnx_metadata(self.options, *_stamp(self.options))["elmo.model"]
        return self.exact or self.asked

    def network(self) -> dict:
        """The network's shape as options.json has it (an ONNX file keeps it in its metadata, ``elmo.config``)."""
        if self.onnx:
            return json.loads(onnx_metadata(self.options, *_stamp(self.options))["elmo.config"])
        return json.loads(self.options.read_text())

    def identity(self) -> dict[str, str | None]:
        """What names this model exactly, for a job's record, a run's tags and a server's ``/info``: the reference
        as asked, what it resolved to, the registered name, version and run, and the content hash."""
        return {
            "asked": self.asked,
            "exact": self.exact or self.asked,
            "registered_model": self.registered,
            "version": self.version,
            "run_id": self.run_id,
            "model_id": self.digest or self.model_id,  # pinned: the hash of the files it was planned with
        }

    def pinned(self) -> ModelRef:
        """This model with its content hash recorded now (``digest``): what a server hands its model processes, so
        that a restart finds out where the files under the same path became another model's."""
        return dataclasses.replace(self, digest=self.model_id)

    def check_unchanged(self) -> None:
        """Refused in one line where the files are no longer those hashed into ``digest`` (a folder rewritten in
        place by a new export): a process started later must not load another model under the same name."""
        if self.digest is not None and self.model_id != self.digest:
            raise InputError(
                f"{self.directory}: its files changed since {self.asked} was resolved (id {self.digest}, now "
                f"{self.model_id}); start again to use the new model"
            )

    def line(self) -> str:
        resolved = f"{self.exact}, " if self.exact and self.exact != self.asked and self.version else ""
        return f"model {self.asked} ({resolved}{self.origin}; id {self.model_id})"


def _stamp(path: Path) -> tuple[int, int]:
    stat = path.stat()
    return stat.st_size, stat.st_mtime_ns


@functools.lru_cache(maxsize=16)
def _content_id(options: Path, weights: Path, *stamps: int) -> str:
    """Hashed once per process and file version (``stamps``: sizes and mtimes): the published original model's
    weights are 374 MB."""
    digest = hashlib.sha256()
    for path in (options, weights):
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                digest.update(block)
    return digest.hexdigest()[:16]


def resolve_model(reference: str, weight_file: str | None = None) -> ModelRef:
    """The files of the model ``reference`` names (the forms in the module's docstring); refused in one line where
    there is no model: a missing folder, a folder without options.json, an unknown registered name."""
    if tracking.is_model_uri(reference) and not reference.startswith("file:"):
        return _registered(reference) if reference.startswith("models:/") else _downloaded(reference, reference, {})
    path = Path(reference.removeprefix("file://"))
    if not path.exists():
        raise InputError(f"{reference}: no such model directory or options file")
    if is_release(path):
        return _release(reference, path, weight_file)
    if path.is_file() and path.suffix == ".onnx":
        return _onnx_file(reference, path)
    if path.is_dir() and not (path / OPTIONS_NAME).exists():
        raise InputError(
            f"{path}: no {OPTIONS_NAME}; a model is a directory with options.json and weights.hdf5, a published "
            "options.json with --weight-file, or an MLflow URI (models:/NAME/VERSION, models:/NAME@ALIAS, runs:/...)"
        )
    options, weights, vocab = resolve_model_files(path, weight_file)
    if not weights.exists():
        raise InputError(f"{weights}: no such weight file" + (" (--weight-file)" if weight_file else ""))
    origin = "a model directory" if path.is_dir() else "published files"
    exact = str(path.resolve()) if path.is_dir() else reference
    return ModelRef(reference, options, weights, vocab, origin, exact)


@functools.lru_cache(maxsize=4)
def onnx_metadata(path: Path, *stamps: int) -> dict[str, str]:
    """An ONNX file's metadata (``elmo onnx`` writes which model it is there), read once per file version."""
    try:
        import onnx
    except ImportError:
        raise InputError(
            f"{path}: an ONNX file is read with onnx and run with onnxruntime: pip install onnx onnxruntime"
        ) from None
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # the protobuf's own errors, for a file that is not ONNX
        raise InputError(f"{path}: not an ONNX file ({type(exc).__name__})") from None
    return {prop.key: prop.value for prop in model.metadata_props}


def _onnx_file(asked: str, path: Path) -> ModelRef:
    """An ``elmo onnx`` file as a model: named by the exact model it was exported from (its metadata)."""
    found = onnx_metadata(path, *_stamp(path))
    if "elmo.model_id" not in found:
        raise InputError(f"{path}: an ONNX file that `elmo onnx` did not write (no elmo.model_id in its metadata)")
    identity = json.loads(found.get("elmo.identity", "{}"))
    version = identity.get("version")
    exact = found["elmo.model"] if version else str(path.resolve())
    origin = f"an ONNX file ({found.get('elmo.exporter', 'elmo onnx')})"
    return ModelRef(
        asked,
        path,
        path,
        None,
        origin,
        exact,
        identity.get("registered_model"),
        version,
        identity.get("run_id"),
        onnx=True,
    )


def _release(asked: str, folder: Path, weight_file: str | None) -> ModelRef:
    """A released ELMoForManyLangs folder as a model folder of this project, converted the first time (only then
    is torch imported: the pickles are read); ``weight_file`` may name the folder or a file in it (AllenNLP's
    ``ElmoEmbedder(folder, folder)``), nothing else."""
    if weight_file is not None and Path(weight_file).resolve() not in (folder.resolve(), *folder.resolve().iterdir()):
        raise InputError(
            f"{weight_file}: an ELMoForManyLangs folder ({folder}) carries its weights; give no weight file"
        )
    entry = _release_entry(folder)
    how = "cached"
    if not (entry / OPTIONS_NAME).exists():
        with FolderLock(entry.with_name(entry.name + ".lock"), entry, wait=True):
            if not (entry / OPTIONS_NAME).exists():  # another process may have converted it while this one waited
                from elmo_core.bilm.manylangs import convert_release

                log.info("%s: an ELMoForManyLangs release; converting it once into %s", folder, entry)
                convert_release(folder, entry)
                how = "converted"
    options, weights, vocab = resolve_model_files(entry)
    origin = f"an ELMoForManyLangs release, {how} in {entry}"
    return ModelRef(asked, options, weights, vocab, origin, str(folder.resolve()))


def _release_entry(folder: Path) -> Path:
    """Where a release is converted, keyed by the folder and the sizes and times of its files."""
    stamps = sorted((p.name, *_stamp(p)) for p in folder.iterdir() if p.is_file())
    identity = json.dumps({"release": str(folder.resolve()), "files": stamps})
    key = hashlib.sha256(identity.encode()).hexdigest()[:16]
    label = re.sub(r"[^A-Za-z0-9_.-]+", "-", folder.resolve().name).strip("-") or "release"
    return cache_root() / "releases" / f"{label}-{key}"


def _registered_facts(uri: str) -> dict[str, str]:
    """The registry's answer for ``uri`` now: name, version, run, when registered, store."""
    match = REGISTERED.match(uri)
    if match is None:
        raise InputError(f"{uri}: expected models:/NAME/VERSION, models:/NAME/latest or models:/NAME@ALIAS")
    return tracking.registered_version(match["name"], match["version"], match["alias"])


def _registered(uri: str) -> ModelRef:
    facts = _registered_facts(uri)
    return _downloaded(uri, f"models:/{facts['name']}/{facts['version']}", facts)


def pin_reference(reference: str) -> str:
    """The reference that names, for ever, the model ``reference`` names now: ``models:/NAME/N`` for
    ``models:/NAME/latest`` or an alias (one look at the registry, no download); any other reference as it is (a
    version number, a run's model, a folder and files name the same thing each time they are read). An option that
    travels as a string to other processes (a training's ``init_from`` to its ranks, a probe's model) is pinned
    once, when its job plans, so that no process of the job asks the registry again."""
    match = REGISTERED.match(reference) if reference.startswith("models:/") else None
    if match is None or (match["version"] is not None and match["version"] != "latest"):
        return reference
    facts = _registered_facts(reference)
    return f"models:/{facts['name']}/{facts['version']}"


def _downloaded(asked: str, exact: str, facts: dict[str, str]) -> ModelRef:
    """``exact`` (a URI whose files never change) from the download cache, fetched the first time."""
    entry, identity = _download_entry(exact, facts)
    how = "cached"
    if not (entry / "model.json").exists():
        with FolderLock(entry.with_name(entry.name + ".lock"), entry, wait=True):
            if not (entry / "model.json").exists():  # another process may have fetched it while this one waited
                _fetch(exact, entry, identity)
                how = "downloaded"
    return _cached(asked, exact, facts, entry, how)


def _download_entry(exact: str, facts: dict[str, str]) -> tuple[Path, str]:
    """Where ``exact`` is downloaded, keyed by what identifies its files (the store, the name, the version, the run
    that made it and when it was registered), and that identity as JSON."""
    identity = json.dumps({"uri": exact, **facts, "store": facts.get("store") or tracking.resolve_tracking_uri()})
    key = hashlib.sha256(identity.encode()).hexdigest()[:16]
    label = re.sub(r"[^A-Za-z0-9_.-]+", "-", exact.split(":/", 1)[1]).strip("-")
    return cache_root() / "models" / f"{label}-{key}", identity


def _cached(asked: str, exact: str, facts: dict[str, str], entry: Path, how: str) -> ModelRef:
    found = entry / json.loads((entry / "model.json").read_text())["folder"]
    options, weights, vocab = resolve_model_files(found)
    run_id = facts.get("run_id") or None
    version = facts.get("version")
    return ModelRef(asked, options, weights, vocab, f"{how} in {entry}", exact, facts.get("name"), version, run_id)


# ----- a lookup: what a plan may do (read the registry, the folder, the cache; write nothing) ------------------


@dataclass(frozen=True)
class ModelLookup:
    """What a reference names, found without writing a byte: its exact identity, and its files where this machine
    has them already (``ref``: a folder, a download or conversion in the cache). Where it has not, ``missing`` says
    what ``fetch`` will do: a download of the exact version, or a release's conversion, which a stage runs under its
    claim, never in its plan."""

    asked: str
    exact: str
    ref: ModelRef | None
    missing: str = ""
    registered: str | None = None
    version: str | None = None
    run_id: str | None = None
    weight_file: str | None = None

    @property
    def model_id(self) -> str | None:
        """The content hash, where the files are here (else known once fetched)."""
        return self.ref.model_id if self.ref is not None else None

    def identity(self) -> dict[str, str | None]:
        if self.ref is not None:
            return self.ref.identity()
        names = {"asked": self.asked, "exact": self.exact, "registered_model": self.registered}
        return {**names, "version": self.version, "run_id": self.run_id, "model_id": None}

    def line(self) -> str:
        if self.ref is not None:
            return self.ref.line()
        exact = f"{self.exact}, " if self.exact != self.asked else ""
        return f"model {self.asked} ({exact}{self.missing} once the job holds its folders)"

    def fetch(self) -> ModelRef:
        """The files, fetched or converted where they are not here yet (the lookup's exact version, never what
        ``latest`` names by now)."""
        if self.ref is not None:
            return self.ref
        ref = resolve_model(self.exact if self.version is not None else self.asked, self.weight_file)
        return dataclasses.replace(ref, asked=self.asked)


def lookup_model(reference: str, weight_file: str | None = None) -> ModelLookup:
    """What ``reference`` names, read only (the registry, the folder, the cache): what a stage's plan calls. A
    registered model not yet downloaded and a release not yet converted come back without files
    (``ModelLookup.fetch`` gets them, under the stage's claim); anything else as ``resolve_model`` finds it."""
    if reference.startswith(("models:/", "runs:/")):
        facts = _registered_facts(reference) if reference.startswith("models:/") else {}
        exact = f"models:/{facts['name']}/{facts['version']}" if facts else reference
        entry, _ = _download_entry(exact, facts)
        named = {"registered": facts.get("name"), "version": facts.get("version"), "run_id": facts.get("run_id")}
        if (entry / "model.json").exists():
            return ModelLookup(reference, exact, _cached(reference, exact, facts, entry, "cached"), **named)
        missing = f"downloaded into the model cache {entry.parent}"
        return ModelLookup(reference, exact, None, missing, **named, weight_file=weight_file)
    path = Path(reference.removeprefix("file://"))
    if path.exists() and is_release(path):
        entry = _release_entry(path)
        if not (entry / OPTIONS_NAME).exists():
            missing = f"an ELMoForManyLangs release, converted once into {entry}"
            return ModelLookup(reference, str(path.resolve()), None, missing, weight_file=weight_file)
    ref = resolve_model(reference, weight_file)  # a folder, published files, a converted release: read only
    if ref.onnx:  # a graph for ONNX Runtime, not weights: only the server runs it
        raise InputError(
            f"{reference}: an ONNX file runs in ONNX Runtime (`elmo serve FILE.onnx`, docs/onnx.md); for this "
            f"command give the model it was exported from ({ref.exported_from})"
        )
    return ModelLookup(ref.asked, ref.exact or ref.asked, ref, registered=ref.registered, version=ref.version)


def _fetch(uri: str, entry: Path, identity: str) -> None:
    partial = entry.with_name(entry.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)  # a download that was killed
    partial.mkdir(parents=True)
    log.info("%s: downloading into the model cache %s", uri, entry.parent)
    found = tracking.download_model(uri, partial)
    (partial / "model.json").write_text(
        json.dumps({"folder": str(found.relative_to(partial)), "identity": json.loads(identity)}, indent=2) + "\n"
    )
    shutil.rmtree(entry, ignore_errors=True)
    partial.rename(entry)
