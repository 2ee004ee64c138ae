"""benches/lanes.py against a real kvd (the build scripts/test.sh made, as both builds): a few
phases at a small size, so that the bench keeps running."""

from __future__ import annotations

import os
import re
import sys

import pytest

BENCHES = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, BENCHES)

import lanes  # noqa: E402


def test_the_lanes_bench_times_retrieves_alone_and_under_stores_for_both_builds(tmp_path, capsys):
    kvd_bin = os.environ.get("KVD_BIN")
    if not kvd_bin:
        pytest.skip("KVD_BIN is unset: scripts/test.sh builds kvd and sets it")
    assert lanes.main(["--kvd", kvd_bin, "--kvd-base", kvd_bin, "--rounds", "1", "--seconds", "0.3",
                       "--layers", "4", "--store-chunks", "2", "--inflight", "2", "--pool-gib", "0.5", "--probe-chunks", "2",
                       "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rows = re.findall(r"^\| (kvd(?:-base)?) \| (alone|with stores) \| ([\d.]+) \|.*\| ([\d.]+|–) \|$", out, re.M)
    # The retrieve lane's first job, timed apart: one figure a round.
    assert len(re.findall(r"^\| kvd(?:-base)? \| (?:alone|with stores) \|(?: [^|]+ \|){4} [\d.]+ \|", out, re.M)) == 4, out
    assert sorted((b, p) for b, p, _, _ in rows) == [("kvd", "alone"), ("kvd", "with stores"),
                                                     ("kvd-base", "alone"), ("kvd-base", "with stores")], out
    for build, phase_, p50, gbps in rows:
        assert float(p50) > 0
        assert (gbps == "–") == (phase_ == "alone"), out
        if phase_ == "with stores":
            assert float(gbps) > 0
    assert len(list(tmp_path.glob("lanes-kvd-[0-9]*.log"))) == 2 and len(list(tmp_path.glob("lanes-kvd-base-*.log"))) == 2
