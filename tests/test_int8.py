"""``precision: int8``: CPU inference with the LSTM step's products on int8 weights (``kernels/int8.py``), held to the
bar it is offered on (per-token cosine to fp32 >= 0.999 at the 0.1% quantile in every layer on real text), chosen
and printed once, refused in one line where it cannot run (training, CUDA)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from elmo_core import BiLM, cpu
from elmo_core import precision as precision_module
from elmo_core.bilm.kernels import choice, fused_gates, int8
from elmo_core.config import LstmConfig
from elmo_core.precision import PrecisionError, resolve_precision
from elmo_core.text.corpus import _prose_paragraphs
from elmo_core.text.tokenize import split_sentences, unicode_tokens
from tests.helpers import ROOT, assert_same_vectors, run_elmo

# only the tests that run int8 products need them; the refusals are tested everywhere
needs_int8 = pytest.mark.skipif(not int8.available(), reason=f"no int8 here: {int8.describe()}")


def _real_sentences(n: int) -> list[list[str]]:
    from pydoc_data.topics import topics

    sentences = (
        unicode_tokens(s)
        for name in sorted(topics)
        for p in _prose_paragraphs(topics[name])
        for s in split_sentences(p)
    )
    return [s for s in sentences if s][:n]


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


@needs_int8
def test_int8_holds_the_cosine_bar_on_real_text_with_the_tf_trained_model(allennlp_dir):
    bilm = BiLM.from_pretrained(str(allennlp_dir))
    text = _real_sentences(400)
    exact = bilm.embed_sentences(text)
    kernels = bilm.prepare("int8")
    assert "LSTM step products in int8 yes (hh, hr, cat)" in str(kernels)  # every per-step product, at any size
    quantized = bilm.embed_sentences(text, precision="int8")
    for layer in range(bilm.num_layers):
        cos = np.concatenate([_cosines(a[layer], b[layer]) for a, b in zip(exact, quantized)])
        assert np.quantile(cos, 0.001) >= 0.999, layer
    assert not all(np.array_equal(a, b) for a, b in zip(exact, quantized))  # it really ran int8 products
    # layer 0 is not quantized: bf16's own layer 0 where the CPU runs it in bf16, else fp32's
    assert f"layer 0 (char CNN, highway, projection) in {'bf16' if kernels.encoder_bf16 else 'fp32'}" in str(kernels)
    layer_0 = bilm.embed_sentences(text, precision="bf16") if kernels.encoder_bf16 else exact
    for a, b in zip(layer_0, quantized):
        np.testing.assert_array_equal(a[0], b[0])


@needs_int8
def test_int8_activations_take_8_bits_and_layer_0_bf16_only_where_the_cpu_sums_int8_in_int32(monkeypatch):
    """VNNI (int8 dot products summed in int32): oneDNN with 8-bit activations, and layer 0 in bf16 where the CPU has
    bf16 products too; an x86 CPU without VNNI (``ELMO_CPU_ISA=avx2``, in the same process after the first choice)
    keeps fbgemm's 7 bits, whose int16 sums 8 bits could saturate, and layer 0 in fp32, whose margin on the cosine
    bar needs the 8th bit (``choice._encoder_bf16``). The weights are packed as chosen, the engine put back."""

    def chosen() -> tuple[tuple[str, int], bool, bool]:
        before = torch.backends.quantized.engine
        weights = int8.Int8Weights(torch.randn(2, 16, 8))
        assert torch.backends.quantized.engine == before
        kernels = choice.choose(torch.device("cpu"), resolve_precision("int8", "cpu"), LstmConfig())
        return precision_module.int8_engine(), weights.reduce_range, kernels.encoder_bf16

    vnni, native = cpu.facts().vnni, precision_module.cpu_has_native_bf16()
    engine, reduce_range, encoder_bf16 = chosen()
    assert encoder_bf16 == (vnni and native)
    if vnni:
        assert engine == ("onednn", 8) and not reduce_range
    if not cpu.facts().x86:
        return
    monkeypatch.setenv("ELMO_CPU_ISA", "avx2")
    engine, reduce_range, encoder_bf16 = chosen()
    assert engine[0] != "onednn" and engine[1] == 7 and reduce_range and not encoder_bf16


@needs_int8
def test_int8_per_word_input_products_in_bf16_where_the_cpu_has_them(allennlp_dir):
    """Layer 0's per-word input product, the one int8 does not quantize, runs in bf16 on a CPU with bf16 products
    (named on the kernels line) and holds the cosine bar beside its fp32 form; elsewhere it is fp32."""
    if not fused_gates.available():
        pytest.skip(fused_gates.describe())
    bilm = BiLM.from_pretrained(str(allennlp_dir))
    text = _real_sentences(200)
    exact = bilm.embed_sentences(text)
    chosen = bilm.prepare("int8")
    native = precision_module.cpu_has_native_bf16()
    assert chosen.word_gates_bf16 == native
    assert f"layer 0's per-word input products in {'bf16' if native else 'fp32'}" in str(chosen)
    by_choice = bilm.embed_sentences(text, precision="int8")  # on the kernels just prepared
    assert not bilm.prepare("int8", word_gates_bf16=False).word_gates_bf16
    in_fp32 = bilm.embed_sentences(text, precision="int8")
    if native:
        assert not all(np.array_equal(a, b) for a, b in zip(by_choice, in_fp32))  # bf16 products really ran
    for got in (by_choice, in_fp32):
        for layer in range(bilm.num_layers):
            cos = np.concatenate([_cosines(a[layer], b[layer]) for a, b in zip(exact, got)])
            assert np.quantile(cos, 0.001) >= 0.999, layer


@needs_int8
def test_int8_products_with_and_without_the_c_gates_agree(allennlp_dir):
    if not fused_gates.available():
        pytest.skip(fused_gates.describe())
    bilm = BiLM.from_pretrained(str(allennlp_dir))
    sentences = [s * 3 for s in _real_sentences(8)]  # rows drop out step by step
    with_c = bilm.prepare("int8", word_gates_bf16=False)  # the same products as without the C gates
    assert with_c.gate_kernel
    fused = bilm.embed_sentences(sentences, precision="int8")  # on the kernels just prepared
    assert not bilm.prepare("int8", gate_kernel=False).gate_kernel
    assert_same_vectors(fused, bilm.embed_sentences(sentences, precision="int8"), "int8", fp32_atol=0)


@needs_int8
def test_int8_is_offered_on_the_cpu_and_never_by_auto():
    assert "int8" in choice.offered_precisions("cpu") and "int8" not in choice.offered_precisions("cuda")
    assert resolve_precision("int8", "cpu") == "int8" and resolve_precision("auto", "cpu") != "int8"


def test_int8_is_refused_in_one_line_off_the_cpu_and_where_torch_has_no_int8_products(monkeypatch):
    with pytest.raises(PrecisionError, match=r"^precision int8: CPU inference only .*; on cuda use fp32 or bf16$"):
        resolve_precision("int8", "cuda")
    monkeypatch.setattr(precision_module, "int8_products", lambda: (False, "no dynamic int8 products in this torch"))
    with pytest.raises(PrecisionError, match=r"^precision int8: no dynamic int8 products in this torch; use .* fp32$"):
        resolve_precision("int8", "cpu")
    assert "int8" not in choice.offered_precisions("cpu")


def test_training_in_int8_is_refused_by_its_flag_and_by_its_config_key(tmp_path):
    """Training stays fp32 / bf16: one line naming the flag, or the key of the file it came from."""
    flag = run_elmo("train", "--data", "d", "--out", str(tmp_path / "o"), "--precision", "int8")
    assert flag.returncode == 2
    assert flag.stderr.strip().splitlines()[-1].startswith("elmo train: error: argument --precision: invalid choice")
    config = tmp_path / "train.yaml"
    config.write_text("precision: int8\n")
    key = run_elmo("train", "--config", str(config), "--data", "d", "--out", str(tmp_path / "o"))
    assert key.returncode == 2 and key.stderr.strip().splitlines() == [
        f"elmo train: error: {config}: precision: Input should be 'auto', 'fp32' or 'bf16' (got 'int8')"
    ]
    assert not (tmp_path / "o").exists()


@needs_int8
def test_elmo_embed_in_int8_writes_the_table_and_says_what_ran(tmp_path, allennlp_dir):
    out = tmp_path / "emb"
    source = ROOT / "data" / "probes" / "apple.txt"
    args = ["-v", "embed", "--model", str(allennlp_dir), "--input", str(source), "--out", str(out)]
    result = run_elmo(*args, "--precision", "int8", "--layers", "all")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "precision int8 on cpu" in result.stderr and "LSTM step products in int8 yes" in result.stderr
    import duckdb

    rows, tokens = duckdb.sql(
        f"SELECT count(*), count(DISTINCT (sentence_id, token_index)) FROM read_parquet('{out}/*.parquet')"
    ).fetchall()[0]
    expected = sum(len(line.split()) for line in source.read_text().splitlines() if line.strip())
    assert rows == tokens > 0 and rows >= expected // 2  # one row per token (the tokenizer may split more)
