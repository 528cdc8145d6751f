"""CUDA paths (run with ``pytest -m gpu`` on a machine with a GPU; deselected by default)."""

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
    for a, b in zip(cpu.embed_sentences(SENTENCES), gpu.embed_sentences(SENTENCES, bf16=True)):
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
    import json
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
