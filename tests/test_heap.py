"""A process that runs a model reuses its large buffers: once a pass or two have run, the next pass's buffers come
from the heap it kept instead of being page-faulted in from the kernel again (``elmo_core.heap``). Counted in page
faults (``ru_minflt``) of real passes of a model of the published small shape, never timed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from elmo_core.bilm.model import BiLM
from elmo_core.config import preset
from tests.helpers import ROOT

PASSES = 5  # the first two grow the heap to the working set; the last two are the steady state measured
SENTENCES, WORDS = 64, 40  # 2,560 tokens: layer 0's gates alone are 2,560 x 4H floats, 40 MiB, above glibc's 32 MiB

# opens a Runtime (which sets the heap as every command does) and runs the same batch PASSES times: each pass's
# page faults, and the allocator Arrow's tables get (the embedding stage's writes)
SCRIPT = f"""
import json, random, resource, sys
import pyarrow
from elmo_core.runtime import Runtime
runtime = Runtime.open(sys.argv[1])
rng = random.Random(0)
words = [f"w{{i}}" for i in range(3000)]
batch = [[rng.choice(words) for _ in range({WORDS})] for _ in range({SENTENCES})]
faults = []
for _ in range({PASSES}):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    runtime.embed(batch)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({{"faults": faults, "arrow": pyarrow.default_memory_pool().backend_name}}))
"""


@pytest.fixture(scope="module")
def small_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model of the published small shape (random weights: the buffers' sizes are what is measured)."""
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("small")
    BiLM(preset("small")).save_pretrained(str(folder))
    return folder


def pass_faults(model: Path, heap: str | None) -> tuple[list[int], str]:
    """Each pass's page faults, and the allocator Arrow's tables get."""
    env = {k: v for k, v in os.environ.items() if k not in ("ELMO_HEAP", "LD_PRELOAD", "GLIBC_TUNABLES")}
    env = {k: v for k, v in env.items() if not k.startswith("MALLOC_")}
    if heap is not None:
        env["ELMO_HEAP"] = heap
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(model)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    return found["faults"], found["arrow"]


@pytest.mark.slow  # two processes running five passes each
@pytest.mark.skipif(sys.platform != "linux", reason="glibc's malloc is what the heap module sets")
def test_a_process_running_a_model_reuses_its_large_buffers(small_model):
    """With glibc's defaults every pass maps its largest buffers fresh and faults every page in again (the
    measurement sees it); in a process that opened a Runtime the steady passes fault next to nothing."""
    system, arrow_as_it_was = pass_faults(small_model, "system")
    kept, arrow = pass_faults(small_model, None)
    assert arrow == "system" and arrow_as_it_was != "system"  # Arrow's buffers on the same heap, only then
    steady_system, steady_kept = sum(system[-2:]), sum(kept[-2:])
    if steady_system < 2 * 40 * 2**20 // 4096:
        pytest.skip(f"this kernel faults in {system} pages a pass (huge pages?): nothing to measure")
    assert steady_kept < steady_system // 10, (kept, system)
