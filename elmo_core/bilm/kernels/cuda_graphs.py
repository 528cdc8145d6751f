"""CUDA graphs of a fixed-shape piece of work: captured once, replayed with one launch (``layer_steps`` uses them).

Why: a chunk of LSTM steps is a few dozen small kernels whose launches cost more CPU time than the GPU spends in
them; replaying a captured graph launches them all at once. A graph reads and writes fixed addresses, so the work
runs on buffers allocated before the capture (the caller copies its inputs in and its outputs out) and keeps
nothing it allocated alive after the capture: every tensor made inside is a temporary of one replay. That is why the
graphs of one ``GraphPool`` may share its memory pool and be replayed in any order: none holds data in the pool
between replays. Importing this module on a machine without CUDA is harmless; ``available`` says whether graphs run.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from elmo_core.bilm.kernels import switches

WARMUP_RUNS = 2  # before a capture, on a side stream: compiles, cuBLAS workspaces and autotuning happen outside it


def available(device: torch.device) -> tuple[bool, str]:
    """Whether the work on ``device`` can be captured, and if not why (for the kernels line)."""
    if device.type != "cuda":
        return False, "not a CUDA device"
    if switches.off("ELMO_NO_CUDA_GRAPHS"):
        return False, "ELMO_NO_CUDA_GRAPHS=1"
    if not torch.cuda.is_available():
        return False, "no CUDA in this process"
    return True, "CUDA graphs"


class GraphPool:
    """Graphs captured on one device into one memory pool, through one capture stream."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device)
        self.captured = 0

    def capture(self, work: Callable[[], None], restore: Callable[[], None]) -> Callable[[], None]:
        """``work`` run ``WARMUP_RUNS`` times on the capture stream, then captured; ``restore`` is called after
        (the warm-up runs wrote the buffers). Returns the replay."""
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            for _ in range(WARMUP_RUNS):
                work()
        current.wait_stream(self.stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA calls (a server's, a prefetch's) do not break this capture
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"):
            work()
        restore()
        self.captured += 1
        return graph.replay
