"""How a model runs in a process, decided in one room: the model reference, the device, the precision and why,
the threads, the kernels, the batching under a token budget, the word cache and the output's shape.

    reference   a model reference (folder, published files, models:/NAME/N|latest, models:/NAME@ALIAS, runs:/)
                ─► its files on this machine; registered models through one download cache per machine
    placement   the device and the precision with its reason (``place``), this process's threads (``take_threads``),
                one process per GPU for a job of many units (``gpu_processes``)
    output      what a caller wants of the layers: every layer or a scalar mix, per token or their mean, a dtype
    engine      ``Runtime``: a model opened once, its word cache, forward passes packed under a token budget
    info        what this machine runs and what a model is (``elmo info``)

Every stage and the server run a model through ``Runtime``; training (which builds its own model to train) takes
its device, precision, threads and ``init_from`` model from ``place``, ``take_threads`` and ``resolve_model``.
``tests/test_runtime.py`` keeps these decisions here. Names load on first use (PEP 562), so a process that only
resolves a reference (the server's HTTP process) does not build the engine.
"""

import importlib

_EXPORTS = {
    "Runtime": "engine",
    "ALL_LAYERS": "output",
    "Output": "output",
    "Placement": "placement",
    "place": "placement",
    "gpu_processes": "placement",
    "take_threads": "placement",
    "ModelLookup": "reference",
    "ModelRef": "reference",
    "lookup_model": "reference",
    "pin_reference": "reference",
    "resolve_model": "reference",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'elmo_core.runtime' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"elmo_core.runtime.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value
