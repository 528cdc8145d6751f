"""A process that runs a model reuses its large buffers: the next pass's buffer of the same size is not page-faulted
in from the kernel again (``elmo_core.heap``). Counted in page faults (``ru_minflt``), never timed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT

BUFFER_MB = 64  # one pass's products at the original shape are tens of MB
PAGES = BUFFER_MB * 2**20 // 4096

# opens a Runtime (which sets the heap as every command does), then writes a buffer, frees it, and writes one of
# the same size again: the page faults of that second one
SCRIPT = """
import json, resource, sys
import pyarrow
import torch
from elmo_core.runtime import Runtime
runtime = Runtime.open(sys.argv[1])
runtime.embed([["a", "b"]])
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
buffer = torch.empty(int(sys.argv[2]) * 2**20 // 4).fill_(1.0)
del buffer
before = faults()
buffer = torch.empty(int(sys.argv[2]) * 2**20 // 4).fill_(2.0)
print(json.dumps({"faults": faults() - before, "arrow": pyarrow.default_memory_pool().backend_name}))
"""


def second_buffer_faults(model: Path, heap: str | None) -> tuple[int, str]:
    """The page faults of the second buffer, and the allocator Arrow's tables get (the embedding stage's writes)."""
    env = {k: v for k, v in os.environ.items() if k not in ("ELMO_HEAP", "LD_PRELOAD", "GLIBC_TUNABLES")}
    env = {k: v for k, v in env.items() if not k.startswith("MALLOC_")}
    if heap is not None:
        env["ELMO_HEAP"] = heap
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(model), str(BUFFER_MB)], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    return found["faults"], found["arrow"]


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's malloc is what the heap module sets")
def test_a_process_running_a_model_reuses_its_large_buffers(allennlp_dir):
    """With glibc's defaults the second buffer is mapped fresh, every page faulted in again (the measurement
    sees it); in a process that opened a Runtime it is the first one's memory, reused."""
    system, arrow_as_it_was = second_buffer_faults(allennlp_dir, "system")
    kept, arrow = second_buffer_faults(allennlp_dir, None)
    assert arrow == "system" and arrow_as_it_was != "system"  # Arrow's buffers on the same heap, only then
    if system < PAGES // 2:
        pytest.skip(f"this kernel faults in {system} pages for {PAGES:,} (huge pages): nothing to measure")
    assert kept < PAGES // 10, (kept, system, PAGES)
