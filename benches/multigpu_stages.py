"""The orchestrator's side of benches/multigpu.py's four stages: each starts its rank processes,
steps them, checks what they report and kvd's own accounting, and prints its markdown tables.
A stage returns the problems it found (an empty list: it passed); an exception fails it too.
"""

from __future__ import annotations

import os
import signal
import time

from gpubench import (
    CHUNK, GIB, cpu_seconds, cpu_seconds_by_thread, gpu_mem_by_gpu, healthz, kvd_metrics, mappings_of, open_fds,
)
from multigpu_ranks import (
    FP_KILL, FP_MLA, FP_TP, Ranks, _client, _gbs, _mla_hashes, _tp_hashes, kill_chunks, mono,
)

HOST_MEMFD = "kvd-host-kv"  # the memfd name of kvd.HostBuffer, as kvd's /proc/PID/maps shows it


def stage1(run) -> list[str]:
    n, cuda = run.n, run.mode == "cuda"
    ranks = Ranks("s1", [run.rank_cfg(r, inflight=run.args.inflight, tokens=run.args.tokens) for r in range(n)], run.deadline(1))
    problems: list[str] = []
    try:
        ranks.gather("up")
        alone = together = None
        if cuda:
            secs = run.args.ceiling_seconds
            alone = [ranks.ask({"do": "ceil", "start_at": mono() + 0.05, "seconds": secs}, "ceil", [r])[0] for r in range(n)]
            together = ranks.ask({"do": "ceil", "start_at": mono() + 0.3, "seconds": secs}, "ceil")
            ranks.ask({"do": "drop_ceil"}, "dropped")
            print("\nCopy ceilings (contiguous 1 GiB pinned copies, each kind timed for "
                  f"{secs:.1f} s): each GPU alone, then all {n} GPUs at once, no kvd.\n")
            print("| GPU | alone d2h | alone h2d | alone both | all at once d2h | all at once h2d | all at once both |")
            print("|---|---|---|---|---|---|---|")
            for r in range(n):
                print(f"| {r} | {alone[r]['d2h']:.1f} | {alone[r]['h2d']:.1f} | {alone[r]['both']:.1f} | "
                      f"{together[r]['d2h']:.1f} | {together[r]['h2d']:.1f} | {together[r]['both']:.1f} |")
            sums = {k: sum(x[k] for x in alone) for k in ("d2h", "h2d", "both")}
            tog = {k: sum(x[k] for x in together) for k in ("d2h", "h2d", "both")}
            print(f"| sum | {sums['d2h']:.1f} | {sums['h2d']:.1f} | {sums['both']:.1f} | {tog['d2h']:.1f} | {tog['h2d']:.1f} | {tog['both']:.1f} |")
            print(f"\nAll at once / sum alone: d2h {tog['d2h'] / sums['d2h']:.2f}, h2d {tog['h2d'] / sums['h2d']:.2f}, "
                  f"both {tog['both'] / sums['both']:.2f} (below ~0.9: the host side — PCIe switches/root ports or "
                  "host memory — saturates without kvd).")
            run.host_memory_hint()
        for order in run.args.layouts.split(","):
            try:
                ready = ranks.ask({"do": "setup", "order": order}, "ready")
                m0 = kvd_metrics(run.kvd.http, ("kvd_copy_errors_total", "kvd_copy_queue_full_total", "kvd_evictions_total"))
                start_at = mono() + 0.3
                ranks.send({"do": "go", "start_at": start_at, "seconds": run.args.seconds})
                time.sleep(max(0.0, start_at - mono()))
                c0, th0, w0 = cpu_seconds(run.kvd.pid), cpu_seconds_by_thread(run.kvd.pid), mono()
                ran = ranks.gather("ran")
                c1, th1, w1 = cpu_seconds(run.kvd.pid), cpu_seconds_by_thread(run.kvd.pid), mono()
                checked = ranks.ask({"do": "check"}, "checked")
                m1 = kvd_metrics(run.kvd.http, tuple(m0))
                ranks.ask({"do": "teardown"}, "down")
            except Exception as e:
                raise RuntimeError(f"{order}: {e}") from e
            problems += [f"{order}: {p}" for p in stage1_table(run, order, ready, ran, checked, alone, together,
                                                               (c1 - c0, w1 - w0), (th0, th1), m0, m1)]
    finally:
        ranks.close()
    return problems


def stage1_table(run, order, ready, ran, checked, alone, together, cpu, threads, m0, m1) -> list[str]:
    n = run.n
    a = run.args
    print(f"\nStage 1, {order}: llama-3.1-8b, {a.tokens}-token requests, {a.inflight} in flight per direction, "
          f"every process storing and retrieving at once for {a.seconds:.1f} s "
          f"(KV caches {ready[0]['cache_gib']:.1f} GiB per GPU; GB/s of chunks copied; the chunks retrieves read are "
          "held by a lookup pin so that the stores cannot evict them).\n")
    print("| GPU | store GB/s | retrieve GB/s | store + retrieve | alone both-way ceiling | ratio | missing | refused | chunks checked | bad |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    problems: list[str] = []
    total = 0.0
    for r in range(n):
        s, t = ran[r]["store"], ran[r]["retrieve"]
        sg, tg = _gbs(s["bytes"], s["t1"] - s["t0"]), _gbs(t["bytes"], t["t1"] - t["t0"])
        total += sg + tg
        ceil = f"{alone[r]['both']:.1f} | {(sg + tg) / alone[r]['both']:.2f}" if alone else "— | —"
        ck = checked[r]
        bad = ck["bad"] + ck["readback_missing"]
        if bad or not ck["chunks"]:
            problems.append(f"GPU {r}: {bad} of {ck['chunks']} chunks compared differ or were missing on read-back")
        if not t["copied"] or not s["copied"]:
            problems.append(f"GPU {r}: nothing {'retrieved' if not t['copied'] else 'stored'}")
        if t["missing"] or s["refused"]:
            problems.append(f"GPU {r}: {t['missing']} retrieved chunks missing, {s['refused']} stores refused: "
                            "the pool is too small for this load (its GB/s count copied chunks only); pass a larger --pool-gib")
        print(f"| {r} | {sg:.1f} | {tg:.1f} | {sg + tg:.1f} | {ceil} | {t['missing']} | {s['refused']} | {ck['chunks']} | {bad} |")
    t0 = min(min(x["store"]["t0"], x["retrieve"]["t0"]) for x in ran)
    t1 = max(max(x["store"]["t1"], x["retrieve"]["t1"]) for x in ran)
    moved = sum(x["store"]["bytes"] + x["retrieve"]["bytes"] for x in ran)
    agg = _gbs(moved, t1 - t0)
    line = f"| all {n} | | | **{agg:.1f}** (sum of rates {total:.1f}) |"
    if alone:
        single = sum(x["both"] for x in alone)
        tog = sum(x["both"] for x in together)
        line += (f" sum alone {single:.1f}; {n}× GPU 0 {n * alone[0]['both']:.1f}; all at once {tog:.1f} | "
                 f"{agg / single:.2f} of sum alone, {agg / (n * alone[0]['both']):.2f} of {n}× GPU 0, {agg / tog:.2f} of all at once |")
    else:
        line += " — (host mode) | — |"
    print(line + f" {sum(x['retrieve']['missing'] for x in ran)} | {sum(x['store']['refused'] for x in ran)} | "
          f"{sum(c['chunks'] for c in checked)} ({sum(c['bytes'] for c in checked) / GIB:.1f} GiB) | "
          f"{sum(c['bad'] + c['readback_missing'] for c in checked)} |")
    cpu_s, wall = cpu
    th0, th1 = threads
    by = sorted(((th1.get(k, 0) - th0.get(k, 0)) / wall, k) for k in th1)
    by = [f"{k} {v:.2f}" for v, k in reversed(by) if v >= 0.01]
    print(f"\nkvd CPU during the run: **{cpu_s / wall:.2f} cores** of {os.cpu_count()} ({cpu_s:.1f} s in {wall:.1f} s); "
          f"by thread name: {', '.join(by) or 'none'}. "
          f"kvd counters over the run: copy errors {m1['kvd_copy_errors_total'] - m0['kvd_copy_errors_total']:.0f}, "
          f"copy queue full {m1['kvd_copy_queue_full_total'] - m0['kvd_copy_queue_full_total']:.0f}, "
          f"evictions {m1['kvd_evictions_total'] - m0['kvd_evictions_total']:.0f}.")
    print(f"Host memory: the copies put {agg:.1f} GB/s through host DRAM (each stored byte written once by DMA, each "
          "retrieved byte read once; kvd's GPU path copies nothing through the CPU). What this run cannot attribute: "
          "DRAM traffic per socket or channel and PCIe link utilisation (no perf/PCM counters in this VM); compare "
          "the aggregate with the all-at-once ceiling: equal means the host side, not kvd, sets the limit.")
    if m1["kvd_copy_errors_total"] != m0["kvd_copy_errors_total"]:
        problems.append(f"kvd counted {m1['kvd_copy_errors_total'] - m0['kvd_copy_errors_total']:.0f} copy errors")
    return problems


def stage2(run) -> list[str]:
    n, a = run.n, run.args
    cpr = a.tokens // CHUNK
    ranks = Ranks("s2", [run.rank_cfg(r, inflight=a.inflight, tokens=a.tokens, requests=a.requests) for r in range(n)], run.deadline(2))
    client = None
    try:
        up = ranks.gather("up")
        client = _client({"url": run.kvd.url}, "s2-scheduler", role="scheduler")
        page = up[0]["page_bytes"]

        def pins_held() -> float:
            return kvd_metrics(run.kvd.http, ("kvd_lookup_pins",))["kvd_lookup_pins"]

        base = pins_held()
        # The pin's readers: N ranks read the one MLA shard; it must hold until the N-th has read.
        hit, pin = client.lookup(FP_MLA, 0, [0], _mla_hashes(0, cpr), pin=True, readers=n).result(10)
        held_after = []
        ranks.ask({"do": "poison"}, "poisoned")
        first = ranks.ask({"do": "read", "reqs": [(0, pin)]}, "read", list(range(1, n))) if n > 1 else []
        held_after.append(pins_held())  # after N-1 readers
        last = ranks.ask({"do": "read", "reqs": [(0, pin)]}, "read", [0])
        ended = until(lambda: pins_held() == base, 5.0)
        released = client.release(pin).result(10)
        problems: list[str] = []
        if hit != cpr:
            problems.append(f"the pinned lookup hit {hit} of {cpr} chunks")
        if n > 1 and held_after[0] != base + 1:
            problems.append(f"after {n - 1} of {n} readers kvd held {held_after[0] - base:.0f} pins, not 1")
        if not ended or released != 0:
            problems.append(f"the pin did not end after reader {n} (Release then freed {released} chunks)")
        if not all(r["bad"] == 0 and r["missing"] == 0 and r["checked"] == cpr for r in first + last):
            problems.append(f"pinned reads: {[(r['checked'], r['bad'], r['missing']) for r in first + last]} (checked, bad, missing) per rank")
        sem_ok = not problems
        print(f"\nStage 2: deepseek-mla-b16 (61 layers, 1 head, 576 content, 16-token blocks), BLNHC, shared by {n} TP ranks; "
              f"rank 0 stored {a.requests} × {a.tokens} tokens at {_gbs(up[0]['store_bytes'], up[0]['store_s']):.1f} GB/s; "
              f"page {page / 2**20:.1f} MiB; registered by {up[0]['shared_by']}.\n")
        print(f"Pin semantics (lookup shards [0], readers={n}, as the connector's scheduler asks for MLA): hit {hit}/{cpr} chunks; "
              f"pin held after {n - 1} reader(s): {'yes' if n == 1 or held_after[0] == base + 1 else 'NO'}; "
              f"ended after reader {n}: {'yes' if ended else 'NO'}; Release afterwards freed {released} chunks (0 expected): "
              f"**{'ok' if sem_ok else 'FAILED'}**\n")
        print("| round | ranks | aggregate retrieve GB/s | per-rank GB/s (min–max) | chunks checked | bad | missing | pins left |")
        print("|---|---|---|---|---|---|---|---|")
        for k in range(a.rounds):
            pins = []
            for q in range(a.requests):
                h, p = client.lookup(FP_MLA, 0, [0], _mla_hashes(q, cpr), pin=True, readers=n).result(10)
                if h != cpr:
                    raise RuntimeError(f"lookup of MLA request {q} hit {h} of {cpr} chunks")
                pins.append((q, p))
            ranks.ask({"do": "poison"}, "poisoned")
            res = ranks.ask({"do": "read", "reqs": pins, "start_at": mono() + 0.2}, "read")
            span = max(r["t1"] for r in res) - min(r["t0"] for r in res)
            per_rank = [_gbs(r["bytes"], r["t1"] - r["t0"]) for r in res]
            left_ok = until(lambda: pins_held() == base, 5.0)
            bad, missing, checked = sum(r["bad"] for r in res), sum(r["missing"] for r in res), sum(r["checked"] for r in res)
            if bad or missing or checked != n * a.requests * cpr:
                problems.append(f"round {k + 1}: {checked} chunks compared of {n * a.requests * cpr}, {bad} differ, {missing} missing")
            if not left_ok:
                problems.append(f"round {k + 1}: {pins_held() - base:.0f} pins left after every rank read")
            print(f"| {k + 1} | {n} | {_gbs(sum(r['bytes'] for r in res), span):.1f} | {min(per_rank):.1f}–{max(per_rank):.1f} | "
                  f"{checked} ({checked * page / GIB:.1f} GiB) | {bad} | {missing} | {pins_held() - base:.0f} |")
        return problems
    finally:
        client = None
        ranks.close()


def until(pred, timeout_s: float) -> bool:
    end = mono() + timeout_s
    while not pred():
        if mono() > end:
            return False
        time.sleep(0.02)
    return True


def stage3(run) -> list[str]:
    n, a = run.n, run.args
    cpr = a.tokens // CHUNK
    ranks = Ranks("s3", [run.rank_cfg(r, inflight=a.inflight, tokens=a.tokens, requests=a.requests) for r in range(n)], run.deadline(3))
    client = None
    try:
        up = ranks.gather("up")
        client = _client({"url": run.kvd.url}, "s3-scheduler", role="scheduler")
        page = up[0]["page_bytes"]
        print(f"\nStage 3: llama-3.1-70b-tp8 (80 layers, 1 KV head per shard, content 256: "
              f"{16 * 256 * 2 // 1024} KiB per 16-token layer block), BLNHC, TP{n}: rank r stores and retrieves shard r, "
              f"all ranks at once, {a.requests} × {a.tokens} tokens per rank per round; page {page / 2**20:.1f} MiB; "
              f"registered by {up[0]['shared_by']}.\n")
        print("| round | aggregate store GB/s | per-rank store (min–max) | TP lookup hit | aggregate retrieve GB/s | per-rank retrieve (min–max) | chunks checked | bad | missing | refused |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        problems: list[str] = []
        for k in range(a.rounds):
            ranks.ask({"do": "poison"}, "poisoned")
            st = ranks.ask({"do": "store", "round": k, "start_at": mono() + 0.2}, "stored")
            refused = sum(r["refused"] for r in st)
            pins, hits = [], []
            for q in range(a.requests):
                # A TP lookup names every shard: a chunk counts once all ranks stored it.
                got = [0, 0]

                def look() -> bool:
                    got[:] = client.lookup(FP_TP, 0, list(range(n)), _tp_hashes(k, q, cpr), pin=True, readers=1).result(10)
                    if got[0] == cpr:
                        return True
                    if got[1]:
                        client.release(got[1]).result(10)
                    return False

                until(look, 5.0)
                hits.append(got[0])
                pins.append((q, got[1]))
            rd = ranks.ask({"do": "read", "round": k, "reqs": pins, "start_at": mono() + 0.2}, "read")
            sspan = max(r["t1"] for r in st) - min(r["t0"] for r in st)
            rspan = max(r["t1"] for r in rd) - min(r["t0"] for r in rd)
            sper = [_gbs(r["bytes"], r["t1"] - r["t0"]) for r in st]
            rper = [_gbs(r["bytes"], r["t1"] - r["t0"]) for r in rd]
            bad, missing, checked = sum(r["bad"] for r in rd), sum(r["missing"] for r in rd), sum(r["checked"] for r in rd)
            if refused or bad or missing or checked != n * a.requests * cpr or min(hits) != cpr:
                problems.append(f"round {k + 1}: {refused} stores refused, lookup hits {hits} of {cpr}, {checked} chunks "
                                f"compared of {n * a.requests * cpr}, {bad} differ, {missing} missing")
            print(f"| {k + 1} | {_gbs(sum(r['bytes'] for r in st), sspan):.1f} | {min(sper):.1f}–{max(sper):.1f} | "
                  f"{min(hits)}/{cpr} | {_gbs(sum(r['bytes'] for r in rd), rspan):.1f} | {min(rper):.1f}–{max(rper):.1f} | "
                  f"{checked} ({checked * page / GIB:.1f} GiB) | {bad} | {missing} | {refused} |")
        return problems
    finally:
        client = None
        ranks.close()


def stage4(run) -> list[str]:
    n, cuda = run.n, run.mode == "cuda"
    kvd = run.kvd
    blocks = run.args.kill_blocks
    chunks = kill_chunks(not cuda)
    cfgs = [run.rank_cfg(r, hold=True, blocks=blocks, chunks=chunks, fp=FP_KILL + r) for r in range(n)]
    if cuda and not run.args.no_vmm:
        env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "PYTORCH_ALLOC_CONF": "expandable_segments:True"}
        cfgs.append(run.rank_cfg(n - 1, hold=True, blocks=blocks, chunks=chunks, fp=FP_KILL + n, env=env))
    names = ("kvd_registered_workers", "kvd_lookup_pins", "kvd_sessions", "kvd_gpu_release_errors_total")
    run.warm_up()
    free0 = run.free_by_gpu()
    maps0 = mappings_of(kvd.pid, HOST_MEMFD)
    fds0 = open_fds(kvd.pid)
    m0 = kvd_metrics(kvd.http, names)
    smi0 = gpu_mem_by_gpu(kvd.pid) if cuda else {}
    deadline = run.deadline(4)
    ranks = Ranks("s4", cfgs, deadline)
    try:
        held = ranks.gather("holding")
    except Exception:
        ranks.close()
        raise
    free1 = run.free_by_gpu()
    maps1, fds1, m1 = mappings_of(kvd.pid, HOST_MEMFD), open_fds(kvd.pid), kvd_metrics(kvd.http, names)
    smi1 = gpu_mem_by_gpu(kvd.pid) if cuda else {}
    k = len(cfgs)
    expect = ["ipc"] * n + ["vmm"] * (k - n) if cuda else ["memfd"] * n
    print(f"\nStage 4: {k} client processes ({n} by {'legacy CUDA IPC' if cuda else 'memfd'}"
          f"{', 1 by expandable segments (VMM, by descriptor) on GPU ' + str(n - 1) if k > n else ''}), each holding a "
          f"registered {held[0]['cache_bytes'] / GIB:.2f} GiB cache, a bit-exact round trip done and a lookup pin, then SIGKILLed at once.\n")
    problems: list[str] = []
    for r, h in enumerate(held):
        if not (h["shared_by"] == expect[r] and h["bad"] == 0 and h["checked"] == h["chunks"] and h["hit"] == h["chunks"]):
            problems.append(f"client {r}: registered by {h['shared_by']} (expected {expect[r]}), round trip "
                            f"{h['checked'] - h['bad']}/{h['chunks']} chunks equal, lookup hit {h['hit']}")
    if m1["kvd_registered_workers"] - m0["kvd_registered_workers"] != k or m1["kvd_lookup_pins"] - m0["kvd_lookup_pins"] != k:
        problems.append(f"while held kvd counted {m1['kvd_registered_workers'] - m0['kvd_registered_workers']:.0f} more "
                        f"registrations and {m1['kvd_lookup_pins'] - m0['kvd_lookup_pins']:.0f} more pins, not {k}")
    killed_at = mono()
    for h in held:
        os.kill(h["pid"], signal.SIGKILL)
    for p in ranks.procs:
        p.join(5)
    since: dict[str, float] = {}

    def settled() -> bool:
        now = mono() - killed_at
        m = kvd_metrics(kvd.http, names)
        # At most the baseline: sessions of earlier stages may end meanwhile too.
        checks = {
            "registered workers": m["kvd_registered_workers"] <= m0["kvd_registered_workers"],
            "lookup pins": m["kvd_lookup_pins"] <= m0["kvd_lookup_pins"],
            "sessions": m["kvd_sessions"] <= m0["kvd_sessions"],
        }
        if cuda:
            free = run.free_by_gpu()
            for g in range(n):
                checks[f"GPU {g} memory"] = free[g] + run.args.slack_mib * 2**20 >= free0[g]
        else:
            checks["memfd mappings"] = mappings_of(kvd.pid, HOST_MEMFD) == maps0
        for name, good in checks.items():
            if good:
                since.setdefault(name, now)
            else:
                since.pop(name, None)
        return all(checks.values())

    released = until(settled, 10.0)
    ranks.close()
    free2 = run.free_by_gpu()
    maps2, fds2, m2 = mappings_of(kvd.pid, HOST_MEMFD), open_fds(kvd.pid), kvd_metrics(kvd.http, names)
    print("| what | before the clients | while held | after SIGKILL | released after |")
    print("|---|---|---|---|---|")
    if cuda:
        for g in range(n):
            mib = lambda f: (free0[g] - f[g]) / 2**20  # noqa: E731
            print(f"| GPU {g} memory in use beyond the baseline (MiB, device-wide) | 0 | {mib(free1):.0f} | {mib(free2):.0f} | "
                  f"{since.get(f'GPU {g} memory', float('nan')):.2f} s |")
        print(f"| kvd's GPU memory by GPU (nvidia-smi, MiB) | {smi0} | {smi1} | {gpu_mem_by_gpu(kvd.pid)} | |")
        for g in range(n):
            on = sum(1 for c in cfgs if c["ordinal"] == g)
            if free0[g] - free1[g] < on * held[0]["cache_bytes"] * 0.9:  # the premise: the caches were held
                problems.append(f"GPU {g}: only {(free0[g] - free1[g]) / 2**20:.0f} MiB in use while {on} client(s) held caches")
    else:
        print(f"| kvd's mappings of client memfds | {maps0} | {maps1} | {maps2} | {since.get('memfd mappings', float('nan')):.2f} s |")
        if maps1 - maps0 != k:
            problems.append(f"kvd mapped {maps1 - maps0} client memfds while {k} clients were registered")
    for label, key in (("registered workers", "kvd_registered_workers"), ("lookup pins", "kvd_lookup_pins"), ("sessions", "kvd_sessions")):
        print(f"| kvd_{label.replace(' ', '_')} | {m0[key]:.0f} | {m1[key]:.0f} | {m2[key]:.0f} | {since.get(label, float('nan')):.2f} s |")
    print(f"| kvd's open descriptors | {fds0} | {fds1} | {fds2} | |")
    print(f"| kvd_gpu_release_errors_total | {m0['kvd_gpu_release_errors_total']:.0f} | | {m2['kvd_gpu_release_errors_total']:.0f} | |")
    if not released:
        problems.append("not released within 10 s: " + ", ".join(x for x in settled_names(cuda, n) if x not in since))
    if m2["kvd_registered_workers"] != 0:
        problems.append(f"kvd_registered_workers is {m2['kvd_registered_workers']:.0f} with no client left, not 0")
    if m2["kvd_gpu_release_errors_total"] != m0["kvd_gpu_release_errors_total"]:
        problems.append(f"kvd counted {m2['kvd_gpu_release_errors_total'] - m0['kvd_gpu_release_errors_total']:.0f} release errors")
    code, body = healthz(kvd.http)
    if code != 200:
        problems.append(f"/healthz answered {code} {body.strip()[:120]}")
    # Fresh clients, one per GPU, after the mass kill.
    fresh = Ranks("s4", [run.rank_cfg(r, hold=False, blocks=blocks, chunks=chunks, fp=FP_KILL + 16 + r) for r in range(n)], deadline)
    try:
        done = fresh.gather("done")
    finally:
        fresh.close()
    fresh_ok = all(d["bad"] == 0 and d["checked"] == d["chunks"] for d in done)
    if not fresh_ok:
        problems.append(f"fresh clients: {[(d['checked'], d['bad'], d['chunks']) for d in done]} (compared, differ, chunks)")
    print(f"\nEverything released within 10 s: **{'yes' if released else 'NO'}**; "
          f"/healthz {code} {body.strip()[:80]}; {n} fresh client(s) registered and round-tripped "
          f"{sum(d['checked'] - d['bad'] for d in done)}/{sum(d['chunks'] for d in done)} chunks bit-exact: **{'ok' if fresh_ok else 'FAILED'}**.")
    return problems


def settled_names(cuda: bool, n: int) -> list[str]:
    names = ["registered workers", "lookup pins", "sessions"]
    return names + ([f"GPU {g} memory" for g in range(n)] if cuda else ["memfd mappings"])


STAGES = {1: ("data plane on all GPUs at once", stage1), 2: ("MLA shared by N TP ranks", stage2),
          3: ("TP shards of a Llama-70B-like cache", stage3), 4: ("N ranks SIGKILLed at once", stage4)}
