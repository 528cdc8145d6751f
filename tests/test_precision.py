"""precision bf16: close to fp32 on the TF fixtures, real text and clip-heavy weights (cell state kept float32);
fp32 untouched; a CPU without native bf16 refuses it in one line (or runs it, told once, when allowed); training keeps
float32 masters."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

import elmo_core.precision as precision_module
from elmo_core import BiLM, batch_to_ids
from elmo_core.bilm.kernels import fused_gates
from elmo_core.text.corpus import _prose_paragraphs
from elmo_core.text.tokenize import split_sentences, unicode_tokens
from tests.helpers import needs_native_bf16, run_elmo

ROOT = Path(__file__).resolve().parent.parent


def _real_text(n: int = 200) -> list[list[str]]:
    from pydoc_data.topics import topics

    sentences = [
        unicode_tokens(s)
        for name in sorted(topics)[:40]
        for p in _prose_paragraphs(topics[name])
        for s in split_sentences(p)
    ]
    return sentences[:n]


def _cosines(bilm: BiLM, sentences: list[list[str]], max_abs: float = 1.0) -> list[np.ndarray]:
    """Per layer, the cosine of every token's bf16 vector to its fp32 vector (and their largest difference)."""
    exact, fast = bilm.embed_sentences(sentences), bilm.embed_sentences(sentences, precision="bf16")
    out = []
    for layer in range(bilm.num_layers):
        a, b = np.concatenate([x[layer] for x in exact]), np.concatenate([x[layer] for x in fast])
        out.append((a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)))
        assert fast[0].dtype == np.float32 and np.abs(a - b).max() < max_abs
    return out


@needs_native_bf16
def test_bf16_is_close_to_fp32_on_the_fixture_sentences_and_real_text(allennlp_dir, fixture_sentences):
    bilm = BiLM.from_pretrained(str(allennlp_dir))
    for sentences in ([s.split() for k in fixture_sentences for s in k], _real_text()):
        for cosines in _cosines(bilm, sentences, max_abs=0.05):
            assert cosines.min() >= 0.999 and np.quantile(cosines, 0.001) >= 0.999


def clip_heavy(bilm: BiLM) -> BiLM:
    """``bilm`` with forget and input gates pushed open, so that a fifth of the cells sit at the clip."""
    with torch.no_grad():
        for lstm in bilm.lstm.all_layers():
            h = lstm.hidden_size
            lstm.bias_ih_l0[h : 2 * h] += 2.0
            lstm.bias_ih_l0[:h] += 1.0
            lstm.weight_ih_l0[2 * h : 3 * h] *= 3
            lstm.weight_hh_l0[2 * h : 3 * h] *= 3
    return bilm


@needs_native_bf16
def test_bf16_keeps_the_cell_in_float32_on_clip_heavy_weights(allennlp_dir):
    """Forget and input gates pushed open so that a fifth of the cells sit at the clip: a bf16 cell state drifts
    (worst cosine ~0.986 measured), a float32 one stays above 0.99."""
    bilm = clip_heavy(BiLM.from_pretrained(str(allennlp_dir)))
    sentences = _real_text()
    with torch.no_grad():  # how often the clip engages: the cell state after a real forward pass
        c = bilm(batch_to_ids(sentences[:20]))["state"][1]
    assert float((c.abs() >= bilm.config.lstm.cell_clip - 1e-3).float().mean()) > 0.15
    for cosines in _cosines(bilm, sentences):
        assert cosines.min() >= 0.99


def test_a_cpu_without_native_bf16_refuses_bf16_in_one_line_or_runs_it_told_once_when_allowed(
    allennlp_dir, monkeypatch, caplog
):
    monkeypatch.setenv("ELMO_CPU_ISA", "avx2")  # an AVX2-only CPU, as the project's choices see it
    monkeypatch.setattr(precision_module, "_warned", set())
    measured = precision_module.emulated_bf16_slowdown()  # timed on this CPU, both ways (cached)
    assert measured > 0
    monkeypatch.setattr(precision_module, "emulated_bf16_slowdown", lambda: 37.25)  # the line gives the measurement
    bilm = BiLM.from_pretrained(str(allennlp_dir))
    with pytest.raises(precision_module.PrecisionError) as refused:
        bilm.embed_sentences([["no", "native", "bf16", "here"]], precision="bf16")
    line = str(refused.value)
    assert "\n" not in line and "no bfloat16 instructions" in line and "AVX-512 no" in line
    assert "use precision fp32" in line and "ELMO_ALLOW_EMULATED_BF16=1" in line
    assert "a bf16 product measured 37.2x the time of the same fp32 one here" in line
    assert precision_module.resolve_precision("auto", "cpu") == "fp32"  # auto never picks it there
    monkeypatch.setenv("ELMO_ALLOW_EMULATED_BF16", "1")
    with caplog.at_level(logging.WARNING, logger="elmo_core.precision"):
        first = bilm.embed_sentences([["no", "native", "bf16", "here"]], precision="bf16")
        bilm.embed_sentences([["again"]], precision="bf16")
    warnings = [r.getMessage() for r in caplog.records if "no bfloat16 instructions" in r.getMessage()]
    assert len(warnings) == 1 and "ELMO_ALLOW_EMULATED_BF16=1" in warnings[0]
    assert np.isfinite(first[0]).all()
    assert "packed for oneDNN no (" in str(bilm.prepare("bf16", min_packed=0))  # never oneDNN's bf16 packing there


def test_precision_names_are_checked():
    with pytest.raises(ValueError, match="precision must be one of"):
        precision_module.resolve_precision("fp16", "cpu")


def test_auto_is_bf16_where_the_hardware_computes_it_natively_and_says_why(monkeypatch):
    native = precision_module.cpu_has_native_bf16()
    chosen = precision_module.resolve_precision("auto", "cpu")
    assert chosen == ("bf16" if native else "fp32")
    assert chosen.why.startswith("auto: the CPU has") and ("bfloat16 instructions" in chosen.why)
    if native:
        asked = precision_module.resolve_precision("bf16", "cpu")
        assert (asked, asked.why) == ("bf16", "asked for bf16")
    assert precision_module.resolve_precision(chosen, "cpu") is chosen  # decided once: resolving again keeps it
    monkeypatch.setenv("ELMO_CPU_ISA", "avx2")  # a CPU without avx512_bf16 / AMX
    chosen = precision_module.resolve_precision("auto", "cpu")
    assert chosen == "fp32" and chosen.why.startswith("auto: the CPU has no bfloat16 instructions")
    with pytest.raises(precision_module.PrecisionError, match="precision bf16: this CPU has no bfloat16"):
        precision_module.resolve_precision("bf16", "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    on_gpu = precision_module.resolve_precision("auto", "cuda")
    assert (on_gpu, on_gpu.why) == ("bf16", "auto: NVIDIA H200 computes bfloat16 natively")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    assert precision_module.resolve_precision("auto", "cuda") == "fp32"  # a GPU before Ampere


def test_cuda_asked_for_without_a_gpu_falls_back_to_the_cpu_with_a_warning(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert precision_module.pick_device("auto") == torch.device("cpu")
    with caplog.at_level(logging.WARNING, logger="elmo_core.precision"):
        assert precision_module.pick_device("cuda:1") == torch.device("cpu")
    assert "CUDA is not available" in caplog.text
    assert precision_module.pick_device("cpu") == torch.device("cpu")


@needs_native_bf16
def test_bf16_training_keeps_float32_master_weights_and_optimizer_state(tmp_path, bilm_tf_dir):
    from elmo_core.data.vocab import VocabConfig, build_vocab
    from elmo_core.ingest import IngestConfig, ingest
    from elmo_core.train.loop import TrainConfig, setup, train_step

    ingest(
        IngestConfig(sources=[str(bilm_tf_dir / "train" / "data.txt")], out=str(tmp_path / "ing"), heldout_fraction=0.0)
    )
    build_vocab(
        VocabConfig(
            corpus=str(tmp_path / "ing"),
            db=str(tmp_path / "v" / "vocab.duckdb"),
            vocab_file=str(bilm_tf_dir / "train" / "vocab.txt"),
        )
    )
    run = setup(
        TrainConfig(
            data=str(tmp_path / "v"),
            out=str(tmp_path / "run"),
            precision="bf16",
            batch_size=4,
            unroll_steps=10,
            n_negative_samples_batch=16,
            tracking="none",
            device="cpu",
        )
    )
    assert run.precision == "bf16"
    losses = [train_step(run)["loss"] for _ in range(5)]
    assert all(np.isfinite(losses))
    assert all(p.dtype == torch.float32 for p in run.bilm.parameters())
    assert all(
        v.dtype == torch.float32
        for s in run.optimizer.state.values()
        for v in s.values()
        if torch.is_tensor(v) and v.is_floating_point()
    )
    assert run.state[1].dtype == torch.float32  # the carried cell state


@needs_native_bf16
def test_elmo_embed_precision_bf16_and_the_kernels_it_ran(tmp_path, allennlp_dir):
    result = run_elmo(
        "-v",
        "embed",
        "--model",
        str(allennlp_dir),
        "--input",
        str(ROOT / "data" / "probes" / "apple.txt"),
        "--out",
        str(tmp_path / "emb"),
        "--precision",
        "bf16",
    )
    assert result.returncode == 0, result.stderr
    assert "precision bf16 on cpu: " in result.stderr and ", torch CPU kernels " in result.stderr
    assert "LSTM step weights packed for oneDNN no (weights under" in result.stderr  # the fixture model is tiny
    assert f"LSTM gates fused in C {fused_gates.describe()}" in result.stderr
    if precision_module.cpu_has_native_bf16():
        assert "avx512_core_bf16" in result.stdout + result.stderr or "bf16" in (result.stdout + result.stderr).lower()
    assert json.loads((tmp_path / "emb" / "_job.json").read_text())["options"]["precision"] == "bf16"
