"""Project exceptions. Messages say what was found, what was expected, where, and what to do.

The CLI prints any ``ElmoError`` as one line and exits 2; the flows let them fail the task with that line.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ValidationError


class ElmoError(Exception):
    """Base class: a problem the user can fix, reported in one line."""


class ConfigError(ElmoError):
    """An option, a config or options file is missing, unparsable or inconsistent."""


class InputError(ElmoError):
    """Input data (a corpus file, a dataset folder, a vocabulary) is missing, empty or malformed."""


class ConfigurationError(ConfigError, ValueError):
    """A library call's argument is inconsistent (the message names the parameter). AllenNLP's name: where
    ``elmo_core.allennlp.install()`` is in effect this is ``allennlp.common.checks.ConfigurationError``, which
    downstream code catches; it is also a ``ValueError``."""


class OutputError(ConfigError):
    """An output path cannot be used: it is a file, or a folder that belongs to another job."""


class WeightFileError(ElmoError):
    """A weights.hdf5 misses a dataset or holds one of the wrong shape."""


class CheckpointError(ElmoError):
    """No usable checkpoint: missing, damaged, or written by another run."""


class TrainingDivergedError(ElmoError):
    """The loss became NaN or infinite."""


class TrainingStopped(ElmoError):
    """A launched training was asked to stop (SIGTERM): it checkpointed and ended; a rerun resumes."""


class TrackingError(ElmoError):
    """The MLflow store or a model URI cannot be used."""


class StoreUnreachable(TrackingError):
    """The MLflow server did not answer: passing trouble where the others are not (an orchestrator retries it)."""


class NoSpaceError(ElmoError):
    """An output's estimated size does not fit the free space of the filesystem holding it (checked before writing)."""


class DiskFullError(ElmoError):
    """A write failed for lack of space (ENOSPC, EDQUOT) after it started: the one line that says which folder, how
    much is free, what is kept, and that a rerun continues. ``fileio.disk_full_error`` measures the free space."""

    RERUN = "run the same command again once there is space, it continues"

    def __init__(self, folder: str, free: str, kept: str, rerun: str = RERUN) -> None:
        self.folder, self.free, self.kept, self.rerun = folder, free, kept, rerun
        super().__init__(f"{folder}: the disk is full ({free} free on the filesystem holding it); {kept}; {rerun}")

    def __reduce__(self) -> tuple:  # pickled whole: a Prefect task's or a worker process's result
        return type(self), (self.folder, self.free, self.kept, self.rerun)


# How each library says "no space": Python's OSError (errno 28 ENOSPC, 122 EDQUOT) and the libraries that keep only
# its text: DuckDB (IOException / TransactionException: 'Could not write file "x.wal": No space left on device'),
# pyarrow ("[Errno 28] ..."), h5py ("errno = 28" in HDF5's message), torch's writer (``inline_container.cc``:
# "unexpected pos N vs M", "file write failed": a short write, with no errno), SQLite under MLflow ("database or disk
# is full").
_ERRNOS = frozenset({28, 122})  # ENOSPC, EDQUOT on Linux (the errno module's values, fixed here for the texts)
_TEXTS = (
    "no space left on device",
    "disk quota exceeded",
    "errno 28",
    "errno = 28",
    "errno 122",
    "errno = 122",
    "database or disk is full",
    "file write failed",
    "unexpected pos ",
)


def disk_full(exc: BaseException | None) -> bool:
    """True where ``exc``, or an exception it was raised from or during, is a write that failed for lack of space
    (a ``DiskFullError`` included). The libraries' own classes differ; errno and message text are what they share."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, DiskFullError) or (isinstance(exc, OSError) and exc.errno in _ERRNOS):
            return True
        if isinstance(exc, NoSpaceError):
            return False  # refused before writing: its own line says so
        text = str(exc).lower()
        if any(t in text for t in _TEXTS):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def validate(cls: type[BaseModel], data: dict[str, Any], source: str = "options"):  # noqa: ANN201
    """``cls.model_validate(data)`` (an options model) with pydantic's errors turned into one ``ConfigError`` line."""
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{source}: {describe_validation_error(exc)}") from None


def describe_validation_error(exc: ValidationError, name: Callable[[str], str] = lambda where: where) -> str:
    """pydantic's errors in one line, each field called ``name(dotted location)`` (the CLI names its flags)."""
    parts = []
    for error in exc.errors():
        where = name(".".join(str(p) for p in error["loc"])) or "value"
        got = f" (got {error['input']!r})" if error["type"] not in ("missing", "extra_forbidden") else ""
        parts.append(f"{where}: {error['msg']}{got}")
    return "; ".join(parts)
