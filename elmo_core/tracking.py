"""Experiment tracking behind a small interface. In elmo_core MLflow is imported here and in ``mlflow_model`` (the
file MLflow itself loads as the model's code); the flows use it only to link a run.

The trainer talks to a ``Tracker``; ``NullTracker`` trains without MLflow, ``MLflowTracker`` logs to any MLflow
store (by default a SQLite file under ``data/``). A trained model is logged as a pyfunc model whose artifact is
the bilm-tf model directory, and registered, so ``runs:/<id>/model`` and ``models:/<name>/<version>`` both
resolve to options.json + weights.hdf5 + vocab.txt via ``resolve_model_dir``.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from elmo_core.errors import StoreUnreachable, TrackingError, disk_full
from elmo_core.fileio import disk_full_error

log = logging.getLogger(__name__)

PROJECT_ROOT = Path(__file__).resolve().parents[1]
MODEL_ARTIFACT = "model"  # artifact path of the logged model; the bilm-tf files sit in its artifacts/elmo


REACH_TIMEOUT_S = 5.0  # how long a tracking server may take to answer before a run is refused


def resolve_tracking_uri(uri: str | None = None, home: Path | None = None) -> str:
    """The one rule for the store a run logs to (``TRACKING_URI_HELP`` says it to users): ``uri``, else
    ``$MLFLOW_TRACKING_URI``, else ``mlflow.db`` in ``home`` (the main job's work folder), by default ``data/``."""
    return uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(home or PROJECT_ROOT / 'data') / 'mlflow.db'}"


def check_reachable(uri: str | None = None) -> None:
    """Refuse, in seconds and before any work, a tracking server that does not answer (MLflow itself would retry
    for minutes): one line naming the URI and the way to run without it. Stores that are files pass."""
    import urllib.error
    import urllib.request

    uri = resolve_tracking_uri(uri)
    if not uri.startswith(("http://", "https://")):
        return
    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=REACH_TIMEOUT_S):
            return
    except urllib.error.HTTPError:
        return  # it answered: a server is there (a proxy may not expose /health)
    except (urllib.error.URLError, OSError, TimeoutError) as exc:
        reason = getattr(exc, "reason", exc)
        raise StoreUnreachable(
            f"tracking: no MLflow server answers at {uri} ({reason}); start it, point MLFLOW_TRACKING_URI or "
            "tracking_uri elsewhere, or set tracking: none (--tracking none) to run without MLflow"
        ) from None


class Tracker(Protocol):
    run_id: str | None

    def log_params(self, params: dict[str, Any]) -> None: ...
    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...
    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None: ...
    def log_model_dir(self, model_dir: str | Path, registered_name: str | None) -> str | None: ...
    def log_dataset(self, dataset: DatasetFacts, context: str) -> None: ...
    def log_checkpoint(self, path: Path, step: int, metrics: dict[str, float]) -> None: ...
    def close(self, status: str = "FINISHED") -> None: ...


class NullTracker:
    """Tracks nothing: for library use and tests that do not need MLflow."""

    run_id: str | None = None

    def log_params(self, params: dict[str, Any]) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        pass

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        pass

    def log_model_dir(self, model_dir: str | Path, registered_name: str | None) -> str | None:
        return None

    def log_dataset(self, dataset: DatasetFacts, context: str) -> None:
        pass

    def log_checkpoint(self, path: Path, step: int, metrics: dict[str, float]) -> None:
        pass

    def close(self, status: str = "FINISHED") -> None:
        pass


def _flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for key, inner in value.items():
            _flatten(f"{prefix}.{key}" if prefix else str(key), inner, out)
    else:
        out[prefix] = value


def _onnx_beside(model_dir: str | Path) -> dict[str, str]:
    """The model's ONNX file (``MODEL_DIR.onnx``, ``runtime.onnx_file.write_beside``) as the artifact ``onnx``."""
    onnx = Path(model_dir).with_suffix(".onnx")
    return {"onnx": str(onnx)} if onnx.exists() else {}


class _MetricQueue:
    """Metric points sent by a background thread, so that a tracking server that goes away mid-run neither stalls
    nor kills the training: points that fail are kept and sent again with the next ones, ``close`` gives them a last
    chance within a deadline and returns how many could not be logged."""

    BATCH = 1000  # MLflow's log_batch takes at most 1000 metrics per call

    def __init__(self, client: Any, run_id: str) -> None:
        self._client, self._run_id = client, run_id
        self._pending: list[Any] = []
        self._sending = 0  # points of the batch a send is carrying right now
        self._lock = threading.Lock()
        self._wake, self._stopping = threading.Event(), False
        self.last_error: str | None = None
        self.disk_full = False  # a send failed for lack of space in the store (warned once, at once)
        self._thread = threading.Thread(target=self._loop, name="mlflow-metrics", daemon=True)
        self._thread.start()

    def put(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        with self._lock:
            self._pending += [Metric(k, float(v), now, step) for k, v in metrics.items()]
        self._wake.set()

    def _loop(self) -> None:
        while not self._stopping:
            self._wake.wait(timeout=5.0)
            self._wake.clear()
            if not self._send() and not self._stopping:
                time.sleep(2.0)  # the server is away: try again later, with whatever has queued up meanwhile

    def _send(self) -> bool:
        with self._lock:
            batch, self._pending = self._pending[: self.BATCH], self._pending[self.BATCH :]
            self._sending = len(batch)
        if not batch:
            return True
        try:
            self._client.log_batch(self._run_id, metrics=batch)
            return True
        except Exception as exc:  # any failure of the store: keep the points for the next attempt
            self.last_error = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
            if disk_full(exc) and not self.disk_full:
                self.disk_full = True
                log.warning(
                    "MLflow: the disk holding the store is full; the training goes on, its metrics are kept "
                    "and sent again (%s)",
                    self.last_error,
                )
            with self._lock:
                self._pending = batch + self._pending
            return False
        finally:
            with self._lock:
                self._sending = 0

    def close(self, deadline_s: float = 15.0) -> int:
        """Send what is left (stopping at the deadline); the number of points that could not be logged."""
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=deadline_s)
        if self._thread.is_alive():  # still inside a send: never send beside it; its batch counts as not logged
            with self._lock:
                return len(self._pending) + self._sending
        end = time.monotonic() + deadline_s
        while self._pending and time.monotonic() < end and self._send():
            pass
        return len(self._pending)


def pyfunc_signature() -> Any:
    """What the pyfunc model (``mlflow_model.py``) takes: a ``sentence`` column of whitespace-tokenized text, and
    ``pooled`` (false: a vector per token; true: one per sentence)."""
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, ParamSchema, ParamSpec, Schema

    return ModelSignature(
        inputs=Schema([ColSpec("string", "sentence")]), params=ParamSchema([ParamSpec("pooled", "boolean", False)])
    )


class MLflowTracker:
    """One MLflow run per training, with system metrics; ``run_id`` is set once started."""

    def __init__(
        self,
        experiment: str = "elmo",
        run_name: str | None = None,
        tracking_uri: str | None = None,
        run_id: str | None = None,
        tags: dict[str, str] | None = None,
    ) -> None:
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        import mlflow

        self._mlflow = mlflow
        uri = resolve_tracking_uri(tracking_uri)
        check_reachable(uri)
        if uri.startswith(("http://", "https://")):  # an outage costs seconds per attempt, not MLflow's minutes
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        if uri.startswith("sqlite:///"):
            Path(uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        mlflow.set_tracking_uri(uri)
        self.tracking_uri = uri
        self.failed: list[str] = []  # what could not be logged, for the warning at the end
        self.disk_full = False  # a logging call failed for lack of space in the store
        try:
            self._start(experiment, run_name, run_id, tags)
        except Exception as exc:
            if not disk_full(exc):
                raise
            folder = _store_folder(uri)
            raise disk_full_error(folder, "the MLflow run was not started, nothing was trained yet", exc) from exc
        log.info("MLflow run %s (experiment %s) at %s", self.run_id, self.experiment_id, uri)

    def _start(self, experiment: str, run_name: str | None, run_id: str | None, tags: dict[str, str] | None) -> None:
        mlflow, uri = self._mlflow, self.tracking_uri
        if run_id is None:
            if uri.startswith("sqlite:///") and mlflow.get_experiment_by_name(experiment) is None:
                # artifacts beside the SQLite store (not ./mlruns of whatever the working directory is)
                store = Path(uri.removeprefix("sqlite:///")).parent / "mlartifacts"
                mlflow.create_experiment(experiment, artifact_location=store.resolve().as_uri())
            mlflow.set_experiment(experiment)
        run = mlflow.start_run(run_id=run_id, run_name=run_name, log_system_metrics=True, tags=tags)
        self.run_id = run.info.run_id
        self.experiment_id = run.info.experiment_id
        self._metrics = _MetricQueue(mlflow.tracking.MlflowClient(uri), self.run_id)
        self._beside = ThreadPoolExecutor(1, thread_name_prefix="mlflow-checkpoints")  # off the training's clock
        self._pending: list[Future[Any]] = []

    def log_params(self, params: dict[str, Any]) -> None:
        flat: dict[str, Any] = {}
        _flatten("", params, flat)
        existing = self._mlflow.get_run(self.run_id).data.params
        new = {k: str(v)[:6000] for k, v in flat.items() if k not in existing}  # a resumed run keeps its params
        if new:
            self._tolerant(f"{len(new)} params", lambda: self._mlflow.log_params(new), only_disk_full=True)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Queued: sent by a background thread, retried while the server is away (``_MetricQueue``)."""
        self._metrics.put(metrics, step)

    def _tolerant(self, what: str, call: Any, only_disk_full: bool = False) -> Any:
        """Run a logging call; a store that is away (at the end of a run) or full (at any time) costs a warning, not
        the training."""
        try:
            return call()
        except Exception as exc:
            if only_disk_full and not disk_full(exc):
                raise
            self.disk_full = self.disk_full or disk_full(exc)
            self.failed.append(f"{what} ({str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__})")
            log.warning("MLflow at %s: could not log %s: %s", self.tracking_uri, what, self.failed[-1])
            return None

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        if Path(path).is_dir():
            self._tolerant(f"artifact {path}", lambda: self._mlflow.log_artifacts(str(path), artifact_path))
        else:
            self._tolerant(f"artifact {path}", lambda: self._mlflow.log_artifact(str(path), artifact_path))

    def log_model_dir(self, model_dir: str | Path, registered_name: str | None) -> str | None:
        """Log the bilm-tf model directory as a pyfunc model (and register it); returns its model URI (None when
        the store could not take it: the model directory itself is the result)."""
        return self._tolerant(f"the model {model_dir}", lambda: self._log_model_dir(model_dir, registered_name))

    def _log_model_dir(self, model_dir: str | Path, registered_name: str | None) -> str | None:
        info = self._mlflow.pyfunc.log_model(
            name=MODEL_ARTIFACT,
            signature=pyfunc_signature(),
            python_model=str(Path(__file__).parent / "train" / "mlflow_model.py"),  # models from code: no pickle
            artifacts={"elmo": str(model_dir), **_onnx_beside(model_dir)},
            registered_model_name=registered_name,
            pip_requirements=["torch", "numpy", "h5py", "pydantic", "pyyaml"],
            code_paths=[str(PROJECT_ROOT / "elmo_core")],
        )
        if registered_name and info.registered_model_version is not None:
            uri = f"models:/{registered_name}/{info.registered_model_version}"
            log.info("registered %s (the newest version is also models:/%s/latest)", uri, registered_name)
            return uri
        return info.model_uri

    def log_checkpoint(self, path: Path, step: int, metrics: dict[str, float]) -> None:
        """A checkpoint as one of MLflow 3's LoggedModels of this run (``checkpoint-STEP``, type
        ``elmo-checkpoint``): an external model, its file left where it is (the tag ``elmo.checkpoint`` says where;
        logging each checkpoint's weights as artifacts would copy the run's largest files into the store), with its
        step and the loss and last heldout metrics at it."""

        def log() -> None:
            tags = {"elmo.checkpoint": str(path), "elmo.step": str(step)}
            model = self._mlflow.create_external_model(
                name=f"checkpoint-{step}", source_run_id=self.run_id, tags=tags, model_type="elmo-checkpoint"
            )
            for key, value in metrics.items():
                if value == value:  # NaN (no loss yet) is no metric
                    self._mlflow.log_metric(key, value, step=step, run_id=self.run_id, model_id=model.model_id)

        # in a thread beside the training, as metrics are sent: a store that is away must not hold up a step
        self._pending.append(self._beside.submit(self._tolerant, f"the checkpoint {path}", log))

    def log_dataset(self, dataset: DatasetFacts, context: str) -> None:
        """The run's input ``dataset`` (its source folder, digest, columns, sentences and tokens), in MLflow's
        dataset panel under ``context`` ("train", "heldout")."""
        self._tolerant(f"the dataset {dataset.name}", lambda: self._mlflow.log_input(_meta_dataset(dataset), context))

    def close(self, status: str = "FINISHED") -> None:
        """Flush the queued metrics, end the run, and warn once of everything that could not be logged."""
        done, late = wait(self._pending, timeout=15.0)
        self._beside.shutdown(wait=False, cancel_futures=True)
        if late:
            self.failed.append(f"{len(late)} checkpoints as models (the store did not answer in time)")
        lost = self._metrics.close()
        if lost:
            self.failed.append(f"{lost} metric points (last error: {self._metrics.last_error})")
        self._tolerant("the end of the run", lambda: self._mlflow.end_run(status=status))
        if self.failed:
            full = self.disk_full or self._metrics.disk_full
            log.warning(
                "MLflow at %s %s for part of the run; not logged: %s. The checkpoints, the model directory and "
                "metrics.jsonl in the run folder hold everything",
                self.tracking_uri,
                "could not store (the disk holding it is full)" if full else "was unreachable",
                "; ".join(self.failed),
            )


def _store_folder(uri: str) -> str:
    """The folder of a store that is a file (what fills up), or the URI of a server."""
    return str(Path(uri.removeprefix("sqlite:///")).parent) if uri.startswith("sqlite:///") else uri


class NodeSystemMetrics:
    """System metrics (CPU, memory, disk, network, GPU) of one more machine of a multi-node training, logged into
    rank 0's MLflow run as ``system/NODE/…`` by MLflow's own monitor (rank 0's machine: ``system/node0/…``).
    A store that cannot be reached costs these metrics only, with one warning."""

    def __init__(self, run_id: str, tracking_uri: str, node_id: str) -> None:
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        self.monitor = None
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            self.monitor = SystemMetricsMonitor(run_id, node_id=node_id, tracking_uri=tracking_uri)
            self.monitor.start()
        except Exception as exc:  # noqa: BLE001  (metrics must never stop a training)
            log.warning("system metrics of %s not logged: %s", node_id, str(exc).splitlines()[0][:200])

    def close(self) -> None:
        if self.monitor is not None:
            self.monitor.finish()


def is_model_uri(uri: str) -> bool:
    """True for MLflow URIs (``runs:/…``, ``models:/…``, ``file://…``); False for a local path."""
    return "://" in uri or ":/" in uri


def _mlflow() -> Any:
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    # a download's progress bar, redrawn per file, would run into a server's JSON access log on the same stdout
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    import mlflow

    mlflow.set_tracking_uri(resolve_tracking_uri())
    return mlflow


def _fetch_error(uri: str, exc: Exception, tracking_uri: str) -> TrackingError:
    message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return (StoreUnreachable if isinstance(exc, OSError) else TrackingError)(
        f"{uri}: cannot be fetched from the MLflow store {tracking_uri} ({message}); check the name and version "
        "(`mlflow ui` lists them) and MLFLOW_TRACKING_URI"
    )


def registered_version(name: str, version: str | None, alias: str | None) -> dict[str, str]:
    """What a registered model's reference names now: ``latest`` (the highest version), a number or an alias ─►
    ``{"name", "version", "run_id", "created", "store"}``, the facts that identify its files for a download cache
    (a version number alone repeats when a store is made anew)."""
    mlflow = _mlflow()
    from mlflow.exceptions import MlflowException

    store = mlflow.get_tracking_uri()
    check_reachable(store)  # a store that is away: seconds, not MLflow's retries
    client = mlflow.MlflowClient()
    asked = f"models:/{name}@{alias}" if alias else f"models:/{name}/{version}"
    try:
        if alias:
            found = client.get_model_version_by_alias(name, alias)
        elif version == "latest":
            versions = client.search_model_versions(f"name = '{name}'")
            if not versions:
                raise MlflowException(f"no version of a registered model named {name!r}")
            found = max(versions, key=lambda v: int(v.version))
        else:
            found = client.get_model_version(name, str(version))
    except (MlflowException, OSError) as exc:
        raise _fetch_error(asked, exc, store) from None
    return {
        "name": name,
        "version": str(found.version),
        "run_id": str(found.run_id or ""),
        "created": str(found.creation_timestamp),
        "store": store,
    }


def download_model(uri: str, dst: Path) -> Path:
    """Download a model URI's artifacts into ``dst`` and return the folder inside that holds options.json (a
    logged pyfunc model keeps it under ``artifacts/elmo``)."""
    mlflow = _mlflow()
    from mlflow.exceptions import MlflowException

    if uri.startswith(("models:/", "runs:/")):
        check_reachable(mlflow.get_tracking_uri())
    try:
        local = Path(mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(dst)))
    except (MlflowException, OSError) as exc:
        raise _fetch_error(uri, exc, mlflow.get_tracking_uri()) from None
    if (local / "options.json").exists():
        return local
    for options in sorted((local / "artifacts").rglob("options.json")):  # a logged pyfunc model
        return options.parent
    raise TrackingError(f"{uri}: no options.json in the downloaded artifacts at {local}; it is not an ELMo model")


# ----- datasets and the registry's aliases: what a promotion reads and writes -------------------------------------


@dataclass(frozen=True)
class DatasetFacts:
    """A dataset as a run logs it: a name, the folder it is in, its digest, its columns and its size."""

    name: str
    source: str
    digest: str
    sentences: int
    tokens: int
    columns: tuple[tuple[str, str], ...] = ()


def _meta_dataset(facts: DatasetFacts) -> Any:
    """MLflow's dataset of ``facts``: a MetaDataset (the data stays where it is) with a profile of its size."""
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.types.schema import Array, ColSpec, Schema

    class Profiled(MetaDataset):
        def to_dict(self) -> dict[str, str]:
            return {**super().to_dict(), "profile": json.dumps({"sentences": facts.sentences, "tokens": facts.tokens})}

    def spec(name: str, kind: str) -> Any:  # "string", "list<string>", "list<int32>"
        inner = kind.removeprefix("list<").removesuffix(">")
        inner = {"int32": "integer", "int64": "long"}.get(inner, inner)
        return ColSpec(Array(inner) if kind.startswith("list<") else inner, name)

    with warnings.catch_warnings():  # a local folder reads as two kinds of local source alike
        warnings.simplefilter("ignore")
        source = resolve_dataset_source(facts.source)
    schema = Schema([spec(name, kind) for name, kind in facts.columns]) if facts.columns else None
    return Profiled(source, name=facts.name, digest=facts.digest, schema=schema)


def run_datasets(run_id: str) -> dict[str, dict[str, Any]]:
    """The datasets a run logged, by context: name, digest, source (the folder) and profile."""
    mlflow = _mlflow()
    run = mlflow.MlflowClient().get_run(run_id)
    found = {}
    for item in run.inputs.dataset_inputs:
        context = next((t.value for t in item.tags if t.key == "mlflow.data.context"), "")
        source = json.loads(item.dataset.source or "{}").get("uri", "")
        profile = json.loads(item.dataset.profile) if item.dataset.profile else {}
        found[context] = {"name": item.dataset.name, "digest": item.dataset.digest, "source": source, **profile}
    return found


def use_store(uri: str) -> None:
    """Make ``uri`` this process's MLflow store, for the registry reads and writes below (as MLFLOW_TRACKING_URI)."""
    os.environ["MLFLOW_TRACKING_URI"] = resolve_tracking_uri(uri)


def alias_version(name: str, alias: str) -> str | None:
    """The version ``models:/NAME@ALIAS`` names now, or None where the alias is not set."""
    mlflow = _mlflow()
    from mlflow.exceptions import MlflowException

    try:
        return str(mlflow.MlflowClient().get_model_version_by_alias(name, alias).version)
    except MlflowException:
        return None


def set_alias(name: str, alias: str, version: str, tags: dict[str, str]) -> None:
    """Tag version ``version`` of ``name`` (the evidence of a decision), then point ``alias`` at it where asked
    (``alias`` empty: tags only)."""
    client = _mlflow().MlflowClient()
    for key, value in tags.items():
        client.set_model_version_tag(name, version, key, value)
    if alias:
        client.set_registered_model_alias(name, alias, version)
