#!/usr/bin/env python3
"""One vLLM engine in a process of its own, driven over two pipes: what ``benches/node.py``
runs E of behind its router, and what ``scripts/vllm_engine_two.py`` runs two of on one kvd.

Why a child around ``vllm.LLM`` rather than vLLM's OpenAI server: ``LLM`` with dummy weights,
``skip_tokenizer_init`` and token-id prompts is what every real-engine run on the offline GPU
host already drives (``vllm_harness``), while the server has never run there (uvicorn is not
in vLLM's offline wheel set). The engine core runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so ending the process ends the engine.

Protocol: JSON lines. The parent writes commands on ``--ctl-in``; this process answers on
``--ctl-out`` (vLLM's own logging stays on stdout/stderr, which the parent sends to a log):

  {"cmd": "build"}                        -> {"ev": "ready", "build_s": .., "vllm": .., ...}
  {"cmd": "gen", "id": .., "tokens": [..], "max_tokens": n, "sent": wall time, "kv": {..} (optional)}
                                          -> {"ev": "done", "id": .., "tokens": [..], "ttft_s": ..}
  {"cmd": "metrics", "seq": k}            -> {"ev": "metrics", "seq": k, "m": {name: value}}
  {"cmd": "abort"}                        -> {"ev": "aborted", "id": ..} for each request in flight
  {"cmd": "stop"}                         -> {"ev": "bye"}; the engine shuts down (at most
                                             CLOSE_S) and the process exits

and {"ev": "imported", "s": ..} once vLLM is imported, {"ev": "error", ...} before exiting on
a failure. ``ttft_s`` runs from the parent's ``sent`` (the router handing the request over) to
the first token, so time a request waited here for the engine's step to end counts, as it
does in a server where the request arrives during a step. When ``--ctl-in`` closes (the parent
died) the process exits: an orphaned engine must not hold the GPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import vllm_harness as vh  # noqa: E402

BLOCK = 16
#: Seconds an idle engine keeps stepping after its last request so that connectors finish
#: what they report in steps (stores done, blocks freed), and the pause between those steps.
IDLE_STEP_S = 3.0
IDLE_STEP_PAUSE_S = 0.02
#: Seconds the engine's shutdown may take at "stop" before the process exits regardless.
CLOSE_S = 10.0


def kv_bytes_per_token(model_dir: str) -> int:
    """KV bytes one token takes in a full-attention model's GPU cache (K and V, bf16/fp16
    unless the config says float32), from its config.json."""
    with open(os.path.join(model_dir, "config.json")) as f:
        c = json.load(f)
    heads = int(c.get("num_key_value_heads") or c["num_attention_heads"])
    head_dim = int(c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"])
    dtype = str(c.get("dtype") or c.get("torch_dtype") or "bfloat16")
    width = 4 if "32" in dtype else 2
    return int(c["num_hidden_layers"]) * heads * head_dim * 2 * width


# --- the child ------------------------------------------------------------------------------


#: The connector hooks ``Clock`` times: every call vLLM makes into kvd's connector on the
#: engine's own thread (scheduler and worker share it here: the engine core runs in-process).
KVD_HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta", "request_finished",
             "update_connector_output", "bind_connector_metadata", "start_load_kv", "wait_for_save", "get_finished",
             "get_transfer_results", "build_connector_worker_meta", "get_kv_connector_stats", "take_events",
             "handle_preemptions")


class Clock:
    """Where an engine's time goes: its steps (count, seconds) and, with kvd's connector, the
    seconds spent inside each of its hooks and the lookups it answered "ask again" (``None``),
    each of which holds the request back a step. Reported with the engine's metrics under
    ``bench:`` names (``node.py`` puts each cell's difference in its row)."""

    #: A step that spent this long or longer in kvd's hooks counts as held (a synchronous load
    #: waits there for kvd's answer, and the whole batch with it).
    HELD_S = (0.030, 0.100)

    def __init__(self) -> None:
        self.steps = 0
        self.step_s = 0.0
        self.hook_s: dict[str, float] = {}
        self.hook_n: dict[str, int] = {}
        self.ask_again = 0
        self.held = [0] * len(self.HELD_S)
        #: Loads kvd's scheduler side planned, and of them those whose copy waits for the model's
        #: stream (``LoadOp.wait``; the rest start beside the forward pass still running).
        self.loads = 0
        self.loads_waited = 0

    def hooks_total(self) -> float:
        return sum(self.hook_s.values())

    def step_done(self, hooks_s: float) -> None:
        """Counts a step that spent ``hooks_s`` in kvd's hooks."""
        for i, bound in enumerate(self.HELD_S):
            if hooks_s >= bound:
                self.held[i] += 1

    def wrap(self, cls: Any, names: tuple[str, ...] = KVD_HOOKS) -> None:
        for name in names:
            f = cls.__dict__.get(name)
            if f is None or not callable(f):
                continue
            setattr(cls, name, self._timed(name, f))

    def _timed(self, name: str, f: Callable) -> Callable:
        clock = self

        def timed(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                r = f(*a, **kw)
            finally:
                clock.hook_s[name] = clock.hook_s.get(name, 0.0) + time.perf_counter() - t0
                clock.hook_n[name] = clock.hook_n.get(name, 0) + 1
            if name == "get_num_new_matched_tokens" and isinstance(r, tuple) and r and r[0] is None:
                clock.ask_again += 1
            if name == "build_connector_meta":
                loads = getattr(getattr(r, "inner", None), "loads", None) or ()
                clock.loads += len(loads)
                clock.loads_waited += sum(bool(getattr(op, "wait", True)) for op in loads)
            return r

        timed.__name__ = name
        return timed

    def snapshot(self) -> dict[str, float]:
        out = {"bench:steps": float(self.steps), "bench:step_s": self.step_s, "bench:ask_again": float(self.ask_again),
               "bench:loads": float(self.loads), "bench:loads_waited": float(self.loads_waited)}
        for bound, n in zip(self.HELD_S, self.held):
            out[f"bench:held{{ms={bound * 1e3:.0f}}}"] = float(n)
        for k, v in self.hook_s.items():
            out[f"bench:hook_s{{hook={k}}}"] = v
            out[f"bench:hook_calls{{hook={k}}}"] = float(self.hook_n[k])
        return out


CLOCK = Clock()


@dataclass
class Backend:
    """What the child needs of vLLM, so that a test can hand it a stand-in: ``load()`` imports
    it (returns its version), ``build(cfg)`` returns an ``LLM``-like object, ``metrics(llm)``
    its counters, ``params(n, kv_transfer_params)`` greedy sampling of n tokens, ``close(llm)``
    shuts it down."""

    load: Callable[[], str]
    build: Callable[[dict], Any]
    metrics: Callable[[Any], dict]
    params: Callable[[int, dict | None], Any]
    close: Callable[[Any], None] = lambda llm: None


def _load_vllm() -> str:
    vh.set_vllm_env()
    import vllm

    return vllm.__version__


def _build_vllm(cfg: dict):
    if cfg.get("kv") and cfg["kv"].get("kv_connector_module_path") == "kvd.vllm":
        from kvd.vllm import KvdConnector

        CLOCK.wrap(KvdConnector)
    return vh.make_llm(cfg["model"], cfg.get("kv"), gpu_blocks=cfg["gpu_blocks"], max_model_len=cfg["max_model_len"],
                       enforce_eager=not cfg.get("cudagraphs"), gpu_mem=cfg["gpu_mem"], **cfg.get("llm", {}))


def _close_vllm(llm) -> None:
    # The engine core's shutdown (executor, KV connector), as a server does on SIGTERM; the
    # process exits after it whatever happens.
    llm.llm_engine.engine_core.shutdown()


VLLM = Backend(_load_vllm, _build_vllm, vh.vllm_metrics, vh.greedy, _close_vllm)


def child(args: argparse.Namespace, backend: Backend = VLLM) -> int:
    cfg = json.loads(args.config)
    out = os.fdopen(args.ctl_out, "w", buffering=1)
    cmds: queue.Queue = queue.Queue()

    def send(ev: dict) -> None:
        out.write(json.dumps(ev) + "\n")
        out.flush()

    def read() -> None:
        with os.fdopen(args.ctl_in) as f:
            for line in f:
                if line.strip():
                    cmds.put(json.loads(line))
        os._exit(0)  # the parent is gone

    threading.Thread(target=read, name="ctl-in", daemon=True).start()
    t0 = time.monotonic()
    try:
        version = backend.load()
        send({"ev": "imported", "s": round(time.monotonic() - t0, 2), "pid": os.getpid()})
        if not cfg.get("build_now"):
            while cmds.get()["cmd"] != "build":
                pass
        t1 = time.monotonic()
        llm = backend.build(cfg)
        sched: dict = {}
        try:
            sc = llm.llm_engine.vllm_config.scheduler_config
            sched = {"max_num_seqs": sc.max_num_seqs, "max_num_batched_tokens": sc.max_num_batched_tokens}
        except AttributeError:
            pass
        send({"ev": "ready", "build_s": round(time.monotonic() - t1, 2), "since_spawn_s": round(time.monotonic() - t0, 2),
              "vllm": version, "scheduler": sched})
        rc = serve(llm, cmds, send, backend)
    except Exception as e:
        import traceback

        traceback.print_exc()
        send({"ev": "error", "msg": f"{type(e).__name__}: {str(e).strip()[:600]}"})
        return 1
    closer = threading.Thread(target=_close, args=(backend, llm), name="close", daemon=True)
    closer.start()
    closer.join(CLOSE_S)
    return rc


def _close(backend: Backend, llm) -> None:
    try:
        backend.close(llm)
    except Exception as e:
        print(f"engine shutdown: {e!r}", flush=True)


@dataclass
class _Req:
    id: Any
    sent: float
    enqueued: float
    engine_id: str
    #: Steps the engine had begun when the request arrived: the requests of a burst that share the
    #: lowest count were all waiting when the step that took the first of them began.
    step: int = 0


class GcClock:
    """Seconds Python's collector ran, summed (a ``gc.callbacks`` entry): a step that took long
    with nothing to show for it may have been a collection."""

    def __init__(self) -> None:
        self.s = 0.0
        self._t0 = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.s += time.perf_counter() - self._t0


def serve(llm, cmds: queue.Queue, send: Callable[[dict], None], backend: Backend = VLLM) -> int:
    """The step loop: commands between steps, steps while anything is in flight; returns at
    "stop"."""
    eng = llm.llm_engine
    pending: dict[str, _Req] = {}
    last_activity = time.monotonic()
    step_log = os.environ.get("NODE_STEP_LOG") == "1"
    gc_clock = GcClock()
    if step_log:
        gc.callbacks.append(gc_clock)

    def scheduler_busy() -> bool:
        try:
            return bool(eng.engine_core.engine_core.scheduler.has_requests())
        except AttributeError:
            return False

    try:
        while True:
            idle_work = not pending and time.monotonic() - last_activity < IDLE_STEP_S and scheduler_busy()
            try:
                c = cmds.get(timeout=IDLE_STEP_PAUSE_S if idle_work else 0.5) if not pending else cmds.get_nowait()
            except queue.Empty:
                c = None
            while c is not None:
                kind = c["cmd"]
                if kind == "gen":
                    now = time.time()
                    rid = llm.enqueue([{"prompt_token_ids": list(c["tokens"])}], backend.params(int(c["max_tokens"]), c.get("kv")),
                                      use_tqdm=False)[0]
                    pending[vh._key(rid)] = _Req(c["id"], float(c.get("sent", now)), now, rid, CLOCK.steps)
                    if step_log:
                        print(f"gen {c['id']} {now:.3f}, {len(c['tokens'])} tokens", flush=True)
                elif kind == "metrics":
                    send({"ev": "metrics", "seq": c.get("seq"), "m": {**backend.metrics(llm), **CLOCK.snapshot()}})
                elif kind == "abort":
                    ids = [r.engine_id for r in pending.values()] + list(pending)
                    try:
                        eng.abort_request(ids)
                    except Exception as e:
                        print(f"abort failed: {e!r}", flush=True)
                    for r in pending.values():
                        send({"ev": "aborted", "id": r.id})
                    pending.clear()
                elif kind == "stop":
                    send({"ev": "bye"})
                    return 0
                try:
                    c = cmds.get_nowait()
                except queue.Empty:
                    c = None
            if not pending and not idle_work:
                continue
            t_step = time.perf_counter()
            hooks0 = CLOCK.hooks_total()
            gc0 = gc_clock.s
            outs = eng.step()
            CLOCK.steps += 1
            CLOCK.step_s += time.perf_counter() - t_step
            CLOCK.step_done(CLOCK.hooks_total() - hooks0)
            if step_log and pending:
                _log_step(eng, t_step, hooks0, gc_clock.s - gc0, len(pending), len(outs))
            if pending:
                last_activity = time.monotonic()
            for o in outs:
                if not o.finished:
                    continue
                r = pending.pop(vh._key(o.request_id), None)
                if r is None:
                    continue
                now = time.time()
                m = o.metrics
                ftl = getattr(m, "first_token_latency", None) if m is not None else None
                comp = o.outputs[0]
                if step_log:
                    print(f"done {r.id} {now:.3f}, cached {int(o.num_cached_tokens or 0)}, first token after "
                          f"{ftl if ftl is None else round(float(ftl), 4)} s", flush=True)
                send({"ev": "done", "id": r.id, "tokens": list(comp.token_ids), "cached": int(o.num_cached_tokens or 0),
                      "queued_s": round(r.enqueued - r.sent, 6), "enq_step": r.step,
                      "ttft_s": (r.enqueued - r.sent) + float(ftl) if ftl else None,
                      "e2e_s": now - r.sent, "finish": comp.finish_reason})
    finally:
        if step_log:
            gc.callbacks.remove(gc_clock)


def _log_step(eng, t_step: float, hooks0: float, gc_s: float, pending: int, outputs: int) -> None:
    """One line a step (``NODE_STEP_LOG=1``, node.py's ``--step-log``): when it ended, how long it
    took and how much of it was kvd's hooks and Python's collector, the requests it returned
    tokens for, and the scheduler's queues, with the requests still waiting for their KV from the
    connector. With vLLM's asynchronous scheduling (0.26's default) a step that launches a batch
    returns no outputs and the next one waits for the GPU to finish it: ``outputs 0`` marks a
    launch, and the wait lands on the step after."""
    t1 = time.perf_counter()
    try:
        sched = eng.engine_core.engine_core.scheduler
        # vLLM keeps a request parked for its KV (and one skipped in a pass) in skipped_waiting.
        parked = list(getattr(sched, "skipped_waiting", ()))
        remote = sum(1 for r in [*sched.waiting, *parked] if r.status.name == "WAITING_FOR_REMOTE_KVS")
        queues = f"waiting {len(sched.waiting) + len(parked)} (for kv {remote}) running {len(sched.running)}"
    except AttributeError:
        queues = "queues unknown"
    print(f"step {time.time():.3f} {1e3 * (t1 - t_step):.1f} ms, hooks {1e3 * (sum(CLOCK.hook_s.values()) - hooks0):.1f} ms, "
          f"gc {1e3 * gc_s:.1f} ms, outputs {outputs}, pending {pending}, {queues}", flush=True)


# --- the parent's side ----------------------------------------------------------------------


class EngineError(RuntimeError):
    """An engine process failed to start or died."""


class EngineProc:
    """One engine child. ``done``/``aborted``/``exit`` events go to the shared ``events``
    queue as ``(slot, incarnation, event)``; replies to the parent's commands (imported,
    ready, metrics, error, bye) to this object's own queue."""

    def __init__(self, slot: int, incarnation: int, cfg: dict, events: queue.Queue, log_path: str,
                 env: dict[str, str] | None = None, new_session: bool = True, program: str | None = None) -> None:
        self.slot = slot
        self.incarnation = incarnation
        self.cfg = cfg
        self.events = events
        self.log_path = log_path
        self.replies: queue.Queue = queue.Queue()
        self.imported_s: float | None = None
        self.ready: dict | None = None
        self.spawned = time.monotonic()
        self._seq = 0
        self._build_sent = False
        self._lock = threading.Lock()
        cin_r, cin_w = os.pipe()
        cout_r, cout_w = os.pipe()
        full_env = dict(os.environ, **vh.VLLM_ENV)
        full_env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        full_env.update(env or {})
        cmd = [sys.executable, program or os.path.abspath(__file__), "--ctl-in", str(cin_r), "--ctl-out", str(cout_w),
               "--config", json.dumps(cfg)]
        self._log = open(log_path, "a")
        self._log.write(f"==== engine slot {slot} incarnation {incarnation}: {json.dumps(cfg.get('kv'))}\n")
        self._log.flush()
        self.proc = subprocess.Popen(cmd, env=full_env, stdout=self._log, stderr=subprocess.STDOUT,
                                     pass_fds=(cin_r, cout_w), start_new_session=new_session)
        #: The process group to kill (whatever the engine started with it), if it has its own.
        self.pgid = self.proc.pid if new_session else None
        os.close(cin_r)
        os.close(cout_w)
        self._w = os.fdopen(cin_w, "w", buffering=1)
        threading.Thread(target=self._pump, args=(cout_r,), name=f"engine{slot}", daemon=True).start()

    def _pump(self, fd: int) -> None:
        with os.fdopen(fd) as f:
            for line in f:
                try:
                    ev = json.loads(line)
                except ValueError:
                    continue
                if ev.get("ev") in ("done", "aborted"):
                    self.events.put((self.slot, self.incarnation, ev))
                else:
                    self.replies.put(ev)
        rc = self.proc.wait()
        ev = {"ev": "exit", "rc": rc}
        self.replies.put(ev)
        self.events.put((self.slot, self.incarnation, ev))

    def _send(self, cmd: dict) -> None:
        with self._lock:
            try:
                self._w.write(json.dumps(cmd) + "\n")
                self._w.flush()
            except (BrokenPipeError, ValueError) as e:
                raise EngineError(f"engine {self.slot} is gone ({e!r}); its log: {self.log_path}") from e

    def _reply(self, want: str, timeout_s: float, seq: int | None = None) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise EngineError(f"engine {self.slot}: no {want!r} within {timeout_s:.0f} s (log {self.log_path})")
            try:
                ev = self.replies.get(timeout=left)
            except queue.Empty:
                continue
            kind = ev.get("ev")
            if kind == "imported":
                self.imported_s = ev.get("s")
            if kind == want and (seq is None or ev.get("seq") == seq):
                return ev
            if kind in ("error", "exit"):
                raise EngineError(f"engine {self.slot}: {ev.get('msg') or 'exited ' + str(ev.get('rc'))} "
                                  f"(log {self.log_path}; last lines: {self.tail(6)})")

    def wait_imported(self, timeout_s: float) -> float:
        if self.imported_s is None:
            self._reply("imported", timeout_s)
        return float(self.imported_s or 0.0)

    def request_build(self) -> None:
        """Tells the engine to build itself (once); ``build`` waits for it."""
        if not self.cfg.get("build_now") and not self._build_sent:
            self._send({"cmd": "build"})
            self._build_sent = True

    def build(self, timeout_s: float) -> dict:
        """Builds the engine (if it was spawned to wait) and returns its ready event."""
        self.request_build()
        self.ready = self._reply("ready", timeout_s)
        return self.ready

    def submit(self, rid: Any, tokens: list[int], max_tokens: int, kv_transfer_params: dict | None = None) -> None:
        c = {"cmd": "gen", "id": rid, "tokens": tokens, "max_tokens": max_tokens, "sent": time.time()}
        if kv_transfer_params:
            c["kv"] = kv_transfer_params
        self._send(c)

    def metrics(self, timeout_s: float = 60.0) -> dict[str, float]:
        self._seq += 1
        self._send({"cmd": "metrics", "seq": self._seq})
        return self._reply("metrics", timeout_s, self._seq)["m"]

    def abort(self) -> None:
        self._send({"cmd": "abort"})

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, grace_s: float = 20.0) -> int:
        """Asks the engine to exit, then kills its process group; returns once it is gone (its
        GPU memory is free when the process is)."""
        try:
            self._send({"cmd": "stop"})
        except EngineError:
            pass
        try:
            rc = self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            rc = None
        self.kill()
        return self.proc.wait() if rc is None else rc

    def kill(self) -> None:
        try:
            if self.pgid is not None:
                os.killpg(self.pgid, signal.SIGKILL)
            else:
                self.proc.kill()
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            pass
        try:
            self._w.close()
        except OSError:
            pass

    def tail(self, n: int) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                lines = [l.strip() for l in f.readlines()[-200:] if l.strip()]
        except OSError:
            return ""
        keep = [l for l in lines if "Error" in l or "error" in l or "Traceback" in l][-n:] or lines[-n:]
        return " | ".join(keep)[-1200:]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ctl-in", type=int, required=True)
    ap.add_argument("--ctl-out", type=int, required=True)
    ap.add_argument("--config", required=True, help="JSON: model, kv, gpu_blocks, max_model_len, gpu_mem, llm, build_now")
    return ap.parse_args(argv)


def main(backend: Backend = VLLM) -> int:
    rc = child(parse_args(), backend)
    sys.stdout.flush()
    sys.stderr.flush()
    # No interpreter shutdown: vLLM's exit hooks may wait on what the engine started.
    os._exit(rc)


if __name__ == "__main__":
    sys.exit(main())
