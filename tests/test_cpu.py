"""Every CPU users have: what the project probes (``elmo_core/cpu.py``), the override that makes an AVX-512 CPU behave
as an AVX2-only one (how CI runs the fallback paths anywhere), the original shape in every precision offered, bf16
refused where it would be emulated, and worker processes that split the cores."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from elmo_core import BiLM, cpu
from elmo_core.bilm.initialization import init_bilm_tf
from elmo_core.bilm.kernels import choice, fused_gates, packed
from elmo_core.config import preset
from elmo_core.errors import ConfigError
from tests.helpers import ROOT, run_elmo

SENTENCES = [["The", "bank", "of", "the", "river", "."], ["I", "opened", "an", "account", "at", "the", "bank"], ["x"]]
X86 = cpu.facts().x86


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    """``python -c CODE`` in a new process (torch imported afresh), with ``env`` over this one's environment."""
    import os

    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **env},
    )


def test_the_override_makes_the_cpu_look_avx2_only_to_the_project(monkeypatch):
    monkeypatch.setenv("ELMO_CPU_ISA", "avx2")
    facts = cpu.facts()
    assert facts.override == "avx2" and not facts.avx512 and not facts.amx and not facts.bf16_instructions
    assert not any(f.startswith(("avx512", "amx")) for f in facts.flags)
    assert "AVX-512 no, avx512_bf16 no, AMX no" in facts.line() and "ELMO_CPU_ISA=avx2" in facts.line()
    if X86:
        assert "-march=x86-64-v3" in fused_gates._flags()  # the C kernels are built for an AVX2 CPU
    assert choice.offered_precisions("cpu")[0] == "fp32" and "bf16" not in choice.offered_precisions("cpu")
    works, why = packed.packing(torch.bfloat16)
    assert not works and "bfloat16" in why
    monkeypatch.setenv("ELMO_CPU_ISA", "avx1024")
    with pytest.raises(ConfigError, match="ELMO_CPU_ISA='avx1024': expected one of avx2"):
        cpu.facts()
    monkeypatch.delenv("ELMO_CPU_ISA")
    assert cpu.facts().override is None and "-march=native" in fused_gates._flags()


@pytest.mark.parametrize(
    "flags, hidden",
    [
        ("fpu avx2 fma", set()),  # an AVX2-only CPU: CI runs the fallback tests once, not twice
        ("avx2 fma avx512f avx512bw avx512_bf16", {"avx512f", "avx512bw", "avx512_bf16"}),
        ("avx2 fma avx_vnni", {"avx_vnni"}),  # a client CPU with VNNI and no AVX-512 still needs the second run
    ],
)
def test_what_the_override_hides_decides_ci_s_second_run(monkeypatch, flags, hidden):
    monkeypatch.setattr(cpu, "_cpuinfo", lambda: ("a CPU", frozenset(flags.split())))
    cpu._facts.cache_clear()
    try:
        assert cpu.hidden_by("avx2") == hidden
    finally:
        cpu._facts.cache_clear()


@pytest.mark.skipif(not X86, reason="the override holds x86 instruction sets")
def test_set_before_torch_loads_it_holds_torch_s_own_kernels_to_avx2_too():
    code = (
        "import elmo_core, torch\n"
        "from elmo_core.bilm.kernels import packed\n"
        "print(torch.backends.cpu.get_cpu_capability(), torch.ops.mkldnn._is_mkldnn_bf16_supported())\n"
        "print(packed.packing(torch.bfloat16)[1])\n"
    )
    result = _python(code, ELMO_CPU_ISA="avx2")
    assert result.returncode == 0, result.stderr
    capability, why = result.stdout.strip().splitlines()
    assert capability == "AVX2 False"  # ATen dispatches AVX2 kernels and oneDNN has no bf16 here
    # what the machine hit: oneDNN refuses to pack bf16 weights for this CPU; the probe says so
    assert "oneDNN cannot pack bfloat16 here" in why and "bf16 path needs the cpu support" in why


def _original() -> BiLM:
    torch.manual_seed(0)
    bilm = BiLM(preset("original"))
    init_bilm_tf(bilm)
    return bilm.eval()


def test_the_original_shape_runs_in_every_precision_the_chooser_offers_here():
    bilm = _original()
    vectors = {}
    for precision in choice.offered_precisions("cpu"):
        kernels = bilm.prepare(precision)
        if precision == "int8":
            assert "LSTM step products in int8 yes (hh, hr, cat)" in str(kernels)
        elif packed.packing_available(torch.bfloat16 if precision == "bf16" else torch.float32):
            assert "packed for oneDNN yes (hh, hr, cat)" in str(kernels)  # the products that crashed, packed
        vectors[precision] = bilm.embed_sentences(SENTENCES, precision=precision)
        assert [v.shape for v in vectors[precision]] == [(3, len(s), 1024) for s in SENTENCES]
        assert all(np.isfinite(v).all() for v in vectors[precision])
    for precision, got in vectors.items():  # every precision gives the fp32 vectors, to its rounding
        for a, b in zip(vectors["fp32"], got):
            cosine = (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))
            assert cosine.min() > (0.99999 if precision == "fp32" else 0.99), precision


@pytest.mark.skipif(not X86, reason="the override holds x86 instruction sets")
def test_emulated_bf16_on_the_original_shape_runs_when_allowed_without_oneDNN_s_bf16_packing():
    """The crash of an AVX2-only CPU (``mkldnn_reorder_linear_weight: bf16 path needs ...``), reproduced on any x86
    CPU: oneDNN held to AVX2, bf16 allowed, the original shape (whose weights are large enough to pack)."""
    code = (
        "import elmo_core, json, torch\n"
        "from elmo_core import BiLM\n"
        "from elmo_core.config import preset\n"
        "bilm = BiLM(preset('original')).eval()\n"
        "kernels = bilm.prepare('bf16')\n"
        "out = bilm.embed_sentences([['a', 'short', 'one']], precision='bf16')\n"
        "print(json.dumps([str(kernels), bool(torch.isfinite(torch.from_numpy(out[0])).all())]))\n"
    )
    result = _python(code, ELMO_CPU_ISA="avx2", ELMO_ALLOW_EMULATED_BF16="1")
    assert result.returncode == 0, result.stderr[-2000:]
    kernels, finite = json.loads(result.stdout.strip().splitlines()[-1])
    assert finite and "packed for oneDNN no (oneDNN cannot pack bfloat16 here" in kernels
    assert "precision bf16: this CPU has no bfloat16 instructions" in result.stderr  # the warning, once
    assert "Traceback" not in result.stderr


def test_elmo_embed_in_bf16_on_a_cpu_without_it_is_one_line_before_any_work(tmp_path, allennlp_dir):
    out = tmp_path / "emb"
    args = ["embed", "--model", str(allennlp_dir), "--input", str(ROOT / "data" / "probes" / "apple.txt")]
    result = run_elmo(*args, "--out", str(out), "--precision", "bf16", env=_env(ELMO_CPU_ISA="avx2"))
    assert result.returncode == 2, result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("elmo embed: error: precision bf16: this CPU has no bfloat16 instructions")
    assert "use precision fp32" in line and "Traceback" not in result.stderr
    assert not out.exists() and not list(tmp_path.glob(".emb*"))  # nothing written, nothing to clean
    info = run_elmo("info", env=_env(ELMO_CPU_ISA="avx2"))
    assert info.returncode == 0, info.stderr
    assert "precisions on the CPU: fp32, int8; auto is fp32" in info.stdout and "bf16 refused here" in info.stdout
    assert "int8 products (precision int8): dynamic int8 products" in info.stdout
    assert "AVX-512 no" in info.stdout and "(behaving as an AVX2-only CPU: ELMO_CPU_ISA=avx2)" in info.stdout


def _env(**extra: str) -> dict[str, str]:
    import os

    return {**os.environ, **extra}


def test_worker_processes_split_the_cores(monkeypatch):
    monkeypatch.setattr(cpu, "usable_cores", lambda: 16)
    assert [cpu.threads_for(n) for n in (1, 2, 3, 16, 32)] == [16, 8, 5, 1, 1]
    assert cpu.worker_env(4) == {"ELMO_TORCH_THREADS": "4", "OMP_NUM_THREADS": "4", "MKL_NUM_THREADS": "4"}
    code = "import torch\nfrom elmo_core import cpu\nprint(cpu.apply_thread_share())\nprint(torch.get_num_threads())"
    result = _python(code, ELMO_TORCH_THREADS="1", OMP_NUM_THREADS="")  # torch's own default would take every core
    assert result.returncode == 0, result.stderr
    line, threads = result.stdout.strip().splitlines()
    assert threads == "1" and line.startswith("torch threads: 1 in this process")
