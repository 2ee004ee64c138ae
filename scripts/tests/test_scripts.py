"""The scripts CI runs, checked where they can go wrong on a new machine: cargo's target
directory wherever CARGO_TARGET_DIR puts it, and install-test-deps.sh against stand-ins for
apt-get and systemctl (it must start no service and leave none enabled at boot, on a machine
where systemd runs and in a container where it does not).

Run: pytest scripts/tests"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"


def test_target_dir_is_where_cargo_builds(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in {"CARGO_TARGET_DIR", "CARGO_BUILD_TARGET_DIR"}}
    out = subprocess.run([str(SCRIPTS / "target-dir.sh")], env=env, cwd=tmp_path,
                         capture_output=True, text=True, check=True)
    # (A cargo config may move it; where none does, it is target/ here.)
    assert Path(out.stdout.strip()).is_absolute()
    elsewhere = tmp_path / "elsewhere"
    out = subprocess.run([str(SCRIPTS / "target-dir.sh")], env={**env, "CARGO_TARGET_DIR": str(elsewhere)},
                         cwd=tmp_path, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(elsewhere)


@pytest.mark.parametrize("script", ["test.sh", "check-hip-abi.sh", "hip-nvidia/build.sh", "build-gpu-artifacts.sh",
                                    "fuzz.sh", "vllm-conformance.sh"])
def test_scripts_find_builds_through_cargo_not_a_fixed_target(script):
    """A path under a literal target/ is wrong once CARGO_TARGET_DIR is set: these ask
    scripts/target-dir.sh instead."""
    text = (SCRIPTS / script).read_text()
    code = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    fixed = [line for line in code if re.search(r"(?<![\w$}])target/", line)]
    assert not fixed, f"{script} hard-codes cargo's target directory: {fixed}"


# Each stand-in appends its argv to $CALLS. apt-get "installs" as Debian's maintainer scripts
# do: before starting a package's service it asks policy-rc.d, and starts it unless refused
# (101); systemctl only records.
APT_GET = r"""#!/bin/sh
echo "apt-get $*" >> "$CALLS"
[ "$1" = install ] || exit 0
for p in "$@"; do
  case $p in
    redis-server|prometheus)
      policy="$KVD_TEST_DEPS_ROOT/usr/sbin/policy-rc.d"
      if [ -x "$policy" ] && { "$policy" "$p" start; [ $? -eq 101 ]; }; then
        echo "start refused $p" >> "$CALLS"
      else
        echo "started $p" >> "$CALLS"
      fi ;;
  esac
done
"""
SYSTEMCTL = """#!/bin/sh
echo "systemctl $*" >> "$CALLS"
"""
# What install-test-deps.sh may run from the machine (python3 for its checks); no redis,
# promtool or systemd-analyze, so it installs them.
TOOLS = ["bash", "sh", "env", "python3", "ldd", "grep", "cat", "rm", "mv", "chmod", "tee", "mkdir", "printf"]


def stand_ins(tmp_path: Path, systemd_runs: bool, policy: bytes | None) -> tuple[dict[str, str], Path, Path]:
    bin_dir, root = tmp_path / "bin", tmp_path / "root"
    bin_dir.mkdir()
    (root / "usr/sbin").mkdir(parents=True)
    if systemd_runs:
        (root / "run/systemd/system").mkdir(parents=True)
    if policy is not None:
        (root / "usr/sbin/policy-rc.d").write_bytes(policy)
        (root / "usr/sbin/policy-rc.d").chmod(0o755)
    for tool in TOOLS:
        found = shutil.which(tool)
        if found:
            (bin_dir / tool).symlink_to(found)
    for name, body in (("apt-get", APT_GET), ("systemctl", SYSTEMCTL), ("id", "#!/bin/sh\necho 0\n")):
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    calls = tmp_path / "calls"
    calls.write_text("")
    env = {"PATH": str(bin_dir), "CALLS": str(calls), "KVD_TEST_DEPS_ROOT": str(root), "HOME": str(tmp_path)}
    return env, root, calls


@pytest.mark.parametrize("systemd_runs", [True, False], ids=["systemd-running", "no-systemd"])
@pytest.mark.parametrize("policy", [None, b"#!/bin/sh\nexit 101\n"], ids=["no-policy", "image-policy"])
def test_install_test_deps_starts_no_service_and_leaves_none_enabled(tmp_path, systemd_runs, policy):
    env, root, calls = stand_ins(tmp_path, systemd_runs, policy)
    run = subprocess.run(["bash", str(SCRIPTS / "install-test-deps.sh")], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    log = calls.read_text().splitlines()
    install = next(line for line in log if line.startswith("apt-get install"))
    assert "redis-server" in install.split() and "prometheus" in install.split(), log
    assert not [line for line in log if line.startswith("started")], f"a service was started: {log}"
    want = "systemctl disable --now" if systemd_runs else "systemctl disable"
    disabled = [line for line in log if line.startswith("systemctl")]
    assert disabled == [f"{want} redis-server prometheus"], log
    # The stand-in policy is gone; an image's own is back as it was.
    kept = root / "usr/sbin/policy-rc.d"
    assert (kept.read_bytes() if kept.exists() else None) == policy
    assert policy is None or os.access(kept, os.X_OK)
    assert not (root / "usr/sbin/policy-rc.d.kvd-saved").exists()
