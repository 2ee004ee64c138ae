"""scripts/pip_staged_install.py: the batches it cuts, and a real staged install from PyPI into
a new virtualenv that ends with the same packages one `pip install` would have put there.

Run: pytest scripts/tests"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "pip_staged_install.py"

spec = importlib.util.spec_from_file_location("pip_staged_install", SCRIPT)
assert spec is not None and spec.loader is not None
staged = importlib.util.module_from_spec(spec)
sys.modules["pip_staged_install"] = staged
spec.loader.exec_module(staged)


def test_batches_stay_under_the_limit_and_keep_every_wheel():
    W = staged.Wheel
    wheels = [W("a", "u/a", 500), W("b", "u/b", 300), W("c", "u/c", 250), W("d", "u/d", 40),
              W("e", "u/e", None), W("f", "u/f", 900), W("g", "u/g", 10)]
    plan = staged.batches(wheels, 600)
    assert sorted(w.name for b in plan for w in b) == sorted(w.name for w in wheels)
    # Unknown size and over-the-limit wheels go alone; every other batch fits the limit.
    assert [W("e", "u/e", None)] in plan and [W("f", "u/f", 900)] in plan
    for b in plan:
        if len(b) > 1:
            assert sum(w.size for w in b) <= 600, b
    # A limit of zero gives one wheel a command.
    assert all(len(b) == 1 for b in staged.batches(wheels, 0))


def test_planned_pins_each_file_to_its_hash():
    report = {"install": [
        {"metadata": {"name": "x", "version": "1"},
         "download_info": {"url": "https://files.example/x-1-py3-none-any.whl",
                           "archive_info": {"hashes": {"sha256": "ab12"}}}},
        {"metadata": {"name": "y", "version": "2"},
         "download_info": {"url": "https://files.example/y-2.tar.gz", "archive_info": {}}},
    ]}
    assert staged.planned(report) == [("x", "https://files.example/x-1-py3-none-any.whl#sha256=ab12"),
                                      ("y", "https://files.example/y-2.tar.gz")]


def test_a_staged_install_matches_what_pip_resolves(tmp_path):
    """requests and its four dependencies, one wheel a pip command (--batch-mb 0): the
    environment ends with the versions pip's own resolution names, and `pip check` passes."""
    env_dir = tmp_path / "env"
    venv.create(env_dir, with_pip=True)
    py = str(env_dir / "bin" / "python")
    req = "requests==2.32.3"
    report = tmp_path / "report.json"
    subprocess.run([py, "-m", "pip", "install", "-q", "--dry-run", "--report", str(report), req], check=True)
    want = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.loads(report.read_text())["install"]}
    assert len(want) == 5, want

    out = subprocess.run([py, str(SCRIPT), "--batch-mb", "0", req], capture_output=True, text=True, check=True)
    assert "in 5 pip commands" in out.stdout, out.stdout

    listed = subprocess.run([py, "-m", "pip", "list", "--format", "json"], capture_output=True, text=True,
                            check=True)
    have = {p["name"].lower(): p["version"] for p in json.loads(listed.stdout)}
    for name, version in want.items():
        assert have.get(name) == version, (name, have.get(name), version)
    subprocess.run([py, "-c", "import requests, urllib3, idna, certifi, charset_normalizer"], check=True)
