"""benches/multigpu.py's --host mode against a real kvd: the multi-GPU benchmark's processes,
shared kvd and four stages (data plane, MLA shared by TP ranks, TP shards, every rank
SIGKILLed at once) on host memory, so its orchestration and byte checks are tested where there
is no GPU; and its byte comparison shown to catch one changed byte."""

from __future__ import annotations

import subprocess
import sys

from conftest import ROOT, kvd_binary

BENCHES = ROOT / "benches"


def test_every_stage_passes_on_host_memory_with_two_rank_processes():
    out = subprocess.run(
        [sys.executable, str(BENCHES / "multigpu.py"), "--kvd", kvd_binary(), "--host", "--gpus", "2",
         "--seconds", "0.5", "--layouts", "BLNHC", "--budget-s", "120"],
        capture_output=True, text=True, timeout=180,
    )
    report = out.stdout + out.stderr
    assert out.returncode == 0, report
    for stage in ("1: data plane on all GPUs at once", "2: MLA shared by N TP ranks",
                  "3: TP shards of a Llama-70B-like cache", "4: N ranks SIGKILLed at once"):
        assert f"| {stage} | **ok** |" in report, report
    assert "pin held after 1 reader(s): yes; ended after reader 2: yes" in report, report
    assert "Everything released within 10 s: **yes**" in report, report
    assert "| kvd exit on SIGTERM | **ok** |" in report, report


def test_the_byte_comparison_finds_one_changed_byte():
    sys.path.insert(0, str(BENCHES))
    from kvmem import HostKv
    from multigpu_ranks import compare

    cache = HostKv("LBNHC", (3, 2, 64, 16), 16)  # 3 layers, 2 heads, 64 content, 16-token blocks
    cache.fill(5)
    assert compare(cache, 0, 8, 2, 4, None) == (4, 4), "random blocks differ"
    for (src, length), (dst, _) in zip(cache._runs(0, 8), cache._runs(8, 8)):
        cache.buf.write(dst, cache.buf.read(src, length))
    assert compare(cache, 0, 8, 2, 4, None) == (4, 0)
    # One byte of the last layer's chunk 2 (blocks 12-13).
    off, _ = cache._runs(12, 1)[-1]
    cache.buf.write(off + 100, bytes([cache.buf.read(off + 100, 1)[0] ^ 1]))
    assert compare(cache, 0, 8, 2, 4, None) == (4, 1)
    assert compare(cache, 0, 8, 2, 4, {0, 1, 3}) == (3, 0), "chunk 2 never copied: not compared"
    cache.poison(8, 2)
    assert not cache.same(0, 8, 2)
