"""Training batches made ahead of the step: a background thread per process fills a bounded queue.

The thread runs the batch generator (``batches.LMBatcher``), turns each window into int64 tensors (pinned, and
copied to the GPU on a side stream, where the run is on CUDA) and queues them with the generator's position after
them. The trainer takes the next one; a checkpoint keeps the position after the last batch *taken*, so batches made
ahead and not yet trained on are made again after a resume, and the resumed run sees exactly the batches the
uninterrupted one would have. ``depth: 0`` makes each batch inside the step, as before.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from typing import Any

import numpy as np
import torch
from torch import Tensor

from elmo_core.data.batches import LMBatcher

KEYS = ("tokens_characters", "tokens_characters_reverse", "next_token_id", "next_token_id_reverse")
_END = object()


def to_tensors(batch: dict[str, np.ndarray], device: torch.device, stream: Any = None) -> dict[str, Tensor]:
    """The arrays the trainer reads, as int64 tensors on ``device`` (on CUDA: pinned, copied on ``stream``)."""
    tensors = {k: torch.from_numpy(np.ascontiguousarray(batch[k])).long() for k in KEYS}
    if device.type != "cuda":
        return tensors
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        return {k: t.pin_memory().to(device, non_blocking=True) for k, t in tensors.items()}


class Prefetcher:
    """``next()`` gives the next batch's tensors; ``state_dict()`` is the generator's position after it."""

    def __init__(self, batcher: LMBatcher, device: torch.device, depth: int = 4) -> None:
        self.batcher, self.device, self.depth = batcher, device, depth
        self._taken = batcher.snapshot()  # the position after the last batch handed out
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    # ----- the consumer side ------------------------------------------------------------------------
    def next(self) -> dict[str, Tensor] | None:
        """The next batch (None when a finite pass is over)."""
        if self.depth == 0:
            batch = self.batcher.next_batch()
            self._taken = self.batcher.snapshot()
            return None if batch is None else to_tensors(batch, self.device)
        if self._thread is None:
            self._start()
        item = self._queue.get()  # type: ignore[union-attr]
        if item is _END:
            return None
        if isinstance(item, BaseException):
            raise item
        tensors, position, event = item
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)  # the copy is done before the step reads
        self._taken = position
        return tensors

    def state_dict(self) -> dict[str, Any]:
        return self.batcher.state_of(self._taken)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.close()
        self.batcher.load_state_dict(state)
        self._taken = self.batcher.snapshot()

    def close(self) -> None:
        """Stop the thread, drop what it made ahead, and put the generator back after the last batch taken."""
        if self._thread is None:
            return
        self._stop.set()
        while self._thread.is_alive():
            try:
                self._queue.get(timeout=0.05)  # type: ignore[union-attr]  # unblock a put on a full queue
            except queue.Empty:
                pass
        self._thread.join()
        self._thread, self._queue = None, None
        self._stop.clear()
        self.batcher.restore(self._taken)

    # ----- the producer side ------------------------------------------------------------------------
    def _start(self) -> None:
        self._queue = queue.Queue(maxsize=self.depth)
        self._thread = threading.Thread(target=self._produce, name="elmo-prefetch", daemon=True)
        self._thread.start()

    def _produce(self) -> None:
        q = self._queue
        try:
            while not self._stop.is_set():
                batch = self.batcher.next_batch()
                if batch is None:
                    self._put(q, _END)
                    return
                position = self.batcher.snapshot()
                tensors = to_tensors(batch, self.device, self._stream)
                event = None
                if self._stream is not None:
                    event = torch.cuda.Event()
                    event.record(self._stream)
                self._put(q, (tensors, position, event))
        except BaseException as exc:  # handed to the trainer, which raises it in its own thread
            self._put(q, exc)

    def _put(self, q: queue.Queue, item: Any) -> None:
        while not self._stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return
            except queue.Full:
                continue
