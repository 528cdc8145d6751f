"""Project exceptions. Messages say what was found, what was expected, and where."""


class ElmoError(Exception):
    """Base class: the CLI prints these as one line and exits non-zero."""


class ConfigError(ElmoError):
    """A config or options file is missing, unparsable or inconsistent."""


class WeightFileError(ElmoError):
    """A weights.hdf5 misses a dataset or holds one of the wrong shape."""
