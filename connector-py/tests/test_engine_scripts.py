"""The real-engine scripts' control flow without vLLM or a GPU: scripts/vllm_engine_check.py and
benches/engine.py against the stand-in in data/fake_vllm (a prefix cache, a connector that
keeps everything, vLLM's metrics API). What the real engine does is checked on the GPU host
(scripts/device-vllm.sh run check|bench); this keeps the scripts themselves from breaking:
deadlines that fire, results that reach the summary, the table."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FAKE = Path(__file__).resolve().parent / "data" / "fake_vllm"
MODEL = Path(__file__).resolve().parent / "data" / "tiny-llama"


def run(script: str, *args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    e = dict(os.environ, PYTHONPATH=f"{FAKE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **(env or {}))
    return subprocess.run([sys.executable, str(ROOT / script), *args], env=e, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def test_engine_check_passes_with_a_connector_and_reports_tp2_skipped(tmp_path):
    r = run("scripts/vllm_engine_check.py", "--arm", "offload", "--scenarios", "v1,tp2", "--out", str(tmp_path),
            "--model", str(MODEL))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ENGINE CHECK OK (skipped: tp2)" in r.stdout
    assert "CHECK ok   A from the connector: same tokens as from the GPU prefix cache" in r.stdout
    assert "World size (2) is larger than the number of available GPUs" in r.stdout
    res = json.loads((tmp_path / "vllm-engine-check.json").read_text())
    assert res["v1"]["status"] == "passed" and res["tp2"]["status"] == "skipped"


def test_a_stalled_generate_fails_by_its_deadline_with_the_step_it_stopped_in(tmp_path):
    r = run("scripts/vllm_engine_check.py", "--arm", "offload", "--scenarios", "v1", "--out", str(tmp_path),
            "--model", str(MODEL), "--gen-timeout", "2", env={"FAKE_STALL": "4"})
    assert r.returncode == 1
    assert "STALL: push 2/4" in r.stdout and "ENGINE CHECK FAILED: v1" in r.stdout


def test_a_step_that_never_returns_is_ended_by_the_watchdog(tmp_path):
    r = run("scripts/vllm_engine_check.py", "--arm", "offload", "--scenarios", "v1", "--out", str(tmp_path),
            "--model", str(MODEL), "--gen-timeout", "1", "--watchdog-margin", "1", env={"FAKE_BLOCK": "3"})
    assert r.returncode == 1
    assert "did not finish (watchdog)" in r.stdout


def test_without_a_connector_the_check_fails_where_the_prompt_should_come_back(tmp_path):
    # The scenario's pushes evict A from the GPU; with no connector nothing serves it again.
    r = run("scripts/vllm_engine_check.py", "--arm", "offload", "--scenarios", "v1", "--out", str(tmp_path),
            "--model", str(MODEL), env={"FAKE_NO_CONNECTOR": "1"})
    assert r.returncode == 1
    assert "CHECK FAIL A served by the connector" in r.stdout


def test_engine_bench_replays_every_arm_and_writes_the_table(tmp_path):
    r = run("benches/engine.py", "--arms", "none,offload", "--concurrency", "1,4", "--turns", "3", "--out", str(tmp_path),
            "--model", str(MODEL), "--budget-s", "200")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    md = (tmp_path / "engine.md").read_text()
    rows = [l for l in md.splitlines() if l.startswith("| none |") or l.startswith("| offload |")]
    assert len(rows) == 4 and all("3/3" in l or "12/12" in l for l in rows), md
    assert "LMCache MP: not run" in md
    res = json.loads((tmp_path / "engine.json").read_text())
    cells = {(a["arm"], c["concurrency"]): c for a in res["results"] for c in a["cells"]}
    assert all(c["status"] == "ok" for c in cells.values())
    # The same workload in both arms: the same prompt tokens, whatever served them.
    assert cells[("none", 4)]["prompt_tokens"] == cells[("offload", 4)]["prompt_tokens"]
    assert cells[("none", 4)]["connector_tokens"] == 0


def test_engine_bench_dry_run_needs_no_engine(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "benches/engine.py"), "--dry-run", "--out", str(tmp_path), "--model",
                        str(MODEL)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "# c=16: {'users': 16, 'requests': 192" in r.stdout
