"""A sentence's answer as its request asked for it, in the model process (torch-free: the ONNX Runtime model processes
use it too), so that the HTTP process only joins bytes. A batch's arrays (``Computed``) are encoded by the model
process's answer thread while its next batch computes (``workers.worker_main``)."""

from __future__ import annotations

import base64
from dataclasses import dataclass

import numpy as np
import orjson

from elmo_core.serve.api import Answer, Batch, Output

EMPTY = np.zeros(0, dtype=np.float32)  # a sentence's place in ``Computed.arrays`` until its array is there


@dataclass
class Computed:
    """A batch's vectors as the model gave them, one array per sentence, shaped as its request asked but not yet
    encoded; ``seconds``: the model's time on it; ``words`` and ``new_words`` as ``Answer`` has them."""

    id: int
    arrays: list[np.ndarray]
    seconds: float
    words: int = 0
    new_words: int = 0

    def answer(self, batch: Batch) -> Answer:
        """Each sentence's array encoded as its request asked."""
        specs = [batch.specs[k] for k in batch.outputs]
        embeddings = [encode(array, spec) for array, spec in zip(self.arrays, specs, strict=True)]
        shapes = [array.shape for array in self.arrays]
        return Answer(self.id, shapes, embeddings, self.seconds, self.words, self.new_words)


def encode(array: np.ndarray, spec: Output) -> bytes:
    """An embedding as its request asked: JSON text (nested lists, each float32 in its shortest form that reads back
    exactly, or float16 rounded; orjson writes them 20x as fast as ``json.dumps(array.tolist())``, whose 17-digit
    doubles made answers twice as long), a base64 string of its bytes, or the raw little-endian bytes (``binary``).
    ``normalize``: each vector (the last axis) divided by its L2 norm first, as OpenAI's are unit length."""
    if spec.normalize:
        norms = np.linalg.norm(array, axis=-1, keepdims=True)
        array = array / np.maximum(norms, np.finfo(np.float32).tiny)
    typed = np.ascontiguousarray(array, dtype="<f2" if spec.dtype == "float16" else "<f4")
    if spec.encoding == "binary":
        return typed.tobytes()
    if spec.encoding == "base64":
        return b'"' + base64.b64encode(typed.tobytes()) + b'"'
    return orjson.dumps(typed, option=orjson.OPT_SERIALIZE_NUMPY)
