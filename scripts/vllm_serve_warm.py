#!/usr/bin/env python3
"""``python -m kvd.warm`` against a real ``vllm serve`` (vLLM's OpenAI server), restarted, on
one kvd (``scripts/device-vllm.sh run serve``): what an operator's rollout does.

1. kvd starts; ``vllm serve`` starts with kvd's connector and ``kvd.warm_group`` "replica-0".
2. Four prompts (token ids, lengths that are not chunk multiples) go to ``/v1/completions``,
   greedy, ``return_token_ids``, twice: the second answer of each, a GPU prefix-cache hit that
   computes only the prompt's last block, is the reference (a full prefill may round
   differently from a hit, and dummy weights leave the logits nearly tied; the full prefill's
   tokens are printed beside it). kvd remembers the prompts.
3. The server is stopped (SIGINT, as a rollout stops a pod) and a new one starts on the same
   port, same group, its GPU cache empty.
4. ``python -m kvd.warm --group replica-0 --engine http://…`` must exit 0 having replayed the
   four prompts; the new server counts them as the connector's (``external_kv_transfer``) and
   kvd counts the retrieved bytes.
5. The warm once more, skipping prompts older than the restart (``--max-age``): it must replay
   none. Its replays were marked (``kv_transfer_params`` ``kvd.warm``), so the new server did
   not remember them again as new prompts.
6. The four prompts again, as the returning traffic: each must be a GPU prefix-cache hit
   (nothing more from the connector) with the reference's tokens.

Prints "| " lines, CHECK lines and, when every check passed, SERVE WARM CHECK OK; exits 1
otherwise with each server's last log lines.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benches"))

import vllm_harness as vh  # noqa: E402
from kvd.testing import free_port  # noqa: E402 - off the kernel's ephemeral range, which a reused port must avoid

GROUP = "replica-0"
LENGTHS = (1000, 1300, 777, 1555)  # tokens: none a multiple of kvd's 256-token chunks
MAX_OUT = 8


def out(*parts: object) -> None:
    print("|", *parts, flush=True)


def post(url: str, body: dict, timeout_s: float = 60.0) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read())


def sources(http: str) -> dict[str, float]:
    """``vllm:prompt_tokens_by_source_total`` by source, from the server's /metrics."""
    got = {"local_compute": 0.0, "local_cache_hit": 0.0, "external_kv_transfer": 0.0}
    for k, v in vh.prom_text(vh.fetch(f"{http}/metrics"), ("vllm:prompt_tokens_by_source_total",)).items():
        m = re.search(r'source="([a-z_]+)"', k)
        if m:
            got[m.group(1)] = got.get(m.group(1), 0.0) + v
    return got


class Serve:
    """One ``vllm serve`` process."""

    def __init__(self, args: argparse.Namespace, kvd_url: str, port: int, n: int) -> None:
        self.http = f"http://127.0.0.1:{port}"
        self.log_path = os.path.join(args.out, f"serve-{n}.log")
        kv = vh.kv_transfer("kvd", kvd_url=kvd_url, kvd_extra={"kvd.warm_group": GROUP})
        cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", args.model, "--port", str(port),
               "--host", "127.0.0.1", "--served-model-name", "m", "--load-format", "dummy", "--skip-tokenizer-init",
               "--enforce-eager", "--gpu-memory-utilization", str(args.gpu_mem), "--num-gpu-blocks-override",
               str(args.gpu_blocks), "--max-model-len", "4096", "--kv-transfer-config", json.dumps(kv)]
        self.log = open(self.log_path, "w")
        self.log.write(" ".join(cmd) + "\n")
        self.log.flush()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.t0 = time.monotonic()

    def wait_healthy(self, timeout_s: float) -> float:
        while time.monotonic() - self.t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited {self.proc.returncode} while starting; {self.tail()}")
            try:
                if urllib.request.urlopen(f"{self.http}/health", timeout=2).status == 200:
                    return time.monotonic() - self.t0
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1)
        raise RuntimeError(f"vllm serve not healthy in {timeout_s:.0f} s; {self.tail()}")

    def complete(self, tokens: list[int]) -> list[int]:
        r = post(f"{self.http}/v1/completions", {"model": "m", "prompt": tokens, "max_tokens": MAX_OUT,
                                                 "temperature": 0.0, "ignore_eos": True, "return_token_ids": True})
        return list(r["choices"][0]["token_ids"])

    def stop(self, timeout_s: float = 60.0) -> None:
        """SIGINT to the server's process group, then waits for every process of it (the engine
        core holds the GPU memory the next server needs); SIGKILL past ``timeout_s``."""
        t_end = time.monotonic() + timeout_s
        try:
            os.killpg(self.proc.pid, signal.SIGINT)
            while time.monotonic() < t_end:
                self.proc.poll()
                os.killpg(self.proc.pid, 0)  # raises once the group is gone
                time.sleep(0.5)
            os.killpg(self.proc.pid, signal.SIGKILL)
            while True:
                self.proc.poll()
                os.killpg(self.proc.pid, 0)
                time.sleep(0.2)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.log.close()

    def tail(self, n: int = 15) -> str:
        if not self.log.closed:
            self.log.flush()
        with open(self.log_path, errors="replace") as f:
            return f"{self.log_path}, last lines: " + " | ".join(l.rstrip() for l in f.readlines()[-n:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kvd", default=vh.default_kvd())
    ap.add_argument("--model", default=vh.default_model())
    ap.add_argument("--out", default=os.path.join(ROOT, ".device", "out"))
    ap.add_argument("--gpu-blocks", type=int, default=1024)
    ap.add_argument("--gpu-mem", type=float, default=0.5)
    ap.add_argument("--start-timeout", type=float, default=240.0)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    vh.set_vllm_env()
    with open(os.path.join(args.model, "config.json")) as f:
        vocab = int(json.load(f)["vocab_size"])
    rng = random.Random(20261207)
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in LENGTHS]
    checks: list[tuple[str, bool]] = []

    def check(name: str, ok: bool, detail: str = "") -> None:
        checks.append((name, ok))
        out(f"CHECK {'ok  ' if ok else 'FAIL'} {name}" + (f": {detail}" if detail else ""))

    kvd = vh.KvdServer(args.kvd, 4.0, 256, os.path.join(args.out, "kvd.log"), extra=["--recall-mb", "16"])
    kvd.start()
    port = free_port()
    servers: list[Serve] = []
    try:
        a = Serve(args, kvd.url, port, 1)
        servers.append(a)
        out(f"serve 1 healthy in {a.wait_healthy(args.start_timeout):.1f} s")
        full = [a.complete(p) for p in prompts]
        ref = [a.complete(p) for p in prompts]
        t_ref = time.monotonic()
        out("reference tokens (GPU hits):", [r[:4] for r in ref], "| full prefills:", [r[:4] for r in full],
            f"({sum(x != y for x, y in zip(full, ref))} of 4 differ; informative)")
        # The connector stores and remembers as the requests finish: give the last store a moment.
        time.sleep(2)
        stored = kvd.total("kvd_bytes_stored_total")
        check("the first server stored the prompts in kvd", stored > 0, f"{stored / 1e6:.1f} MB")
        a.stop()
        out("serve 1 stopped (SIGINT)")

        b = Serve(args, kvd.url, port, 2)
        servers.append(b)
        out(f"serve 2 healthy in {b.wait_healthy(args.start_timeout):.1f} s (same port, same group, empty GPU cache)")
        before, retrieved0 = sources(b.http), kvd.total("kvd_bytes_retrieved_total")
        warm = subprocess.run([sys.executable, "-m", "kvd.warm", "--url", kvd.url, "--group", GROUP,
                               "--engine", b.http], capture_output=True, text=True, timeout=120)
        out("kvd.warm:", warm.stdout.strip(), warm.stderr.strip()[-400:])
        time.sleep(1)  # the server's counters move as its output loop records the finished requests
        check("python -m kvd.warm exits 0", warm.returncode == 0, f"exit {warm.returncode}")
        m = re.search(r"(\d+) prompts", warm.stdout)
        check("it replayed the four prompts", bool(m) and int(m.group(1)) == len(prompts), warm.stdout.strip())
        after = sources(b.http)
        ext = after["external_kv_transfer"] - before["external_kv_transfer"]
        retrieved = kvd.total("kvd_bytes_retrieved_total") - retrieved0
        # Each replay loads its prompt's whole chunks (the tail past the last full chunk is computed).
        want = sum(n // 256 * 256 for n in LENGTHS)
        check("the new server loaded them from kvd", ext >= want and retrieved > 0,
              f"{ext:.0f} tokens from the connector (at least {want}), {retrieved / 1e6:.1f} MB retrieved")

        # Everything the first server remembered is older than this; a replay remembered again
        # by the new one would be seconds old.
        max_age = time.monotonic() - t_ref - 5.0
        warm2 = subprocess.run([sys.executable, "-m", "kvd.warm", "--url", kvd.url, "--group", GROUP,
                                "--engine", b.http, "--max-age", f"{max_age:.0f}"], capture_output=True, text=True,
                               timeout=120)
        m = re.search(r"(\d+) prompts", warm2.stdout)
        check("the warm's replays were not remembered again",
              max_age >= 5 and warm2.returncode == 0 and bool(m) and int(m.group(1)) == 0,
              f"--max-age {max_age:.0f}: {warm2.stdout.strip()} {warm2.stderr.strip()[-300:]}")

        before = sources(b.http)
        again = [b.complete(p) for p in prompts]
        time.sleep(1)
        d = {k: v - before[k] for k, v in sources(b.http).items()}
        check("the returning prompts are GPU prefix-cache hits", d["external_kv_transfer"] == 0
              and d["local_cache_hit"] >= sum(n // 16 * 16 for n in LENGTHS) - 16 * len(LENGTHS),
              json.dumps(d))
        check("with the first server's tokens", again == ref, f"{sum(x != y for x, y in zip(again, ref))} of 4 differ")
    except Exception as e:  # noqa: BLE001 - every failure is reported with the servers' logs
        check(f"ran to the end ({type(e).__name__}: {e})", False)
        for s in servers:
            out(s.tail())
    finally:
        for s in servers:
            s.stop()
        kvd.kill(signal.SIGTERM)
    ok = bool(checks) and all(o for _, o in checks)
    print("SERVE WARM CHECK OK" if ok else "SERVE WARM CHECK FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
