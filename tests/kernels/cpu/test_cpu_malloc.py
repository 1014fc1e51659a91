"""core.kernels.cpu.malloc: freed activation-sized blocks are reused without faulting their pages in again."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys

import pytest

from bestiary.core.kernels.cpu import malloc

pytestmark = pytest.mark.skipif(malloc.glibc_mallopt() is None, reason="glibc only")

# A 31 MiB block (a prefill layer's activation at a few thousand tokens), malloc'ed and freed in a
# fresh process, with glibc's own account of it (mallinfo2): tuned, it comes from the heap (no mmap:
# the threshold is 32 MiB), the heap grows by the 64 MiB pad beside it, and the block stays there
# when freed (no trim below 512 MiB); with glibc's defaults
# it is a fresh mmap (threshold 128 KiB until a freed mmap raises it), whose pages fault in again
# at every use. (Counting page faults over a prefill-like pattern was tried first: 0-28 k here,
# 56 k and 9 k on CI's machine, against 6-73 k untuned, as the layout of earlier blocks fell.)
PROBE = """
import ctypes, json
from bestiary.core.kernels.cpu.malloc import keep_freed_memory
applied = keep_freed_memory()
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
before = libc.mallinfo2()
x = libc.malloc(31 << 20)  # as torch's CPU allocator asks for its storage
ctypes.memset(x, 1, 31 << 20)
held = libc.mallinfo2()
libc.free(x)
after = libc.mallinfo2()
print(json.dumps({"applied": applied, "mmapped": held.hblkhd - before.hblkhd, "heap_grew": held.arena - before.arena,
                  "heap_returned": held.arena - after.arena}))
"""
BLOCK = 31 << 20


def probe(tuning: str) -> dict:
    env = dict(os.environ, BESTIARY_MALLOC_TUNING=tuning)
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2"), reason="glibc < 2.33: no mallinfo2")
def test_a_freed_activation_block_stays_in_the_heap():
    tuned, plain = probe("1"), probe("0")
    assert tuned["applied"] and not plain["applied"]
    # measured here and in CI's venv alike: tuned 0 mmapped, the heap grown by 95 MiB (the block and
    # the 64 MiB pad, less what was free), 0 returned; defaults 31 MiB mmapped, the heap unchanged
    assert tuned["mmapped"] == 0 and tuned["heap_returned"] == 0, tuned
    assert tuned["heap_grew"] >= BLOCK + malloc.PAD_BYTES // 2, tuned
    if plain["mmapped"] < BLOCK:
        pytest.skip(f"glibc's dynamic mmap threshold had already risen past 31 MiB here: {plain}")


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
