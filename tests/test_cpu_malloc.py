"""core.cpu.malloc: freed activation-sized blocks are reused without faulting their pages in again."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from bestiary.core.cpu import malloc

pytestmark = pytest.mark.skipif(malloc.glibc_mallopt() is None, reason="glibc only")

# The activations of a prefill layer at 8,192 tokens (SmolLM2 bf16 sizes in MiB: qkv, attention,
# hidden, the MLP's fc and gate, act): a few layers until the heap settles, then the minor page
# faults of four more. Freed blocks reused fault nothing; a fresh mmap or a trimmed heap faults
# every page again. Every block is under the 32 MiB mmap threshold: a larger one (the fused fc|gate
# of 50 MiB) comes from the heap only when its top has room, which depends on where earlier blocks
# landed (0 to 28 k faults between runs here, 56 k on CI's machine), so it would make the count
# a draw.
PROBE = """
import json, resource
import torch
from bestiary.core.cpu.malloc import keep_freed_memory
applied = keep_freed_memory()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def block(mib):
    return torch.empty(int(mib * (1 << 20)), dtype=torch.uint8).fill_(1)
def layer(x):
    qkv = block(15.7)
    att = block(9.4)
    del qkv
    h = block(9.4)
    del att
    fc, gate = block(25.2), block(25.2)
    act = block(25.2)
    del fc, gate
    out = block(9.4)
    del act, h
    return out
x = block(9.4)
for _ in range(4):
    x = layer(x)
before = faults()
for _ in range(4):
    x = layer(x)
print(json.dumps({"applied": applied, "faults": faults() - before}))
"""


def probe(tuning: str) -> dict:
    env = dict(os.environ, BESTIARY_MALLOC_TUNING=tuning)
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_freed_blocks_are_reused_without_faults():
    tuned, plain = probe("1"), probe("0")
    assert tuned["applied"] and not plain["applied"]
    # measured: tuned 0 faults in every run, glibc's defaults 64 k (each 25 MiB block a fresh mmap)
    assert tuned["faults"] < 0.1 * plain["faults"], (tuned, plain)


def test_settings_applied_once_with_the_documented_values(monkeypatch):
    calls = []
    monkeypatch.setattr(malloc, "_done", [])
    monkeypatch.setattr(malloc, "glibc_mallopt", lambda: lambda param, value: calls.append((param, value)) or 1)
    assert malloc.keep_freed_memory() and malloc.keep_freed_memory()
    assert calls == [(malloc.M_MMAP_THRESHOLD, 32 << 20), (malloc.M_TRIM_THRESHOLD, malloc.TRIM_BYTES),
                     (malloc.M_TOP_PAD, malloc.PAD_BYTES)]


def test_opt_out_and_refused_settings(monkeypatch):
    monkeypatch.setattr(malloc, "_done", [])
    monkeypatch.setenv("BESTIARY_MALLOC_TUNING", "0")
    monkeypatch.setattr(malloc, "glibc_mallopt", lambda: pytest.fail("opted out: mallopt must not be looked up"))
    assert not malloc.keep_freed_memory()
    monkeypatch.setattr(malloc, "_done", [])
    monkeypatch.delenv("BESTIARY_MALLOC_TUNING")
    monkeypatch.setattr(malloc, "glibc_mallopt", lambda: lambda param, value: 0)  # glibc refused a value
    assert not malloc.keep_freed_memory()
