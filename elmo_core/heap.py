"""This process's C heap: large buffers kept for reuse, instead of mapped fresh from the kernel on every allocation.

Why: a forward pass allocates many buffers of megabytes to tens of megabytes (each step's products, rows x 4H
floats; layer 0's per-word gates; the char CNN's activations; the answers on their way to Arrow) and frees them
within the pass. glibc's malloc serves every request above its mmap threshold (128 KiB at first, rising to at most
32 MiB as such buffers are freed) with fresh pages from the kernel, and unmaps them on free, so the next pass
page-faults and zeroes every page again. The ManyLangs batch job in int8 spent 7-8 s of its 45-50 s in the kernel
that way, and runs 1.13-1.17x as fast without (``bench/manylangs.py --heap-baseline``, ``docs/benchmarks.md``).

``keep_large_buffers`` raises both thresholds (mmap and trim) to ``THRESHOLD``: such buffers then come from the
heap, and the memory a pass freed serves the next. Not always the very next buffer of the same size: torch asks for
aligned memory, and glibc (2.36) then needs a little more than that size, which the hole a freed buffer left does
not hold when something small was placed right after it. So the first pass or two grow the heap to the working set;
the passes after fault nothing in (``tests/test_heap.py`` counts it). In a process that uses Arrow (it was imported: the
embedding stage writes its tables with it), Arrow's buffers move to the same heap too (its default pool, mimalloc,
gives freed pages back to the kernel as well; ``--heap-baseline`` turns both off). The cost is that memory a process
freed stays with it, up to its peak (an embedding job's or a server's working set, which it needs again on the next
pass).

PyTorch's CPU tuning guide swaps the allocator instead (jemalloc or tcmalloc through ``LD_PRELOAD``); that needs a
library installed and set before the process starts, so we turn glibc's own switch (``mallopt``), which needs
neither. A user's own choice wins: with a preloaded allocator or glibc's malloc settings in the environment, nothing
is changed, and ``ELMO_HEAP=system`` keeps glibc's defaults (a bench's baseline). Elsewhere (macOS, musl) there is
nothing to change.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform
import sys

log = logging.getLogger(__name__)

THRESHOLD = 1 << 30  # buffers below 1 GiB come from the heap; a larger one (rare) is still mapped and unmapped
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (glibc's malloc.h)
SWITCH = "ELMO_HEAP"  # "system": glibc's defaults, unchanged
_USERS_OWN = ("LD_PRELOAD", "GLIBC_TUNABLES", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")

_decided: str | None = None


def keep_large_buffers() -> str:
    """Set this process's heap to keep large buffers (once; later calls return the same line), and say what it did."""
    global _decided
    if _decided is None:
        _decided = _apply()
        log.info("heap: %s", _decided)
    return _decided


def _apply() -> str:
    if os.environ.get(SWITCH, "").strip().lower() == "system":
        return f"glibc's defaults ({SWITCH}=system)"
    own = [name for name in _USERS_OWN if os.environ.get(name)]
    if own:
        return f"as the environment sets it ({', '.join(own)})"
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return "the system's malloc, unchanged"
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    if not (libc.mallopt(_M_MMAP_THRESHOLD, THRESHOLD) and libc.mallopt(_M_TRIM_THRESHOLD, THRESHOLD)):
        return "glibc's defaults (it refused larger thresholds)"
    line = f"buffers under {THRESHOLD >> 30} GiB reused from the heap (glibc's mmap and trim thresholds)"
    arrow = sys.modules.get("pyarrow")
    if arrow is not None and not os.environ.get("ARROW_DEFAULT_MEMORY_POOL"):
        arrow.set_memory_pool(arrow.system_memory_pool())
        line += ", Arrow's too"
    return line
