"""``elmo serve`` as applications' clients meet it: OpenAI's client on its defaults, the request shapes frameworks
send, Python's urllib, requests and httpx as they are, and the answers a tagger reads (JSON floats, base64, binary
arrays). A real server process on a free port serves the fixture biLM; every expected vector is the fixture's own
``embed_sentences``."""

from __future__ import annotations

import json
import re
import struct
import urllib.error
import urllib.request
from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from elmo_core import BiLM
from tests.helpers import stop_group
from tests.test_serve import MODEL, _ready, _serve, decode, metric

ARGS = [
    *("--max-sentence-tokens", "40", "--max-body-bytes", "200000", "--max-answer-floats", "5000", "--auto-truncate"),
    *("--max-queue-tokens", "4096", "--max-request-tokens", "20000"),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    proc, base = _serve(tmp_path_factory.mktemp("clients"), *ARGS)
    try:
        _ready(base)
        yield base
    finally:
        stop_group(proc)


@pytest.fixture(scope="module")
def bilm() -> BiLM:
    return BiLM.from_pretrained(str(MODEL))


def unit(vector: np.ndarray) -> np.ndarray:
    return vector / np.linalg.norm(vector)


def read_binary(body: bytes) -> tuple[dict, list[np.ndarray]]:
    """A client's whole reader of ``application/x-elmo-arrays``: the magic, the header's length, the header, arrays."""
    assert body[:8] == b"ELMOARR1"
    (n,) = struct.unpack_from("<I", body, 8)
    head, start = json.loads(body[12 : 12 + n]), 12 + n
    assert start % 8 == 0
    dtype = np.dtype("<f2" if head["dtype"] == "float16" else "<f4")
    arrays = [
        np.frombuffer(body, dtype, item["nbytes"] // dtype.itemsize, start + item["offset"]).reshape(item["shape"])
        for item in head["data"]
    ]
    return head, arrays


def test_binary_answer_holds_the_arrays(server: str, bilm: BiLM) -> None:
    sentences = [["I", "ate", "an", "apple", "."], ["Apple", "shares", "rose", "."]]
    body = {"sentences": sentences, "output": "layers", "encoding": "binary"}
    answer = httpx.post(f"{server}/embed", json=body)
    assert answer.status_code == 200 and answer.headers["content-type"] == "application/x-elmo-arrays"
    head, arrays = read_binary(answer.content)
    assert [item["tokens"] for item in head["data"]] == sentences and head["usage"] == {"tokens": 9, "truncated": 0}
    for got, want in zip(arrays, bilm.embed_sentences(sentences)):
        np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
    half = httpx.post(f"{server}/embed", json={**body, "output": "mean", "dtype": "float16"})
    _, (first, _) = read_binary(half.content)
    np.testing.assert_allclose(first, bilm.embed_sentences(sentences[:1])[0].mean(0).mean(0), atol=2e-3)


def test_json_floats_are_float32_read_back_exactly_in_their_shortest_form(server: str) -> None:
    """The JSON floats are the float32 values themselves: parsed as float32 they equal the base64 bytes bit for bit,
    in at most 9 significant digits (float32's shortest round trip), not 17-digit doubles."""
    body = {"sentences": [["Apple", "shares", "rose", "."]], "output": "layers"}
    text = httpx.post(f"{server}/embed", json=body).text
    exact = decode(httpx.post(f"{server}/embed", json={**body, "encoding": "base64"}).json()["data"][0])
    floats = np.array(json.loads(text)["data"][0]["embedding"], dtype=np.float32)
    assert np.array_equal(floats, exact)
    written = re.findall(r"(-?\d+(?:\.\d+)?)(?:e-?\d+)?", text[text.index('"embedding":') : text.index('"usage"')])
    digits = [len(number.lstrip("-").replace(".", "").lstrip("0")) for number in written]
    assert len(written) == floats.size and max(digits) <= 9, max(digits)


def test_an_answer_past_max_answer_floats_is_413_naming_it(server: str) -> None:
    """Layers of 53 tokens are 53 x 3 x 32 = 5,088 floats, past the server's 5,000; their mean is 32 a sentence."""
    sentences = [["w"] * 27, ["v"] * 26]
    answer = httpx.post(f"{server}/embed", json={"sentences": sentences, "output": "layers"})
    assert answer.status_code == 413, answer.text
    assert "5,088 floats" in answer.json()["error"]["message"] and "--max-answer-floats 5,000" in answer.text
    assert httpx.post(f"{server}/embed", json={"sentences": sentences, "output": "mean"}).status_code == 200


def test_a_too_large_body_is_a_json_413_to_urllib_requests_and_httpx(server: str) -> None:
    """24 MB to /embed, past --max-body-bytes: every client reads the 413, urllib included, which sends the whole
    body before it reads and asks for the connection to close (a server that answers and closes at once resets
    the connection under it: "connection reset by peer")."""
    import requests

    body = b'{"sentences": ["' + b"a " * (12 << 20) + b'"]}'
    request = urllib.request.Request(f"{server}/embed", data=body, headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=60)
    assert refused.value.code == 413 and "--max-body-bytes" in json.loads(refused.value.read())["error"]["message"]
    for answer in (
        requests.post(f"{server}/embed", data=body, headers={"Content-Type": "application/json"}, timeout=60),
        httpx.post(f"{server}/embed", content=body, headers={"Content-Type": "application/json"}, timeout=60),
    ):
        assert answer.status_code == 413 and "--max-body-bytes" in answer.json()["error"]["message"]
    assert httpx.post(f"{server}/embed", json={"sentences": ["after it"]}).status_code == 200


def test_openai_client_on_its_defaults_with_2048_inputs(server: str, bilm: BiLM) -> None:
    """OpenAI's client as an application calls it (a model name of OpenAI's, base64 by default, unit vectors
    expected): 2,048 inputs in one request, each the unit mean of its sentence's mix, batched across the queue;
    their 12,288 tokens pass the queue's 4,096, so the request waits for an empty queue, not a 413. Past
    --max-request-tokens, a 413 naming it."""
    import openai

    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused")
    texts = [f"Sentence {i} is about apples." for i in range(2048)]
    batches = metric(server, "elmo_batch_tokens_count")
    answer = client.embeddings.create(model="text-embedding-3-small", input=texts)
    assert answer.model == "allennlp_elmo" and len(answer.data) == 2048  # the model that made them, not the name sent
    assert answer.usage.prompt_tokens == 2048 * 6
    assert metric(server, "elmo_batch_tokens_count") - batches >= 2048 * 6 / 4096  # in forward passes of <= 4,096
    want = [unit(x.mean(0).mean(0)) for x in bilm.embed_sentences([t[:-1].split() + ["."] for t in texts[:3]])]
    for item, vector in zip(answer.data, want):
        np.testing.assert_allclose(item.embedding, vector, atol=1e-6)
    assert all(abs(np.linalg.norm(item.embedding) - 1) < 1e-5 for item in answer.data)
    one = client.embeddings.create(model="elmo", input="Apple shares rose.", encoding_format="float")
    np.testing.assert_allclose(
        one.data[0].embedding,
        unit(bilm.embed_sentences([["Apple", "shares", "rose", "."]])[0].mean(0).mean(0)),
        atol=1e-6,
    )
    assert [m.id for m in client.models.list()] == ["allennlp_elmo"]
    with pytest.raises(openai.APIStatusError, match="--max-request-tokens 20,000") as refused:
        client.embeddings.create(model="elmo", input=[f"{t} and {t}" for t in texts])
    assert refused.value.status_code == 413


def test_token_ids_are_a_400_that_says_what_to_send(server: str) -> None:
    import openai

    for ids in ([101, 2023, 102], [[101, 2023], [102]]):
        answer = httpx.post(f"{server}/v1/embeddings", json={"input": ids, "model": "text-embedding-ada-002"})
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "input"
        assert "send the texts themselves" in answer.json()["error"]["message"]
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="send the texts themselves"):
        client.embeddings.create(model="text-embedding-ada-002", input=[[101, 2023, 102]])


def test_truncate_per_request_and_auto_truncate(server: str, bilm: BiLM) -> None:
    """This server runs with --auto-truncate: a 50-token input is cut to --max-sentence-tokens 40 and the answer
    says so; ``truncate: false`` asks for the 413 instead."""
    words = [f"w{i}" for i in range(50)]
    cut = httpx.post(f"{server}/embed", json={"sentences": [words], "output": "mean", "encoding": "base64"}).json()
    assert cut["usage"] == {"tokens": 40, "truncated": 1} and cut["data"][0]["tokens"] == words[:40]
    np.testing.assert_allclose(decode(cut["data"][0]), bilm.embed_sentences([words[:40]])[0].mean(0).mean(0), atol=1e-6)
    refused = httpx.post(f"{server}/v1/embeddings", json={"input": " ".join(words), "truncate": False})
    assert refused.status_code == 413 and "--max-sentence-tokens 40" in refused.json()["error"]["message"]
    openai_cut = httpx.post(f"{server}/v1/embeddings", json={"input": [" ".join(words), "short ."]}).json()
    assert openai_cut["usage"] == {"prompt_tokens": 42, "total_tokens": 42, "truncated": 1}


def test_normalize_unknown_fields_and_what_info_says(server: str, bilm: BiLM) -> None:
    raw = httpx.post(f"{server}/v1/embeddings", json={"input": "Apple shares rose .", "normalize": False}).json()
    mean = bilm.embed_sentences([["Apple", "shares", "rose", "."]])[0].mean(0)
    np.testing.assert_allclose(raw["data"][0]["embedding"], mean.mean(0), atol=1e-6)
    tokens = httpx.post(f"{server}/embed", json={"sentences": ["Apple shares rose ."], "normalize": True}).json()
    np.testing.assert_allclose(
        tokens["data"][0]["embedding"], mean / np.linalg.norm(mean, axis=-1, keepdims=True), atol=1e-6
    )
    for route, body in (("/v1/embeddings", {"input": "a"}), ("/embed", {"sentences": ["a"]})):
        answer = httpx.post(f"{server}{route}", json={**body, "truncation_direction": "left"})
        assert answer.status_code == 422 and answer.json()["error"]["param"] == "truncation_direction"
        assert "unknown field truncation_direction" in answer.json()["error"]["message"]
    info = httpx.get(f"{server}/info").json()
    assert info["normalize"] == {"/embed": False, "/v1/embeddings": True} and info["truncate"] is True
    assert info["tokenizer"] == "unicode" and info["limits"]["max_sentences"] == 2048


def test_raw_text_is_tokenized_with_its_punctuation_apart(server: str) -> None:
    """Prose as applications send it: "apple." is two tokens, as `elmo embed --tokenizer unicode` makes them, and
    the vectors are those of the token list."""
    text = httpx.post(f"{server}/embed", json={"sentences": ["I ate an apple, didn't I?"], "encoding": "base64"})
    item = text.json()["data"][0]
    assert item["tokens"] == ["I", "ate", "an", "apple", ",", "didn't", "I", "?"]
    listed = httpx.post(f"{server}/embed", json={"sentences": [item["tokens"]], "encoding": "base64"}).json()
    assert np.array_equal(decode(item), decode(listed["data"][0]))


def test_an_openai_request_from_frameworks_plain_shapes(server: str) -> None:
    """What frameworks send besides OpenAI's client: a bare string, ``user`` and ``dimensions``, a key the server
    does not ask for; errors in OpenAI's shape."""
    answer = httpx.post(
        f"{server}/v1/embeddings",
        json={"input": "Hello world.", "model": "m", "user": "u1", "dimensions": 32, "encoding_format": "float"},
        headers={"Authorization": "Bearer sk-anything"},
    )
    assert answer.status_code == 200 and len(answer.json()["data"][0]["embedding"]) == 32
    wrong = httpx.post(f"{server}/v1/embeddings", json={"input": []})
    assert wrong.status_code == 422 and set(wrong.json()["error"]) == {"message", "type", "param", "code"}
