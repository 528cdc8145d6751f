"""What a client sends and gets: the request bodies (validated by pydantic, so a bad one is a 422 naming its field),
the output a request asks for, what travels between the HTTP process and a model process (``Batch`` there,
``Answer`` back), and the errors a request can meet on its way, each with its HTTP status. Nothing here imports
torch: the HTTP process never loads it."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field

OutputKind = Literal["layers", "mix", "mean"]
Encoding = Literal["float", "base64", "binary"]
OpenAIEncoding = Literal["float", "base64"]
VectorType = Literal["float32", "float16"]

# ``encoding: binary``: a JSON header, then the arrays' bytes, none of it text. Layout: 8 ASCII bytes "ELMOARR1", a
# little-endian uint32 N, N bytes of JSON (the answer without embeddings; each item's ``offset`` and ``nbytes`` into
# what follows, space-padded so the arrays start 8-byte aligned), then every array, little-endian, row-major.
BINARY_MEDIA_TYPE = "application/x-elmo-arrays"
BINARY_MAGIC = b"ELMOARR1"


@dataclass(frozen=True)
class Output:
    """How one request wants its sentences' vectors: every layer, the scalar mix, or the mix averaged over tokens;
    as JSON floats or base64 of little-endian float32/float16 (row-major, ``shape`` says how to read it)."""

    kind: OutputKind = "mix"
    mix_weights: tuple[float, ...] | None = None  # before softmax, one per layer; None: the plain average
    gamma: float = 1.0
    encoding: Encoding = "float"
    dtype: VectorType = "float32"
    normalize: bool = False  # each vector divided by its L2 norm (unit length, as OpenAI's are)


@dataclass
class Batch:
    """Sentences of one or more requests; ``outputs[i]`` is the index in ``specs`` of sentence i's output."""

    id: int
    sentences: list[list[str]]
    outputs: list[int]
    specs: list[Output]

    @property
    def tokens(self) -> int:
        return sum(len(s) for s in self.sentences)


@dataclass
class Answer:
    """A batch's answers: per sentence its ``shape`` and its embedding as JSON text; the seconds it took, and how
    many of its distinct words went through the char CNN (the rest were kept from earlier batches)."""

    id: int
    shapes: list[tuple[int, ...]]
    embeddings: list[bytes]
    seconds: float
    words: int = 0
    new_words: int = 0


class EmbedRequest(BaseModel):
    """``POST /embed``."""

    model_config = ConfigDict(extra="forbid")

    sentences: list[str | list[str]] = Field(
        min_length=1, description="raw text (tokenized as `elmo embed` does) or token lists, one item a sentence"
    )
    output: OutputKind = Field(
        "mix", description="layers: every layer (L+1, n, 2P); mix: the scalar mix (n, 2P); mean: the mix averaged (2P)"
    )
    mix_weights: list[float] | None = Field(None, description="scalar-mix weights before softmax (default: equal)")
    gamma: float = Field(1.0, description="scalar-mix scale")
    encoding: Encoding = Field(
        "float",
        description="float: nested lists; base64: the array's little-endian bytes; binary: an "
        f"{BINARY_MEDIA_TYPE} answer (a JSON header, then the raw arrays)",
    )
    dtype: VectorType = Field("float32", description="the type base64 bytes hold (float lists are rounded to it)")
    normalize: bool = Field(False, description="each vector scaled to unit length (L2)")
    truncate: bool | None = Field(
        None, description="cut sentences past --max-sentence-tokens instead of a 413 (default: --auto-truncate)"
    )

    def output_spec(self) -> Output:
        weights = tuple(self.mix_weights) if self.mix_weights is not None else None
        return Output(self.output, weights, self.gamma, self.encoding, self.dtype, self.normalize)


class EmbeddedSentence(BaseModel):
    index: int
    tokens: list[str]
    shape: list[int]
    embedding: list | str = Field(description="nested float lists, or base64 of the array of ``shape``")


class EmbedResponse(BaseModel):
    model: str
    output: OutputKind
    dtype: VectorType
    data: list[EmbeddedSentence]
    usage: dict[str, int] = Field(description="tokens: the tokens embedded; truncated: sentences cut to the limit")


class OpenAIEmbeddingRequest(BaseModel):
    """``POST /v1/embeddings``: OpenAI's request. Token ids are parsed only to be refused with a 400 that says what
    to send (the biLM reads characters, and the ids are another model's vocabulary); a field OpenAI's API does not
    have, and neither does this one, is refused by name rather than silently ignored."""

    model_config = ConfigDict(extra="forbid")

    input: str | list[str] | list[int] | list[list[int]] = Field(
        description="a text or a list of texts (up to --max-sentences), one vector each (mean of the scalar mix)"
    )
    model: str | None = Field(None, description="accepted and echoed back; the server runs its one model")
    encoding_format: OpenAIEncoding = Field("float", description="float, or base64 of little-endian float32")
    dimensions: int | None = Field(None, description="must be the model's width (2P) where given")
    user: str | None = None
    normalize: bool = Field(True, description="unit-length vectors, as OpenAI's are (false: the raw mean)")
    truncate: bool | None = Field(
        None, description="cut inputs past --max-sentence-tokens instead of a 413 (default: --auto-truncate)"
    )


class OpenAIEmbedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class OpenAIEmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[OpenAIEmbedding]
    model: str
    usage: dict[str, int] = Field(description="prompt_tokens and total_tokens: the tokens embedded")


class RequestError(Exception):
    """A request that cannot be answered with vectors: its HTTP status, one line saying why, extra headers."""

    status = 500

    def __init__(self, message: str, headers: dict[str, str] | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.headers, self.param = headers or {}, param


class TooLarge(RequestError):
    """Over a limit that waiting would not cure (a sentence, a request, a body): 413, naming the limit."""

    status = 413


class BadRequest(RequestError):
    """A request this server understands and will not take (token ids where it reads text): 400, saying what to send."""

    status = 400


class Unprocessable(RequestError):
    """A body that parses but cannot be embedded (an empty sentence, a wrong width): 422, naming the field."""

    status = 422


class QueueFull(RequestError):
    """The queue holds ``--max-queue-tokens`` already: 429, with Retry-After."""

    status = 429


class Unavailable(RequestError):
    """No model process can answer (not warm yet, or the one computing it died): 503."""

    status = 503


class Unauthorized(RequestError):
    status = 401


# --- answers, as bytes: the embeddings arrive encoded from the model processes, and are only joined here ----------
def dumps(value: Any) -> bytes:
    return orjson.dumps(value)


def _join(parts: Sequence[bytes]) -> bytes:
    return b"[" + b",".join(parts) + b"]"


def embed_body(
    head: dict[str, Any], tokens: Sequence[list[str]], shapes: Sequence[tuple], embeddings: Sequence[bytes], usage: dict
) -> bytes:
    """``/embed``'s JSON answer: ``head``, then ``data`` (each sentence's tokens, shape and embedding), ``usage``."""
    items = [
        b'{"index":%d,"tokens":%s,"shape":%s,"embedding":%s}' % (i, dumps(t), dumps(list(shape)), vectors)
        for i, (t, shape, vectors) in enumerate(zip(tokens, shapes, embeddings))
    ]
    return dumps(head)[:-1] + b',"data":' + _join(items) + b',"usage":' + dumps(usage) + b"}"


def binary_body(
    head: dict[str, Any], tokens: Sequence[list[str]], shapes: Sequence[tuple], arrays: Sequence[bytes], usage: dict
) -> bytes:
    """``/embed``'s ``binary`` answer (``BINARY_MEDIA_TYPE``): the JSON answer without embeddings, each item saying
    where its array's bytes are, then the arrays themselves: no float is written as text or base64."""
    items, offset = [], 0
    for i, (t, shape, array) in enumerate(zip(tokens, shapes, arrays)):
        items.append({"index": i, "tokens": t, "shape": list(shape), "offset": offset, "nbytes": len(array)})
        offset += len(array)
    header = dumps({**head, "data": items, "usage": usage})
    header += b" " * (-(len(BINARY_MAGIC) + 4 + len(header)) % 8)  # the arrays start 8-byte aligned
    return BINARY_MAGIC + struct.pack("<I", len(header)) + header + b"".join(arrays)


def openai_body(model: str, embeddings: Sequence[bytes], usage: dict[str, int]) -> bytes:
    """OpenAI's embeddings answer: ``{"object": "list", "data": [{"object", "index", "embedding"}], "model",
    "usage"}``."""
    items = [b'{"object":"embedding","index":%d,"embedding":%s}' % (i, v) for i, v in enumerate(embeddings)]
    return b'{"object":"list","data":' + _join(items) + b',"model":' + dumps(model) + b',"usage":' + dumps(usage) + b"}"
