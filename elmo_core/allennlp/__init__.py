"""The maintained drop-in for AllenNLP's ELMo: code written against ``allennlp.modules.elmo`` (2.10) or
``allennlp.commands.elmo`` (0.9) runs on this project, and its saved state dicts load.

    from elmo_core.allennlp import Elmo, ElmoEmbedder, batch_to_ids   # instead of allennlp's

or, for third-party code that imports AllenNLP itself, two lines before it is imported:

    import elmo_core.allennlp
    elmo_core.allennlp.install()       # allennlp.modules.elmo, allennlp.commands.elmo, … now resolve here

    keys       the biLM's parameters under AllenNLP's names and layouts, both ways
    modules    Elmo, _ElmoBiLm, ScalarMix, batch_to_ids, remove_sentence_boundaries (AllenNLP 2.10)
    commands   ElmoEmbedder, DEFAULT_OPTIONS_FILE, DEFAULT_WEIGHT_FILE, DEFAULT_BATCH_SIZE (AllenNLP 0.9)

Importing it loads neither Prefect, MLflow, DuckDB nor pyarrow.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
import types

from elmo_core.allennlp.commands import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_OPTIONS_FILE,
    DEFAULT_WEIGHT_FILE,
    ElmoEmbedder,
)
from elmo_core.allennlp.modules import Elmo, ScalarMix, _ElmoBiLm, batch_to_ids, remove_sentence_boundaries
from elmo_core.errors import ConfigurationError

__all__ = [
    "DEFAULT_BATCH_SIZE",
    "DEFAULT_OPTIONS_FILE",
    "DEFAULT_WEIGHT_FILE",
    "Elmo",
    "ElmoEmbedder",
    "ScalarMix",
    "_ElmoBiLm",
    "batch_to_ids",
    "install",
    "remove_sentence_boundaries",
]

log = logging.getLogger(__name__)

# module name ─► the names it offers: AllenNLP's ELMo surface, as downstream code imports it
SURFACE = {
    "allennlp": {},
    "allennlp.modules": {"Elmo": Elmo, "ScalarMix": ScalarMix},
    "allennlp.modules.elmo": {
        "Elmo": Elmo,
        "_ElmoBiLm": _ElmoBiLm,
        "batch_to_ids": batch_to_ids,
        "remove_sentence_boundaries": remove_sentence_boundaries,
    },
    "allennlp.modules.scalar_mix": {"ScalarMix": ScalarMix},
    "allennlp.commands": {},
    "allennlp.commands.elmo": {
        "ElmoEmbedder": ElmoEmbedder,
        "DEFAULT_OPTIONS_FILE": DEFAULT_OPTIONS_FILE,
        "DEFAULT_WEIGHT_FILE": DEFAULT_WEIGHT_FILE,
        "DEFAULT_BATCH_SIZE": DEFAULT_BATCH_SIZE,
        "batch_to_ids": batch_to_ids,
    },
    "allennlp.common": {},
    "allennlp.common.checks": {"ConfigurationError": ConfigurationError},
    "allennlp.nn": {},
    "allennlp.nn.util": {"remove_sentence_boundaries": remove_sentence_boundaries},
}
_said = False


def install() -> bool:
    """Make AllenNLP's ELMo modules importable as this project's objects, where the real AllenNLP is not importable.

    Returns True when installed (or already), False when AllenNLP itself is there: then nothing changes, and that
    is logged once.
    """
    global _said
    if sys.modules.get("allennlp") is not None and getattr(sys.modules["allennlp"], "__elmo_core__", False):
        return True
    if importlib.util.find_spec("allennlp") is not None:
        if not _said:
            log.warning("AllenNLP is installed: elmo_core.allennlp.install() changes nothing (its own ELMo runs)")
            _said = True
        return False
    for name, names in SURFACE.items():
        module = types.ModuleType(name, f"{name}: AllenNLP's ELMo surface, served by elmo_core.allennlp")
        module.__path__ = []  # a package: its submodules import from sys.modules
        module.__elmo_core__ = True  # type: ignore[attr-defined]
        module.__dict__.update(names)
        sys.modules[name] = module
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, module)
    return True
