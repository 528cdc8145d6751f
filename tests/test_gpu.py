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
    from elmo_core.config import tiny
    from elmo_core.model import init_bilm_tf

    torch.manual_seed(0)
    config = tiny().model_copy(update={"lstm": tiny().lstm.model_copy(update={"cell_clip": None, "proj_clip": None})})
    fused = BiLM(config)
    init_bilm_tf(fused)
    general = BiLM(config, use_fused=False)
    general.load_state_dict(fused.state_dict())
    fused, general = fused.cuda().eval(), general.cuda().eval()
    ids = batch_to_ids(SENTENCES).cuda()
    with torch.no_grad():
        for x, y in zip(fused(ids)["activations"], general(ids)["activations"]):
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
