"""Weights derived from a model's parameters (stacked, transposed, cast to bf16, packed for oneDNN), kept between
inference calls and rebuilt when a parameter changes.

Why: building them costs as much as several forward passes on small batches (the bf16 ``[W_ih; W_hh]`` of the
original shape above all), so a prepared model makes them once. A parameter changes in place
(an optimizer step, ``load_state_dict``, a user's ``with torch.no_grad(): w += ...``) or is replaced (``.to()``);
the key notices both: every parameter's storage address and its version counter, which PyTorch bumps on each
in-place write. ``Tensor._version`` is not public API, but it is what autograd itself relies on to detect such
writes, and it is read here only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from torch import nn

Derived = TypeVar("Derived")


def _key(modules: Sequence[nn.Module]) -> tuple:
    return tuple((p.data_ptr(), p._version) for module in modules for p in module.parameters())


class WeightCache:
    """``get(modules, kind, make)``: ``make()``'s result, kept until a parameter of ``modules`` changes."""

    def __init__(self) -> None:
        self._entries: dict[tuple[int, str], tuple[tuple, object]] = {}

    def get(self, modules: Sequence[nn.Module], kind: str, make: Callable[[], Derived]) -> Derived:
        slot, key = (id(modules[0]), kind), _key(modules)
        entry = self._entries.get(slot)
        if entry is None or entry[0] != key:
            entry = self._entries[slot] = (key, make())
        return entry[1]  # type: ignore[return-value]

    def clear(self) -> None:
        self._entries.clear()
