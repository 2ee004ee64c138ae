"""The operator kit against a real kvd: every kvd series the Grafana dashboard and the alert
rules read exists on a live kvd's /metrics, the vLLM series are the ones vLLM 0.33 exports, the
rules pass promtool (check and unit tests), the systemd unit passes `systemd-analyze verify`,
and the command lines the unit, the DaemonSet and the Dockerfile ship start a kvd whose
/healthz their probes find. The Dockerfile's build steps run through build-steps.py.

Run: pytest deploy/tests (kvd from $KVD_BIN, else the newest {release,debug}/kvd in cargo's
target directory: target/, or CARGO_TARGET_DIR)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
# Series Prometheus makes itself rather than scraping them.
SYNTHETIC = {"up"}
NAME = re.compile(r"\b(kvd_[a-z0-9_]+|process_[a-z0-9_]+|vllm:[a-z0-9_:]+)")


def target_dir() -> Path:
    """Cargo's target directory, as cargo resolves it (CARGO_TARGET_DIR, a cargo config)."""
    out = subprocess.run([str(ROOT / "scripts/target-dir.sh")], capture_output=True, text=True, check=True)
    return Path(out.stdout.strip())


def kvd_binary() -> str:
    env = os.environ.get("KVD_BIN")
    if env:
        return env
    built = [p for p in (target_dir() / prof / "kvd" for prof in ("release", "debug")) if p.exists()]
    if not built:
        pytest.fail("no kvd binary: build it with `cargo build -p kvd-server` or set KVD_BIN")
    return str(max(built, key=lambda p: p.stat().st_mtime))


class Kvd:
    """A kvd started from an exact command line; ``http`` is its /healthz and /metrics address."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(argv, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                                     env={**os.environ, **(env or {})})
        self.log: list[str] = []
        self.http = ""
        found = threading.Event()

        def pump() -> None:
            assert self.proc.stderr is not None
            for line in self.proc.stderr:
                self.log.append(line)
                m = re.search(r"serving /healthz and /metrics on http://([0-9.:]+)", line)
                if m:
                    self.http = m.group(1)
                    found.set()

        threading.Thread(target=pump, daemon=True).start()
        if not found.wait(30):
            self.stop()
            pytest.fail("kvd did not start:\n" + "".join(self.log))

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://{self.http}{path}", timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def wait_healthy(self, within: float = 30) -> None:
        deadline = time.monotonic() + within
        while self.get("/healthz")[0] != 200:
            assert time.monotonic() < deadline, "kvd not healthy:\n" + "".join(self.log)
            time.sleep(0.05)

    def series(self) -> set[str]:
        code, body = self.get("/metrics")
        assert code == 200
        return {re.split(r"[{ ]", line, maxsplit=1)[0] for line in body.splitlines() if line and not line.startswith("#")}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def local(tmp: Path) -> list[str]:
    """Flags that keep a test kvd to free ports, a small pool and a private fd socket; given
    last, they override what the shipped command line says (kvd takes a flag's last value)."""
    return ["--host", "127.0.0.1", "--port", "0", "--http-host", "127.0.0.1", "--http-port", "0",
            "--fd-socket", str(tmp / "fd.sock"), "--l1-size-gb", "0.25"]


@pytest.fixture
def started():
    running: list[Kvd] = []

    def start(argv: list[str], env: dict[str, str] | None = None) -> Kvd:
        k = Kvd(argv, env)
        running.append(k)
        return k

    yield start
    for k in running:
        k.stop()


def dashboard_exprs() -> list[str]:
    d = json.loads((DEPLOY / "grafana/kvd.json").read_text())
    exprs = [t["expr"] for p in d["panels"] for t in p.get("targets", [])]
    # Grafana's label_values(SELECTOR, LABEL) in variables: the selector is PromQL.
    for v in d["templating"]["list"]:
        if isinstance(v.get("query"), dict):
            m = re.fullmatch(r"label_values\((.*), *\w+\)", v["query"]["query"])
            assert m, v["query"]["query"]
            exprs.append(m.group(1))
    return exprs


def alert_rules() -> list[dict]:
    doc = yaml.safe_load((DEPLOY / "prometheus/kvd-alerts.yml").read_text())
    return [r for g in doc["groups"] for r in g["rules"]]


def vllm_list() -> set[str]:
    lines = (DEPLOY / "grafana/vllm-metrics.txt").read_text().splitlines()
    return {line.strip() for line in lines if line.strip() and not line.startswith("#")}


def kvd_in_vllm() -> set[str]:
    """The series the kvd connector adds to vLLM's /metrics (its own counters, named in
    connector-py/python/kvd/vllm_stats.py), as Prometheus shows them."""
    src = (DEPLOY.parent / "connector-py/python/kvd/vllm_stats.py").read_text()
    return {f"{n}_total" for n in re.findall(r'^[A-Z_]+ = "(vllm:kvd_[a-z_]+)"$', src, re.M)}


def names_in(expr: str) -> set[str]:
    return set(NAME.findall(expr))


def test_every_kvd_series_the_dashboard_and_alerts_read_exists_on_a_live_kvd(tmp_path, started):
    # An L2 URL nobody answers: the L2 families exist (kvd_l2_up at 0) and kvd still serves.
    k = started([kvd_binary(), "serve", *local(tmp_path), "--l2", "redis://127.0.0.1:9"])
    k.wait_healthy()
    live = k.series()
    exprs = dashboard_exprs() + [r["expr"] for r in alert_rules()]
    assert len(exprs) > 40
    used: set[str] = set()
    for e in exprs:
        found = names_in(e)
        bare = set(re.findall(r"\b([a-zA-Z_][a-zA-Z0-9_]*)\{", e)) - {n for n in found}
        assert found or bare <= SYNTHETIC, f"no metric name recognised in {e!r}"
        assert bare <= SYNTHETIC | {n.split(":")[-1] for n in found}, f"unrecognised series {bare} in {e!r}"
        used |= found
    kvd_side = {n for n in used if not n.startswith("vllm:")}
    missing = sorted(kvd_side - live)
    assert not missing, f"not on a live kvd's /metrics: {missing}"
    assert {"kvd_build_info", "process_resident_memory_bytes", "process_open_fds", "process_cpu_seconds_total",
            "kvd_l2_up", "kvd_events_dropped_total"} <= kvd_side
    vllm_side = {n for n in used if n.startswith("vllm:")}
    unlisted = sorted(vllm_side - vllm_list() - kvd_in_vllm())
    assert not unlisted, f"vLLM series neither in deploy/grafana/vllm-metrics.txt nor the kvd connector's: {unlisted}"
    assert kvd_in_vllm() <= used, "the dashboard and alerts read every counter the kvd connector adds to vLLM"
    assert vllm_side, "the dashboard shows vLLM's offload metrics"


def test_the_vllm_list_names_what_vllm_exports():
    """Each listed series, less the suffix prometheus_client adds, is a metric name in vLLM's
    sources. Needs vLLM installed (scripts/vllm-conformance.sh makes such a venv)."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        pytest.skip("vllm is not installed here: the names were checked against the vLLM 0.33.0 wheel")
    src = Path(vllm.__file__).parent
    text = "\n".join(p.read_text(errors="replace") for p in src.rglob("*.py"))
    for name in sorted(vllm_list()):
        base = re.sub(r"_(total|bucket|sum|count)$", "", name)
        assert f'"{base}"' in text, f"{base} is not a metric name in vLLM {vllm.__version__}"


def substituted(expr: str) -> str:
    for var, value in (("$__rate_interval", "5m"), ("$vllm_job", "vllm"), ("$instance", ".*"), ("$job", "kvd")):
        expr = expr.replace(var, value)
    return expr


def test_dashboard_queries_are_valid_promql(tmp_path):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus)")
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:q{i}", "expr": substituted(e)} for i, e in enumerate(dashboard_exprs())]}]}
    f = tmp_path / "dashboard-rules.yml"
    f.write_text(yaml.safe_dump(rules))
    out = subprocess.run([promtool, "check", "rules", str(f)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_dashboard_panels_are_well_formed():
    d = json.loads((DEPLOY / "grafana/kvd.json").read_text())
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    variables = {v["name"] for v in d["templating"]["list"]}
    for p in d["panels"]:
        if p["type"] == "row":
            continue
        assert p["targets"], p["title"]
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        for t in p["targets"]:
            for var in re.findall(r"\$(\w+)", t["expr"]):
                assert var in variables | {"__rate_interval"}, f"{p['title']}: ${var} is not a dashboard variable"
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]


def test_alert_rules_are_complete_and_pass_promtool():
    for r in alert_rules():
        assert r["alert"] and r["expr"], r
        assert r["labels"]["severity"] in {"critical", "warning", "info"}, r["alert"]
        assert r["annotations"]["summary"] and r["annotations"]["description"], r["alert"]
    names = {r["alert"] for r in alert_rules()}
    # What the issue asks the rules to cover.
    assert {"KvdNotReady", "KvdL2Down", "KvdCopyErrors", "KvdPoolFullRefusals", "KvdEngineLoadFailures"} <= names
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus); YAML and names checked only")
    for args in (["check", "rules", "kvd-alerts.yml"], ["test", "rules", "kvd-alerts.test.yml"]):
        out = subprocess.run([promtool, *args], capture_output=True, text=True, cwd=DEPLOY / "prometheus")
        assert out.returncode == 0, out.stdout + out.stderr
    # Every alert has a firing case in the unit tests.
    tests = yaml.safe_load((DEPLOY / "prometheus/kvd-alerts.test.yml").read_text())["tests"]
    fired = {c["alertname"] for t in tests for c in t["alert_rule_test"] if c.get("exp_alerts")}
    assert fired == names


def exec_start(unit: str) -> list[str]:
    joined = re.sub(r"\\\n\s*", " ", unit)
    line = next(line for line in joined.splitlines() if line.startswith("ExecStart="))
    return shlex.split(line[len("ExecStart="):])


def test_the_systemd_unit_verifies_and_its_command_line_serves(tmp_path, started):
    unit = (DEPLOY / "systemd/kvd.service").read_text()
    argv = exec_start(unit)
    assert argv[0] == "/usr/local/bin/kvd" and argv[-1] == "$KVD_ARGS"
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed (Debian: apt-get install systemd)")
    # verify checks that ExecStart's binary exists: point it at the one under test.
    f = tmp_path / "kvd.service"
    f.write_text(unit.replace("/usr/local/bin/kvd", kvd_binary()))
    out = subprocess.run([tool, "verify", str(f)], capture_output=True, text=True)
    assert out.returncode == 0 and not out.stderr.strip() and not out.stdout.strip(), out.stdout + out.stderr
    # The unit's flags, then what an operator would put in KVD_ARGS.
    k = started([kvd_binary(), *argv[1:-1], *local(tmp_path)])
    k.wait_healthy()


def test_the_systemd_unit_shows_how_to_let_kvd_write_a_disk_and_read_credentials(tmp_path):
    """ProtectSystem=strict makes a --disk path read-only to kvd (which then names
    ReadWritePaths=): the unit has commented examples of that and of LoadCredential=, which
    verify once uncommented."""
    unit = (DEPLOY / "systemd/kvd.service").read_text()
    examples = re.findall(r"^#((?:ReadWritePaths|LoadCredential)=\S+)$", unit, re.M)
    assert any(e.startswith("ReadWritePaths=/") for e in examples), examples
    creds = [e.split("=", 1)[1].split(":")[0] for e in examples if e.startswith("LoadCredential=")]
    assert "l2-password" in creds, examples
    # Where systemd puts the credential is the path the comment's KVD_ARGS names.
    assert "--l2-password-file /run/credentials/kvd.service/l2-password" in unit
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed (Debian: apt-get install systemd)")
    f = tmp_path / "kvd.service"
    f.write_text(re.sub(r"^#((?:ReadWritePaths|LoadCredential)=)", r"\1", unit, flags=re.M)
                 .replace("/usr/local/bin/kvd", kvd_binary()))
    out = subprocess.run([tool, "verify", str(f)], capture_output=True, text=True)
    assert out.returncode == 0 and not out.stderr.strip() and not out.stdout.strip(), out.stdout + out.stderr


DAEMONSET = DEPLOY / "kubernetes/kvd-daemonset.yaml"


def manifest(text: str | None = None) -> list[dict]:
    return [d for d in yaml.safe_load_all(DAEMONSET.read_text() if text is None else text) if d]


def daemonset(text: str | None = None) -> dict:
    (d,) = [d for d in manifest(text) if d["kind"] == "DaemonSet"]
    return d


# A commented-out line of YAML in the manifest (an example to uncomment), as opposed to prose:
# a list item or one of the keys the examples use.
EXAMPLE_LINE = re.compile(r"^(\s*)# (\s*(?:- |name: |mountPath: |hostPath:|path: |type: ).*)$")


def uncommented(text: str) -> str:
    """The manifest with its commented examples uncommented, as an operator would."""
    return "\n".join(EXAMPLE_LINE.sub(r"\1\2", line) for line in text.splitlines()) + "\n"


def test_the_daemonset_creates_its_namespace_and_names_the_image_its_comment_builds():
    docs = manifest()
    created = {d["metadata"]["name"] for d in docs if d["kind"] == "Namespace"}
    for d in docs:
        ns = d["metadata"].get("namespace")
        assert ns is None or ns in created, f"{d['kind']} {d['metadata']['name']} names namespace {ns}, which nothing creates"
    kinds = [d["kind"] for d in docs]
    assert kinds.index("Namespace") < kinds.index("DaemonSet"), "kubectl apply makes the namespace first"
    (c,) = daemonset()["spec"]["template"]["spec"]["containers"]
    version = re.search(r'^version = "([^"]+)"', (ROOT / "Cargo.toml").read_text(), re.M).group(1)
    assert c["image"] == f"kvd:{version}", "the image is kvd's, tagged with its version: " + c["image"]
    builds = [line for line in DAEMONSET.read_text().splitlines()
              if line.startswith("#") and "docker build" in line]
    assert builds, "a comment says how to build the image"
    argv = shlex.split(builds[0].lstrip("# "))
    assert argv[argv.index("-f") + 1] == "deploy/docker/Dockerfile" and argv[-1] == "."
    assert argv[argv.index("-t") + 1] == c["image"], "the comment builds the image the DaemonSet runs"


def test_the_daemonset_disk_example_uncommented_serves_a_disk_tier(tmp_path, started):
    text = DAEMONSET.read_text()
    plain = daemonset()
    d = daemonset(uncommented(text))
    pod = d["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    (before,) = plain["spec"]["template"]["spec"]["containers"]
    assert len(c["args"]) > len(before["args"]), "a commented --disk example in args"
    flags = dict(zip(c["args"][1::2], c["args"][2::2]))
    assert "--disk" in flags and float(flags["--disk-size-gb"]) > 0, flags
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["disk"]["hostPath"]["type"] == "DirectoryOrCreate", volumes["disk"]
    assert Path(flags["--disk"]).parent == Path(mounts["disk"]), "the disk file is on the disk volume"
    # Uncommented, the example changes nothing else.
    assert {k: v for k, v in d.items() if k != "spec"} == {k: v for k, v in plain.items() if k != "spec"}
    # The container's command line with the volume at a local directory: kvd serves the tier.
    local_disk = tmp_path / "disk"
    local_disk.mkdir()
    argv = [a.replace(mounts["disk"], str(local_disk)) for a in [*c["command"], *c["args"]]]
    k = started([kvd_binary(), *argv[1:], *local(tmp_path), "--disk-size-gb", "0.05"],
                env={e["name"]: e["value"] for e in c["env"]})
    k.wait_healthy()
    disk = json.loads(k.get("/healthz")[1])["disk"]
    assert disk["state"] == "up", disk
    assert disk["drives"][0]["path"].startswith(str(local_disk)), disk


def test_the_daemonset_is_well_formed_and_its_probes_find_healthz(tmp_path, started):
    d = daemonset()
    assert (d["apiVersion"], d["kind"]) == ("apps/v1", "DaemonSet")
    spec = d["spec"]
    labels = spec["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= labels.items(), "the selector matches the pods"
    pod = spec["template"]["spec"]
    (c,) = pod["containers"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    argv = [*c["command"], *c["args"]]
    flags = dict(zip(argv[2::2], argv[3::2]))
    assert argv[:2] == ["/usr/local/bin/kvd", "serve"]
    assert int(flags["--http-port"]) == ports["http"] and int(flags["--port"]) == ports["zmq"]
    assert flags["--http-host"] == "0.0.0.0", "the kubelet probes the pod's address"
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        get = c[probe]["httpGet"]
        assert get["path"] == "/healthz" and get["port"] == "http", probe
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert Path(flags["--fd-socket"]).parent == Path(mounts["fd-socket"])
    assert "hostPath" in volumes["fd-socket"], "vLLM pods share the fd socket through the host"
    assert pod["hostIPC"] is True
    assert pod["terminationGracePeriodSeconds"] >= 30
    # The container's command line serves, and the probes' path answers 200 once ready.
    k = started([kvd_binary(), *argv[1:], *local(tmp_path)], env={e["name"]: e["value"] for e in c["env"]})
    k.wait_healthy()
    assert k.get(c["livenessProbe"]["httpGet"]["path"])[0] == 200


def test_the_dockerfile_builds_without_docker_and_its_healthcheck_tells_the_truth(tmp_path, started):
    """build-steps.py runs the Dockerfile's steps (a debug build, to keep it short); the image's
    entrypoint then serves and its HEALTHCHECK command passes against it, and fails once kvd
    has stopped. A CARGO_TARGET_DIR on the host does not reach the build (Docker's would not
    see it), and the image has CA certificates for TLS to an L2."""
    cache = Path(os.environ.get("KVD_DOCKER_STEPS_CACHE") or target_dir() / "docker-steps-cache")
    out = tmp_path / "image"
    run = subprocess.run(
        [str(DEPLOY / "docker/build-steps.py"), "--build-arg", "PROFILE=dev", "--build-arg", "KVD_GIT_COMMIT=0123456789ab",
         "--cache-dir", str(cache), str(out)],
        # Where no directory can be made: a build that used it would fail at once.
        env={**os.environ, "CARGO_TARGET_DIR": "/dev/null/kvd-target"},
        capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    image = json.loads((out / "image.json").read_text())
    kvd = out / "rootfs/usr/local/bin/kvd"
    entry = image["entrypoint"]
    assert entry[0] == "/usr/local/bin/kvd" and kvd.exists()
    assert (out / "rootfs/run/kvd").is_dir(), "the fd socket's directory is in the image"
    # Where kvd's TLS (rustls-native-certs, through openssl-probe) looks on Debian.
    bundle = out / "rootfs/etc/ssl/certs/ca-certificates.crt"
    assert bundle.is_file(), "no CA certificates: TLS to an L2 could not verify its server"
    roots = ssl.create_default_context(cafile=str(bundle)).cert_store_stats()["x509_ca"]
    assert roots > 50, f"{bundle} holds {roots} CA certificates"
    assert {"5555", "8080"} <= set(image["expose"].split())
    k = started([str(kvd), *entry[1:], *local(tmp_path)])
    k.wait_healthy()
    # The build argument reached kvd_build_info.
    assert 'commit="0123456789ab"' in k.get("/metrics")[1]
    health = image["healthcheck"]
    assert "--start-period" in health
    check = health.split(" CMD ", 1)[1].replace("/8080", "/" + k.http.rsplit(":", 1)[1])
    assert subprocess.run(["sh", "-c", check], timeout=10).returncode == 0
    k.stop()
    assert subprocess.run(["sh", "-c", check], timeout=10).returncode != 0
