"""CUDA paths (run with ``pytest -m gpu`` on a machine with a GPU; deselected by default)."""

import json
import os

import numpy as np
import pytest
import torch

from elmo_core import BiLM

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SENTENCES = [["I", "ate", "an", "apple", "."], ["苹果", "手机"], ["x"] * 40, []]


def test_cuda_float32_matches_cpu(allennlp_dir):
    cpu = BiLM.from_pretrained(str(allennlp_dir))
    gpu = BiLM.from_pretrained(str(allennlp_dir), device="cuda")
    for a, b in zip(cpu.embed_sentences(SENTENCES), gpu.embed_sentences(SENTENCES)):
        np.testing.assert_allclose(a, b, atol=1e-4)


def test_cuda_bf16_autocast_is_close(allennlp_dir):
    cpu = BiLM.from_pretrained(str(allennlp_dir))
    gpu = BiLM.from_pretrained(str(allennlp_dir), device="cuda")
    for a, b in zip(cpu.embed_sentences(SENTENCES), gpu.embed_sentences(SENTENCES, precision="bf16")):
        assert a.shape == b.shape and b.dtype == np.float32
        np.testing.assert_allclose(a, b, atol=0.1)


def test_cudnn_fused_path_matches_general_on_cuda():
    from elmo_core import batch_to_ids
    from elmo_core.bilm.initialization import init_bilm_tf
    from elmo_core.config import tiny

    torch.manual_seed(0)
    config = tiny().model_copy(update={"lstm": tiny().lstm.model_copy(update={"cell_clip": None, "proj_clip": None})})
    bilm = BiLM(config)
    init_bilm_tf(bilm)
    bilm = bilm.cuda().eval()
    ids = batch_to_ids(SENTENCES).cuda()
    with torch.no_grad():
        assert bilm.prepare("fp32").nn_lstm  # cuDNN, as chosen for a model without clips
        fused = bilm(ids)["activations"]
        bilm.prepare("fp32", nn_lstm=False)
        for x, y in zip(fused, bilm(ids)["activations"]):
            assert torch.allclose(x, y, atol=1e-4)


def test_allennlp_drop_in_on_cuda_matches_the_cpu(allennlp_dir):
    from elmo_core.allennlp import Elmo, ElmoEmbedder, batch_to_ids

    files = str(allennlp_dir / "options.json"), str(allennlp_dir / "lm_weights.hdf5")
    cpu, gpu = ElmoEmbedder(*files), ElmoEmbedder(*files, cuda_device=0)
    for a, b in zip(cpu.embed_batch(SENTENCES), gpu.embed_batch(SENTENCES)):
        np.testing.assert_allclose(a, b, atol=1e-4)
    elmo = Elmo(*files, 1, dropout=0.0)
    ids = batch_to_ids(SENTENCES)
    with torch.no_grad():
        on_cpu = elmo(ids)["elmo_representations"][0]
        on_gpu = elmo.to("cuda")(ids.cuda())["elmo_representations"][0]
    torch.testing.assert_close(on_gpu.cpu(), on_cpu, atol=1e-4, rtol=0)


def test_training_on_cuda_picks_bf16_prefetches_to_the_gpu_and_resumes_exactly(tmp_path, bilm_tf_dir):
    """precision auto on a bf16 GPU is bf16; batches arrive on the GPU from the prefetch thread (pinned, side stream);
    a resumed run continues with the losses of an uninterrupted one."""
    from elmo_core.data.vocab import VocabConfig, build_vocab
    from elmo_core.ingest import IngestConfig, ingest
    from elmo_core.train.loop import TrainConfig, setup, train

    ingest(IngestConfig(sources=[str(bilm_tf_dir / "train" / "data.txt")], out=str(tmp_path / "i"), heldout_fraction=0))
    build_vocab(
        VocabConfig(corpus=str(tmp_path / "i"), db=str(tmp_path / "v" / "v.duckdb"),
                    vocab_file=str(bilm_tf_dir / "train" / "vocab.txt"))
    )  # fmt: skip
    options = {"data": str(tmp_path / "v"), "batch_size": 2, "unroll_steps": 10, "n_negative_samples_batch": 16,
               "tracking": "none", "device": "cuda", "checkpoint_every": 5}  # fmt: skip
    run = setup(TrainConfig(out=str(tmp_path / "probe"), **options))
    assert run.precision == ("bf16" if torch.cuda.is_bf16_supported(including_emulation=False) else "fp32")
    batch = run.batches.next()
    assert batch["tokens_characters"].is_cuda
    run.batches.close()
    full = train(TrainConfig(out=str(tmp_path / "full"), max_steps=10, **options))
    train(TrainConfig(out=str(tmp_path / "half"), max_steps=5, **options))
    resumed = train(TrainConfig(out=str(tmp_path / "half"), max_steps=10, resume=True, **options))
    assert resumed.final_loss == pytest.approx(full.final_loss, rel=1e-3)  # CUDA's atomic adds reorder sums


def test_two_gpu_ranks_train_with_nccl_to_identical_weights(tmp_path, bilm_tf_dir):
    """nproc_per_node 2 on a machine with two GPUs: NCCL, one rank per GPU, identical replicas at the end."""
    import subprocess
    import sys

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    from elmo_core.data.vocab import VocabConfig, build_vocab
    from elmo_core.ingest import IngestConfig, ingest

    ingest(IngestConfig(sources=[str(bilm_tf_dir / "train" / "data.txt")], out=str(tmp_path / "i"), heldout_fraction=0))
    build_vocab(
        VocabConfig(corpus=str(tmp_path / "i"), db=str(tmp_path / "v" / "v.duckdb"),
                    vocab_file=str(bilm_tf_dir / "train" / "vocab.txt"))
    )  # fmt: skip
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"data": str(tmp_path / "v"), "out": str(tmp_path / "run"), "batch_size": 2,
                                  "unroll_steps": 10, "n_negative_samples_batch": 16, "tracking": "none",
                                  "device": "cuda", "max_steps": 20, "nproc_per_node": 2}))  # fmt: skip
    subprocess.run([sys.executable, "-m", "elmo_core.cli", "train", "--config", str(config)], check=True, timeout=600)
    digests = json.loads((tmp_path / "run" / "ddp_weights.json").read_text())
    assert len(digests) == 2 and len(set(digests)) == 1


# ----- the clipped recurrence a layer at a time (kernels/layer_steps.py), the batch job and the server on CUDA -----

NO_TF32 = {**os.environ, "NVIDIA_TF32_OVERRIDE": "0"}  # a child's cuDNN convolutions in true fp32 (the rest kept)


@pytest.fixture
def no_tf32():
    """fp32 products and convolutions without TF32 in this process: the fixtures' 1e-5 is a float32 promise."""
    before = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = before


LAYER_CHOICES = [
    {"compiled": True, "graphs": True},  # CUDA's default
    {"compiled": False, "graphs": True},
    {"compiled": True, "graphs": False},
]


def _stateful_protocol_error(bilm: BiLM, fixture_sentences, expected_pattern) -> float:
    """The TensorFlow fixtures' stateful protocol (``tests/test_model_fixtures.py``) with the model on CUDA."""
    import h5py

    from elmo_core import batch_to_ids

    state, worst = None, 0.0
    with torch.no_grad():
        for i in range(10):
            batch = [fixture_sentences[k][i].split() for k in range(3)]
            out = bilm(batch_to_ids(batch).cuda(), state=state)
            state, top = out["state"], out["activations"][-1].cpu().numpy()
            for k in range(3):
                with h5py.File(str(expected_pattern).format(k=k)) as f:
                    want = np.concatenate([f[str(i)][0], f[str(i)][1]], axis=-1)
                worst = max(worst, float(np.abs(top[k, : len(batch[k])] - want).max()))
    return worst


@pytest.mark.parametrize("choices", LAYER_CHOICES)
def test_the_fast_recurrence_is_the_reference_cell_on_cuda_in_fp32(no_tf32, choices, allennlp_dir, fixture_sentences):
    """Against the reference ``LstmCell`` on the same GPU (1e-5, every layer and the state, from zero and from a
    carried state) and against the TensorFlow fixture's stateful protocol (1e-5), rows dropping out as sentences end."""
    from elmo_core import batch_to_ids

    bilm = BiLM.from_pretrained(str(allennlp_dir), device="cuda")
    kernels = bilm.prepare("fp32", **choices)
    assert kernels.layer_at_once and kernels.graphs == choices["graphs"], kernels
    assert kernels.compiled == choices["compiled"], f"torch.compile off on CUDA: {kernels}"
    ids = batch_to_ids(SENTENCES[:3] + [["x"] * 90] + [[f"w{i}" for i in range(n)] for n in range(1, 30)]).cuda()
    for state in (None, "carried"):
        with torch.no_grad():
            bilm.kernels = kernels
            start = bilm(ids)["state"] if state else None
            fast = bilm(ids, state=start)
            bilm.kernels = None
            reference = bilm(ids, state=start)
        for x, y in zip(fast["activations"], reference["activations"], strict=True):
            torch.testing.assert_close(x, y, atol=1e-5, rtol=0)
        for x, y in zip(fast["state"], reference["state"], strict=True):
            torch.testing.assert_close(x.float(), y.float(), atol=1e-5, rtol=0)
    bilm.kernels = kernels
    assert _stateful_protocol_error(bilm, fixture_sentences, allennlp_dir / "lm_embeddings_{k}.hdf5") < 1e-5


def test_the_fast_recurrence_in_bf16_on_cuda_is_as_close_to_fp32_as_the_reference(allennlp_dir, fixture_sentences):
    """bf16 (products in bfloat16, gates and cell in float32) by cosine to fp32, as tests/test_precision.py holds the
    CPU's, and as close as the reference cell's own bf16 on the GPU."""
    if not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16")
    bilm = BiLM.from_pretrained(str(allennlp_dir), device="cuda")
    sentences = [s.split() for k in fixture_sentences for s in k]
    exact = bilm.embed_sentences(sentences)
    assert bilm.prepare("bf16").layer_at_once
    fast = bilm.embed_sentences(sentences, precision="bf16")
    bilm.prepare("bf16", layer_at_once=False)
    reference = bilm.embed_sentences(sentences, precision="bf16")
    for layer in range(bilm.num_layers):
        a, b, r = (np.concatenate([x[layer] for x in v]) for v in (exact, fast, reference))
        cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
        cos_ref = (a * r).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(r, axis=1))
        assert cos.min() >= 0.999 and np.abs(a - b).max() < 0.05
        assert cos.min() >= cos_ref.min() - 1e-3


def test_the_runtime_on_cuda_says_its_kernels_and_a_budget_from_the_gpu_s_memory(allennlp_dir):
    from elmo_core.runtime import Runtime
    from elmo_core.runtime.engine import MAX_BATCH_TOKENS

    runtime = Runtime.open(str(allennlp_dir), device="cuda")
    assert runtime.max_batch_tokens > MAX_BATCH_TOKENS and "CUDA: a quarter of" in runtime.budget_why
    assert "the clipped LSTM a layer at a time" in runtime.line() and "replayed as CUDA graphs" in runtime.line()


def _embed_table(tmp_path, allennlp_dir, device: str, *more: str):
    import pyarrow.dataset as ds

    from tests.helpers import run_elmo

    text = tmp_path / "text.txt"
    lines = [" ".join(s) for s in SENTENCES if s] + [" ".join(f"w{i % 37}" for i in range(n)) for n in range(1, 60)]
    text.write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / f"emb-{device}"
    command = ["embed", "--model", str(allennlp_dir), "--input", str(text), "--out", str(out), "--layers", "all"]
    result = run_elmo(*command, "--device", device, *more, env=NO_TF32)
    assert result.returncode == 0, result.stderr[-2000:]
    table = ds.dataset(str(out), format="parquet").to_table().to_pandas()
    return table.sort_values(["doc_id", "sentence_id", "token_index"]).reset_index(drop=True), result.stderr


def test_an_embedding_job_on_cuda_writes_the_cpu_s_table(tmp_path, allennlp_dir):
    on_cpu, _ = _embed_table(tmp_path, allennlp_dir, "cpu")
    on_gpu, log = _embed_table(tmp_path, allennlp_dir, "cuda")
    assert "on cuda" in log and "a layer at a time" in log
    units = json.loads((tmp_path / "emb-cuda" / "_manifest.json").read_text())["units"]
    assert all(u["device"] == f"cuda {torch.cuda.get_device_properties(0).uuid}" for u in units), units
    assert list(on_gpu["token"]) == list(on_cpu["token"])
    for column in [c for c in on_cpu.columns if c.startswith("layer_")]:
        np.testing.assert_allclose(np.stack(on_gpu[column]), np.stack(on_cpu[column]), atol=1e-5, rtol=0)


def test_an_embedding_job_takes_every_gpu_one_process_each(tmp_path, allennlp_dir):
    """Several GPUs: one process per GPU over the units (``gpu_processes``), the same table as the CPU's."""

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    on_cpu, _ = _embed_table(tmp_path, allennlp_dir, "cpu")
    on_gpus, log = _embed_table(tmp_path, allennlp_dir, "cuda", "--unit-tokens", "100")
    assert "one process per GPU (0, 1" in log
    units = json.loads((tmp_path / "emb-cuda" / "_manifest.json").read_text())["units"]
    assert len({u["pid"] for u in units}) >= 2
    gpu_of = {u["pid"]: u["device"] for u in units}  # each process on a GPU of its own, named by its UUID
    assert len(set(gpu_of.values())) == len(gpu_of) and all(d.startswith("cuda ") for d in gpu_of.values()), units
    assert list(on_gpus["token"]) == list(on_cpu["token"])
    for column in [c for c in on_cpu.columns if c.startswith("layer_")]:
        np.testing.assert_allclose(np.stack(on_gpus[column]), np.stack(on_cpu[column]), atol=1e-5, rtol=0)


def test_a_server_on_cuda_answers_what_the_runtime_gives(no_tf32, tmp_path, allennlp_dir):
    import base64
    import sys
    import time

    import httpx

    from elmo_core.runtime import Runtime
    from tests.helpers import free_port, start_server, stop_group

    port = free_port()
    command = [
        sys.executable,
        "-m",
        "elmo_core.cli",
        "serve",
        str(allennlp_dir),
        "--port",
        str(port),
        "--device",
        "cuda",
    ]
    server = start_server(command, f"http://127.0.0.1:{port}/health", tmp_path / "serve.log", env=NO_TF32)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300  # the model process compiles and captures on its first batches
        while httpx.get(f"{base}/ready").status_code != 200:
            assert time.monotonic() < deadline, "the CUDA server never became ready"
            time.sleep(0.1)
        sentences = [s for s in SENTENCES if s]
        body = {"sentences": sentences, "output": "layers", "encoding": "base64"}
        answer = httpx.post(f"{base}/embed", json=body, timeout=120).json()
        info = httpx.get(f"{base}/info").json()
        assert "cuda" in info["device"] and "a layer at a time" in info["kernels"], info
    finally:
        stop_group(server)
    expected = Runtime.open(str(allennlp_dir), device="cuda").embed(sentences)
    for item, want in zip(answer["data"], expected, strict=True):
        got = np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4").reshape(item["shape"])
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_a_manylangs_release_on_cuda_gives_their_numbers(no_tf32, tmp_path, monkeypatch):
    """An ELMoForManyLangs folder (their dictionaries, word embedding and layer 0) runs on CUDA in fp32 within 1e-5
    of their network written out from the description, and in bf16 by cosine, as on the CPU."""
    from elmo_core.runtime import Runtime
    from tests.test_manylangs import SENTENCES as THEIRS
    from tests.test_manylangs import SMALL, WORDS, reference_layers, write_release

    monkeypatch.setenv("ELMO_CACHE_DIR", str(tmp_path / "cache"))
    release = write_release(tmp_path / "zhs.model", SMALL, WORDS)
    with torch.no_grad():
        expected = [reference_layers(release, s) for s in THEIRS]
    for precision, close in (("fp32", None), ("bf16", 0.99)):
        runtime = Runtime.open(str(release), device="cuda", precision=precision)
        assert "on cuda" in runtime.line(), runtime.line()
        for got, want in zip(runtime.embed(THEIRS), expected, strict=True):
            if close is None:
                np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
            else:
                cosine = (got * want).sum(-1) / (np.linalg.norm(got, axis=-1) * np.linalg.norm(want, axis=-1))
                assert cosine.min() > close, precision
