"""The runtime (``elmo_core.runtime``): one room decides how a model runs, a sentence gets the same vectors whichever
command asks, a registered model is downloaded once per machine, and each precision runs what it names."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from elmo_core import precision
from elmo_core.bilm.kernels import int8
from elmo_core.runtime import Output, Runtime
from tests.helpers import ROOT, run_elmo

SENTENCE = ["The", "apple", "fell", "from", "the", "tree", "."]
OTHERS = [["Apple", "shares", "rose", "sharply", "on", "Monday", "after", "the", "report", "."], ["Hi", "."]]


def test_a_sentence_gets_the_same_vectors_from_every_command(tmp_path, allennlp_dir):
    """The embedding table, a server's model process, the probes' embedding and the AllenNLP drop-in, for the same
    sentence and options (fp32): equal to 1e-6, each with other sentences around it."""
    from elmo_core.allennlp import ElmoEmbedder
    from elmo_core.options import EmbedConfig, WsdConfig
    from elmo_core.serve.api import Batch
    from elmo_core.serve.api import Output as Asked
    from elmo_core.serve.compute import BatchEmbedder
    from elmo_core.vectors.embed import embed
    from elmo_core.vectors.probe import embed_all, load_model

    text = tmp_path / "text.txt"
    text.write_text("\n".join(" ".join(s) for s in [OTHERS[0], SENTENCE, OTHERS[1]]) + "\n")
    embed(EmbedConfig(model=str(allennlp_dir), input=str(text), out=str(tmp_path / "table"), layers="all"))
    table = pq.read_table(tmp_path / "table").to_pandas()
    rows = table[table.text == " ".join(SENTENCE)].sort_values("token_index")
    from_table = np.stack([np.stack(rows[f"layer_{k}"].to_numpy()) for k in range(3)])

    from elmo_core.runtime import resolve_model

    server = BatchEmbedder(resolve_model(str(allennlp_dir)).pinned(), "cpu", "fp32", "asked for fp32", 4096)
    batch = Batch(1, [OTHERS[0], SENTENCE], [0, 0], [Asked("layers", encoding="base64")])
    answer = server.run(batch).answer(batch)  # computed, then encoded (the model process's answer thread)
    import base64

    served = np.frombuffer(base64.b64decode(answer.embeddings[1][1:-1]), dtype="<f4").reshape(answer.shapes[1])

    probed: dict[int, np.ndarray] = {}
    config = WsdConfig(model=str(allennlp_dir), out=str(tmp_path / "probe"))
    embed_all(load_model(config), [SENTENCE, *OTHERS], lambda i, v: probed.setdefault(i, v))

    dropped_in = ElmoEmbedder(str(allennlp_dir / "options.json"), str(allennlp_dir / "lm_weights.hdf5"))
    drop_in = dropped_in.embed_batch([OTHERS[1], SENTENCE])[1]

    assert from_table.shape == (3, len(SENTENCE), 32)
    for name, vectors in (("serve", served), ("probe", probed[0]), ("drop-in", drop_in)):
        np.testing.assert_allclose(vectors, from_table, atol=1e-6, rtol=0, err_msg=name)


def test_a_mean_and_a_mix_are_the_same_from_the_table_and_the_runtime(tmp_path, allennlp_dir):
    """``pool: mean`` of a scalar mix as the table writes it and as ``Runtime.embed`` gives it (the server's
    ``mean``), with mix weights and γ: one output description."""
    from elmo_core.options import EmbedConfig
    from elmo_core.vectors.embed import embed

    text = tmp_path / "text.txt"
    text.write_text(" ".join(SENTENCE) + "\n" + " ".join(OTHERS[0]) + "\n")
    weights, gamma = [0.5, -1.0, 2.0], 0.7
    config = EmbedConfig(
        model=str(allennlp_dir), input=str(text), out=str(tmp_path / "t"), pool="mean", mix_weights=weights, gamma=gamma
    )
    embed(config)
    table = pq.read_table(tmp_path / "t").to_pandas()
    written = np.stack(table[table.text == " ".join(SENTENCE)]["elmo"].to_numpy())[0]
    runtime = Runtime.open(str(allennlp_dir))
    asked = runtime.embed([SENTENCE], Output.of("mix", "mean", weights, gamma))[0]
    layers = runtime.embed([SENTENCE])[0]
    by_hand = (torch.softmax(torch.tensor(weights), 0).numpy()[:, None, None] * layers).sum(0).mean(0) * gamma
    np.testing.assert_allclose(written, asked, atol=1e-6)
    np.testing.assert_allclose(asked, by_hand, atol=1e-5)


@pytest.mark.slow
def test_info_and_a_model_run_print_the_same_resolved_line(tmp_path, allennlp_dir):
    """``elmo info MODEL`` prints what the runtime resolved; ``elmo embed`` logs that very line, ``auto`` precision
    included (the same values and meaning as ``elmo serve``)."""
    info = run_elmo("info", str(allennlp_dir))
    assert info.returncode == 0, info.stderr
    line = next(s for s in info.stdout.splitlines() if s.startswith(f"model {allennlp_dir} (a model directory"))
    assert " on cpu, fp32 (asked for fp32); " in line and "kernels: precision fp32 on cpu" in line
    text = tmp_path / "t.txt"
    text.write_text(" ".join(SENTENCE) + "\n")
    run = run_elmo("embed", "--model", str(allennlp_dir), "--input", str(text), "--out", str(tmp_path / "o"))
    assert run.returncode == 0, run.stderr
    assert any(logged.endswith(f"elmo_core.runtime.engine INFO {line}") for logged in run.stderr.splitlines())
    auto = run_elmo(
        "embed", "--model", str(allennlp_dir), "--input", str(text), "--out", str(tmp_path / "a"), "--precision", "auto"
    )
    assert auto.returncode == 0, auto.stderr
    assert "(auto: " in auto.stderr


@pytest.mark.skipif(not int8.available(), reason=f"no int8 here: {int8.describe()}")
def test_int8_computes_its_products_in_int8_not_in_float32_on_dequantized_weights():
    """The int8 kernel quantizes the activations as well as the weights: its products match an emulation of that
    integer arithmetic and differ from float32 products on the dequantized weights by far more than rounding."""
    torch.manual_seed(0)
    w, x = torch.randn(2, 64, 32), torch.randn(2, 8, 32)
    kernel = int8.Int8Weights(w)
    assert kernel.reduce_range == (precision.int8_engine()[1] == 7)  # the bits chosen, emulated below
    got = kernel(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for d in range(2):
            scale = w[d].abs().amax(1).clamp_min(1e-8) / 127
            w_int8 = torch.round(w[d] / scale[:, None]).clamp(-128, 127) * scale[:, None]
            s, zero = torch._choose_qparams_per_tensor(x[d], kernel.reduce_range)
            x_uint8 = ((torch.round(x[d] / s) + zero).clamp(0, 127 if kernel.reduce_range else 255) - zero) * s
            assert (got[d] - x_uint8 @ w_int8.T).abs().max() < 1e-4
            assert (got[d] - x[d] @ w_int8.T).abs().max() > 1e-2


@pytest.mark.slow
def test_a_registered_model_is_downloaded_once_per_machine(tmp_path, allennlp_dir):
    """``models:/NAME/N``, ``/latest`` and ``@alias`` resolve through one download cache: a second process resolving
    the same version finds it there, even once the store's artifacts are gone."""
    from elmo_core.tracking import MLflowTracker

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = MLflowTracker(experiment="runtime-test", tracking_uri=uri)
    assert tracker.log_model_dir(allennlp_dir, "cached") == "models:/cached/1"
    tracker.close()
    import mlflow

    mlflow.MlflowClient(uri).set_registered_model_alias("cached", "champion", "1")
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "ELMO_CACHE_DIR": str(tmp_path / "cache")}
    code = (
        "import json, sys; from elmo_core.runtime import resolve_model; r = resolve_model(sys.argv[1]); "
        "print(json.dumps([r.origin, str(r.options), r.model_id, r.exact, r.name]))"
    )

    def resolve(reference: str) -> list[str]:
        done = subprocess.run(
            [sys.executable, "-c", code, reference], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout.strip().splitlines()[-1])

    first = resolve("models:/cached/latest")
    assert first[0].startswith("downloaded in") and first[3:] == ["models:/cached/1", "models:/cached/1"]
    shutil.rmtree(tmp_path / "mlartifacts")  # the store's copy is gone; the machine's stays
    for reference in ("models:/cached/1", "models:/cached@champion", "models:/cached/latest"):
        origin, options, model_id, exact, _ = resolve(reference)
        assert "cached in" in origin and [options, model_id, exact] == [first[1], first[2], first[3]], reference
    entries = [p for p in (tmp_path / "cache" / "models").iterdir() if p.is_dir()]
    assert len(entries) == 1
