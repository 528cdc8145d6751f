"""Project exceptions. Messages say what was found, what was expected, where, and what to do.

The CLI prints any ``ElmoError`` as one line and exits 2; the flows let them fail the task with that line.
"""


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
