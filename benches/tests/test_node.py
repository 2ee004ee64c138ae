"""The node benchmark's own logic without a GPU: the router's policies, the closed-loop replay,
and a whole arm — engines as processes speaking ``node_engine``'s protocol, the restart, the
tables — with ``fake_engine.py`` standing in for vLLM. Not a benchmark: the fake's numbers
mean nothing. Run: pytest benches/tests (numpy needed, as for the traces)."""

from __future__ import annotations

import array
import json
import math
import re
import os
import queue
import sys
import threading
import time

import pytest

BENCHES = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, BENCHES)

import node  # noqa: E402
import node_arms  # noqa: E402
import node_report  # noqa: E402
import node_router as nr  # noqa: E402

FAKE = os.path.join(BENCHES, "tests", "fake_engine.py")


# --- the router ------------------------------------------------------------------------------


def test_round_robin_takes_the_engines_in_turn_and_skips_one_that_is_down():
    r = nr.Router("round-robin", 3)
    assert [r.pick(0) for _ in range(4)] == [0, 1, 2, 0]
    r.set_up(2, False)
    assert [r.pick(0) for _ in range(3)] == [1, 0, 1]


def test_sticky_keeps_a_conversation_on_its_engine_and_moves_it_only_while_that_one_is_down():
    r = nr.Router("sticky", 2)
    assert [r.pick(u) for u in (0, 1, 2, 3, 0)] == [0, 1, 0, 1, 0]
    r.set_up(1, False)
    assert r.pick(1) == 0
    r.set_up(1, True)
    assert r.pick(1) == 1


def test_least_loaded_sends_to_the_engine_with_fewest_requests_then_fewest_tokens_in_flight():
    r = nr.Router("least-loaded", 3)
    r.started(0, 100)
    r.started(1, 10)
    assert r.pick(7) == 2
    r.started(2, 50)
    assert r.pick(7) == 1  # one request each: the fewest tokens


def test_random_is_seeded():
    a, b = nr.Router("random", 4, seed=3), nr.Router("random", 4, seed=3)
    assert [a.pick(0) for _ in range(20)] == [b.pick(0) for _ in range(20)]


def test_a_router_refuses_an_unknown_policy():
    with pytest.raises(ValueError):
        nr.Router("hash", 2)


# --- the replay, with engines in this process ------------------------------------------------


class ThreadEngine:
    """Answers each request after a delay, from a thread; records what it was sent and when."""

    def __init__(self, slot: int, events: queue.Queue, delay_s: float = 0.01, answer: bool = True) -> None:
        self.slot, self.events, self.delay_s, self.answer = slot, events, delay_s, answer
        self.incarnation = 0
        self.sent: list[tuple[str, float]] = []
        self.aborted = 0

    def submit(self, rid, tokens, max_tokens) -> None:
        self.sent.append((rid, time.monotonic()))
        if self.answer:
            ev = {"ev": "done", "id": rid, "tokens": [len(tokens)] * max_tokens, "ttft_s": self.delay_s, "e2e_s": self.delay_s}
            threading.Timer(self.delay_s, self.events.put, ((self.slot, self.incarnation, ev),)).start()

    def abort(self) -> None:
        self.aborted += 1


def work(users: int, turns: int) -> list[list[tuple[list[int], int]]]:
    return [[([u] * (10 + t), 2) for t in range(turns)] for u in range(users)]


def test_replay_sends_a_users_next_turn_only_when_its_last_one_finished():
    events: queue.Queue = queue.Queue()
    engines = {s: ThreadEngine(s, events) for s in range(2)}
    o = nr.replay(work(3, 4), range(0, 4), nr.Router("round-robin", 2), engines, events, 10, "t")
    assert o.status == "ok" and len(o.rows) == 12 == o.requests
    done = {(r.conv, r.turn): r for r in o.rows}
    sent = {rid: t for e in engines.values() for rid, t in e.sent}
    for u in range(3):
        for t in range(1, 4):
            assert sent[f"t/{u}/{t}"] >= sent[f"t/{u}/{t - 1}"] + 0.009
        assert [done[(u, t)].prompt for t in range(4)] == [10, 11, 12, 13]
    assert {r.slot for r in o.rows} == {0, 1}


def test_sticky_replay_never_moves_a_conversation_and_the_summary_says_so():
    events: queue.Queue = queue.Queue()
    engines = {s: ThreadEngine(s, events) for s in range(2)}
    last: dict = {}
    o1 = nr.replay(work(4, 4), range(0, 2), nr.Router("sticky", 2), engines, events, 10, "s", last)
    o2 = nr.replay(work(4, 4), range(2, 4), nr.Router("sticky", 2), engines, events, 10, "s", last)
    rows = o1.rows + o2.rows
    assert len(rows) == 16 and not any(r.moved for r in rows)
    assert all(r.slot == r.conv % 2 for r in rows)
    assert nr.summarize(rows, 1.0)["moved"] == 0.0


def test_replay_gives_up_at_its_deadline_and_aborts_what_is_in_flight():
    events: queue.Queue = queue.Queue()
    engines = {0: ThreadEngine(0, events, answer=False)}
    o = nr.replay(work(2, 3), range(0, 3), nr.Router("round-robin", 1), engines, events, 0.5, "x")
    assert o.status.startswith("timed out: 2 of 6") and engines[0].aborted == 1 and not o.rows


def test_replay_stops_when_an_engine_exits_but_not_for_one_that_was_replaced():
    events: queue.Queue = queue.Queue()
    engines = {0: ThreadEngine(0, events, answer=False)}
    events.put((0, 7, {"ev": "exit", "rc": 0}))  # an earlier incarnation's: ignored
    events.put((0, 0, {"ev": "exit", "rc": 9}))
    o = nr.replay(work(1, 2), range(0, 2), nr.Router("sticky", 1), engines, events, 5, "y")
    assert o.status.startswith("error: engine 0 exited (rc 9)")


def test_pct_interpolates():
    assert nr.pct([1, 2, 3, 4], 0.5) == 2.5 and nr.pct([], 0.5) is None


# --- a whole arm, engines as processes --------------------------------------------------------


class FakeArm(node_arms.Arm):
    """"none" (each engine its own cache) or "shared" (a folder every engine reads)."""

    def __init__(self, name: str, args, label: str, shared_dir: str) -> None:
        super().__init__(args, label)
        self.name = name
        self.dir = shared_dir

    def kv(self, slot: int, engines: int):
        if self.name == "none":
            return None
        return {"kv_connector": "Fake", "kv_connector_extra_config": {"fake.dir": self.dir}}

    def server_metrics(self):
        return {"files": float(len(os.listdir(self.dir)))}

    def server_delta(self, before, after):
        return {"new_blocks": after["files"] - before["files"]}


@pytest.fixture
def fake_node(tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    shared.mkdir()
    monkeypatch.setattr(node.Node, "program", FAKE)
    monkeypatch.setattr(node, "make_arm", lambda name, args, label: FakeArm(name, args, label, str(shared)))
    args = node.parse_args(["--engines", "2", "--arms", "none", "--routers", "round-robin,sticky", "--conversations", "4",
                            "--turns", "3", "--restart-turn", "2", "--gpus", "1", "--min-cell-s", "2",
                            "--cell-timeout", "60", "--out", str(tmp_path / "out")])
    convs = node.prepare(args)
    os.makedirs(args.out)
    return args, convs


def test_an_arm_runs_its_cells_and_the_restart_and_a_shared_cache_serves_the_replacement(fake_node):
    args, convs = fake_node
    res = {}
    for arm in ("none", "shared"):
        res[arm] = node.run_arm(2, arm, args, convs, time.monotonic() + 120)
        assert res[arm]["status"] == "ok", res[arm]["status"]
        cells = {c["router"]: c for c in res[arm]["cells"]}
        assert set(cells) == {"round-robin", "sticky"}
        for c in cells.values():
            assert c["status"] == "ok" and c["done"] == c["requests"] == 12
            assert sum(c["sources"].values()) == c["prompt_tokens"]
            # The engines' own clock: every cell took steps (the fake has no kvd hooks to time).
            assert c["loop"]["steps"] > 0 and c["loop"]["step_s"] >= 0
        assert cells["sticky"]["moved"] == 0.0
        r = res[arm]["restart"]
        assert r["status"] == "ok" and r["swap"]["incarnation"] == 1 and r["slot"] == 1
        assert {s["incarnation"] for s in res[arm]["engine_starts"]} == {0, 1}
        assert all(row["incarnation"] == 1 for row in r["after"]["rows"] if row["slot"] == 1)
    # The replacement starts with an empty GPU cache: without a shared cache it recomputes its
    # conversations' prefixes, with one they come from the connector.
    assert res["none"]["restart"]["after"]["replacement_sources"]["external_kv_transfer"] == 0
    assert res["none"]["restart"]["after"]["replacement_sources"]["local_compute"] > 0
    assert res["shared"]["restart"]["after"]["replacement_sources"]["external_kv_transfer"] > 0
    # Round-robin moves conversations; only the shared arm serves a moved turn from the connector.
    rr = {a: next(c for c in res[a]["cells"] if c["router"] == "round-robin") for a in res}
    assert rr["none"]["sources"]["external_kv_transfer"] == 0
    if rr["shared"]["moved"]:
        assert rr["shared"]["sources"]["external_kv_transfer"] > 0

    md = node_report.render(list(res.values()), {"args": vars(args), "kv_bytes_per_token": 128 << 10, "link": {"h2d_gbps": 50.0}})
    assert "| 2 | round-robin | shared | 12/12 |" in md
    assert "| 2 | sticky | none | 12/12 |" in md
    assert "0 of 12" in md  # the same prompts give the fake's same tokens in both arms
    assert md.count("| 2 | none | ") >= 2 and "replacement, first turn after" in md
    assert "| 2 | sticky | none | " in md.split("| ask again |")[1]  # the engines' clock, per cell

    # --report merges the arms' files, as node.py leaves them in --out.
    for arm, r in res.items():
        with open(os.path.join(args.out, f"node-E2-{arm}.json"), "w") as f:
            json.dump({"meta": {"args": vars(args), "kv_bytes_per_token": 128 << 10}, "result": r}, f)
    merged = node_report.merge([args.out])
    assert "| 2 | round-robin | shared | 12/12 |" in merged and "| 2 | round-robin | none | 12/12 |" in merged


def test_an_engine_that_fails_to_start_fails_its_arm_and_leaves_no_process(fake_node, monkeypatch):
    args, convs = fake_node
    monkeypatch.setattr(node.Node, "program", os.path.join(BENCHES, "tests", "no_such_engine.py"))
    r = node.run_arm(2, "none", args, convs, time.monotonic() + 60)
    assert r["status"].startswith("error: EngineError")
    assert not r["cells"]


def test_a_dry_run_prints_the_workload_and_the_tables(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["node.py", "--dry-run", "--quick", "--out", str(tmp_path)])
    assert node.main() == 0
    out = capsys.readouterr().out
    assert "# workload per cell: {'users': 8, 'requests': 40" in out
    assert "| 2 | round-robin | kvd | 40 |" in out and "| 2 | kvd | – |" in out
    assert os.path.exists(tmp_path / "node.md")


def test_the_clock_times_each_hook_and_counts_the_lookups_that_answer_ask_again():
    import node_engine as ne

    class Conn:
        def get_num_new_matched_tokens(self, req, computed):
            time.sleep(0.002)
            return (None, False) if req == "wait" else (16, True)

        def wait_for_save(self):
            return None

        def build_connector_meta(self, out):
            # The plan's loads, under `inner` as kvd.vllm.KvdConnectorMetadata (a vLLM class)
            # carries them: one waits for the model's stream.
            from types import SimpleNamespace

            from kvd.metadata import KvdMetadata, LoadOp

            return SimpleNamespace(inner=KvdMetadata(loads=[LoadOp("a", 0, []), LoadOp("b", 0, [], wait=False)]))

    clock = ne.Clock()
    clock.wrap(Conn, ("get_num_new_matched_tokens", "wait_for_save", "build_connector_meta", "not_a_hook"))
    c = Conn()
    assert c.get_num_new_matched_tokens("wait", 0) == (None, False)
    assert c.get_num_new_matched_tokens("hit", 0) == (16, True)
    c.wait_for_save()
    c.build_connector_meta(None)
    snap = clock.snapshot()
    assert snap["bench:ask_again"] == 1
    assert (snap["bench:loads"], snap["bench:loads_waited"]) == (2, 1)
    assert snap["bench:hook_calls{hook=get_num_new_matched_tokens}"] == 2
    assert snap["bench:hook_s{hook=get_num_new_matched_tokens}"] >= 0.004
    assert snap["bench:hook_calls{hook=wait_for_save}"] == 1
    assert not any("not_a_hook" in k for k in snap)
    # Steps that spent 30 ms or more in the hooks (100 ms or more) count as held.
    for hooks_s in (0.001, 0.029, 0.030, 0.099, 0.250):
        clock.step_done(hooks_s)
    snap = clock.snapshot()
    assert (snap["bench:held{ms=30}"], snap["bench:held{ms=100}"]) == (3, 1)
    loop = {"steps": 5.0, "step_s": 1.0, "ask_again": 0.0, "hook_s{hook=start_load_kv}": 0.4,
            "held{ms=30}": 3.0, "held{ms=100}": 1.0, "loads": 2.0, "loads_waited": 1.0}
    rows = node_report._loop([{"engines": 1, "arm": "kvd", "cells": [{"router": "sticky", "loop": loop}]}])
    assert rows[2].endswith("| 0 | 3 / 1 | 2 / 1 |"), rows[2]


def test_the_gc_clock_sums_the_time_pythons_collector_ran():
    import gc

    import node_engine as ne

    clock = ne.GcClock()
    gc.callbacks.append(clock)
    try:
        assert clock.s == 0.0
        cycles = [[] for _ in range(200_000)]
        for c in cycles:
            c.append(c)
        del cycles, c
        gc.collect()
    finally:
        gc.callbacks.remove(clock)
    # A collection of 200,000 cycles takes milliseconds, each counted from its start to its stop.
    assert clock.s > 0.0


def test_the_step_loop_takes_its_gc_clock_off_the_collectors_callbacks_when_it_ends(monkeypatch):
    import gc
    import queue
    import types

    import node_engine as ne

    monkeypatch.setenv("NODE_STEP_LOG", "1")
    before, seen, sent = list(gc.callbacks), [], []
    cmds: queue.Queue = queue.Queue()
    cmds.put({"cmd": "metrics", "seq": 1})
    cmds.put({"cmd": "stop"})

    def send(ev: dict) -> None:
        seen.append(list(gc.callbacks))
        sent.append(ev["ev"])

    llm = types.SimpleNamespace(llm_engine=object())
    assert ne.serve(llm, cmds, send, types.SimpleNamespace(metrics=lambda _: {})) == 0
    assert sent == ["metrics", "bye"]
    assert any(isinstance(cb, ne.GcClock) for cb in seen[0])  # registered while it ran
    assert gc.callbacks == before
    # A loop that fails (here: an engine that cannot take the request) lets go of it too.
    cmds.put({"cmd": "gen", "id": "x", "tokens": [1, 2, 3], "max_tokens": 1})
    with pytest.raises(AttributeError):
        ne.serve(llm, cmds, send, types.SimpleNamespace(metrics=lambda _: {}))
    assert gc.callbacks == before


def test_rounds_reverse_the_arms_order_each_time_and_name_each_run():
    assert node.schedule([2], ["none", "kvd"], 1, "x") == [(2, "none", "x"), (2, "kvd", "x")]
    assert node.schedule([2, 4], ["none", "offload", "kvd"], 2, "x") == [
        (2, "none", "x-r1"), (2, "offload", "x-r1"), (2, "kvd", "x-r1"),
        (2, "kvd", "x-r2"), (2, "offload", "x-r2"), (2, "none", "x-r2"),
        (4, "none", "x-r1"), (4, "offload", "x-r1"), (4, "kvd", "x-r1"),
        (4, "kvd", "x-r2"), (4, "offload", "x-r2"), (4, "none", "x-r2"),
    ]


def test_passes_run_each_cell_again_on_the_same_engines_with_new_tokens_and_restart_arms_picks_who_restarts(fake_node):
    args, convs = fake_node
    args.passes, args.routers, args.restart_arms = 2, "round-robin", "kvd"
    # The first pass keeps the salt of runs made before --passes; each later one has its own tokens.
    assert node.cell_salt(2, "round-robin") == node.cell_salt(2, "round-robin", 1) == "node-E2-round-robin"
    first, second = (node.users(convs, node.cell_salt(2, "round-robin", k), args, args.vocab) for k in (1, 2))
    assert all(a[0] != b[0] for ua, ub in zip(first, second) for a, b in zip(ua, ub))
    res = [node.run_arm(2, arm, args, convs, time.monotonic() + 120) for arm in ("none", "kvd")]
    for r in res:
        assert r["status"] == "ok", r["status"]
        assert [(c["router"], c["pass"], c["done"]) for c in r["cells"]] == [("round-robin", 1, 12), ("round-robin", 2, 12)]
        # One start of the two engines served both passes; only kvd, named in --restart-arms, restarted one.
        assert len(r["engine_starts"]) == (3 if r["arm"] == "kvd" else 2)
        assert ("restart" in r) == (r["arm"] == "kvd")
    for r in res:  # the fake's server counters are not kvd's: no copy-rate table for them
        for c in r["cells"] + [r.get("restart", {}).get("after", {})]:
            c.pop("server", None)
    md = node_report.render(res, {"args": vars(args), "kv_bytes_per_token": 128 << 10, "link": {}})
    assert "| 2 | round-robin | kvd | 24/24 |" in md
    goal = next(line for line in md.splitlines() if line.startswith("| 2 | round-robin | ") and "x (none)" in line)
    assert goal.rstrip(" |").split("| ")[-1].count("x / ") == 2  # kvd against none in pass 1 and in pass 2
    assert "0 of 24" in md  # each pass's tokens compared with the none arm's same pass


def test_a_cell_of_n_users_replays_only_the_first_n_conversations_and_a_bad_spec_names_the_form(fake_node):
    args, convs = fake_node
    assert node.cell_spec("sticky:2") == ("sticky", 2) and node.cell_spec("round-robin") == ("round-robin", None)
    for bad in ("sticky:0", "sticky:x", "hash:2"):
        with pytest.raises(ValueError, match="POLICY:USERS"):
            node.cell_spec(bad)
    args.routers, args.restart = "sticky:1,sticky:4", False
    r = node.run_arm(2, "none", args, convs, time.monotonic() + 120)
    assert r["status"] == "ok", r["status"]
    # One user's three turns, then four users' twelve.
    assert [(c["router"], c["done"], c["requests"]) for c in r["cells"]] == [("sticky:1", 3, 3), ("sticky:4", 12, 12)]
    assert {row["conv"] for row in r["cells"][0]["rows"]} == {0}
    md = node_report.render([r], {"args": vars(args), "kv_bytes_per_token": 128 << 10, "link": {}})
    assert "| 2 | sticky:1 | none | 3/3 |" in md and "| 2 | sticky:4 | none | 12/12 |" in md


def test_an_arm_whose_start_ate_its_share_still_runs_each_cells_first_pass_on_time_the_later_arms_spare(fake_node):
    args, convs = fake_node
    args.routers, args.restart, args.passes, args.min_cell_s = "round-robin,sticky", False, 2, 100.0
    # Its own share (60 s) is under a cell's minimum: alone it runs nothing.
    r = node.run_arm(2, "none", args, convs, time.monotonic() + 60)
    assert [c["status"][:8] for c in r["cells"]] == ["skipped:"] * 4
    # With 300 s the arms after it can spare, each cell's first pass runs; the second keeps to the share.
    r = node.run_arm(2, "none", args, convs, time.monotonic() + 60, t_first_end=time.monotonic() + 300)
    assert [(c["router"], c["pass"], c.get("status", "")[:8]) for c in r["cells"]] == [
        ("round-robin", 1, "ok"), ("round-robin", 2, "skipped:"), ("sticky", 1, "ok"), ("sticky", 2, "skipped:")]
    assert r["cells"][0]["done"] == 12 and r["cells"][2]["done"] == 12


def test_a_restart_without_a_sticky_cell_says_its_ratio_is_not_against_the_goals_steady_state(fake_node):
    args, convs = fake_node
    rows, res = {}, {}
    for routers in ("round-robin,sticky", "round-robin"):
        args.routers = routers
        r = res[routers] = node.run_arm(2, "shared", args, convs, time.monotonic() + 120)
        assert r["status"] == "ok", r["status"]
        md = node_report.render([r], {"args": vars(args), "kv_bytes_per_token": 128 << 10, "link": {}})
        rows[routers] = next(line for line in md.splitlines() if line.startswith("| 2 | shared | ") and " s (" in line)
    # The second reading: every turn of the replacement after the restart against the same
    # engine's same turns in the sticky cell.
    r = res["round-robin,sticky"]
    x, sticky = r["restart"], next(c for c in r["cells"] if c["router"] == "sticky")
    after = [y["ttft_s"] for y in x["after"]["rows"] if y["slot"] == x["slot"]]
    steady = [y["ttft_s"] for y in sticky["rows"] if y["slot"] == x["slot"] and y["turn"] >= x["restart_turn"]]
    assert after and steady
    cols = [c.strip() for c in rows["round-robin,sticky"].split("|")]
    assert cols[8] == f"{node_report.fmt_s(nr.pct(after, 0.5))} ({len(after)})"
    assert cols[9] == node_report.fmt_s(nr.pct(steady, 0.5))
    assert cols[10] == f"{nr.pct(after, 0.5) / nr.pct(steady, 0.5):.2f}x"
    assert "– (no sticky cell)" in rows["round-robin"]
    # With a sticky cell the ratio is to the same engine's same turn there: the goal's steady state.
    assert "(no sticky cell)" not in rows["round-robin,sticky"]
    assert "x |" in rows["round-robin,sticky"] and "other engines" not in rows["round-robin,sticky"]
    # Without one the only comparison is the other engines' same turn, and the row says so.
    assert "(no sticky cell)" in rows["round-robin"]
    assert "x of the other engines (no sticky cell: not the goal's steady)" in rows["round-robin"]


def test_the_restart_control_resumes_every_conversation_at_once_on_the_same_engines(fake_node):
    args, convs = fake_node
    args.routers, args.restart_control, args.restart_control_pause = "sticky", True, 0.5
    r = node.run_arm(2, "shared", args, convs, time.monotonic() + 120)
    assert r["status"] == "ok", r["status"]
    c, x = r["restart_control"], r["restart"]
    assert c["status"] == "ok" and "swap" not in c and x["status"] == "ok" and x["swap"]["incarnation"] == 1
    assert 0.5 <= c["pause_s"] < 1.5  # traffic held between the phases, as the swap holds it
    k = args.restart_turn
    # The control's two phases run every turn once on the engines that started the arm; the
    # restart's after phase runs on the replacement.
    assert sorted((y["conv"], y["turn"]) for y in c["before"]["rows"]) == [(i, t) for i in range(4) for t in range(k)]
    assert sorted((y["conv"], y["turn"]) for y in c["after"]["rows"]) == [(i, t) for i in range(4) for t in range(k, 3)]
    assert {y["incarnation"] for y in c["before"]["rows"] + c["after"]["rows"]} == {0}
    # Its own prompts: the restart's first phase computes them again on engine 1, not GPU hits.
    assert x["before"]["sources"]["local_compute"] > 0
    # Each request carries the engine's step count at its arrival: the same engine's count grew
    # while it ran the first phase, and the resumed turn's first step took one to all of the slot's.
    for slot in (0, 1):
        steps_before = [y["enq_step"] for y in c["before"]["rows"] if y["slot"] == slot]
        steps_after = [y["enq_step"] for y in c["after"]["rows"] if y["slot"] == slot]
        assert all(isinstance(n, int) for n in steps_before + steps_after)
        assert min(steps_after) > max(steps_before), (steps_before, steps_after)
    n_turn = sum(y["slot"] == 1 and y["turn"] == k for y in c["after"]["rows"])
    assert 1 <= node_report._first_step(c, 1, k)[0] <= n_turn
    md = node_report.render([r], {"args": vars(args), "kv_bytes_per_token": 128 << 10, "link": None})
    rows = [ln for ln in md.splitlines() if ln.startswith("| 2 | shared |") and ln.count("|") == 13 and "**" in ln]
    assert len(rows) == 1 and rows[0].endswith("| ok |") and "x** |" in rows[0], md
    assert "replacement's first turn to the control" in md


def test_the_first_step_is_read_from_the_engines_step_count_and_from_queueing_in_older_runs():
    def row(queued: float, step: int | None) -> dict:
        return {"slot": 1, "turn": 5, "ttft_s": 0.1 + queued, "queued_s": queued, "enq_step": step}

    # Three waited for the step the first began (one of them 8 ms: past the old cutoff); one came
    # 1 ms after its start and waited for the next.
    x = {"after": {"rows": [row(0.0005, 40), row(0.008, 40), row(0.003, 40), row(0.001, 41)]}}
    assert node_report._first_step(x, 1, 5) == (3, 0.1)
    # Rows from runs that did not record the count: those queued under 5 ms, here the wrong three
    # (the 8 ms one left out, the next step's counted).
    old = {"after": {"rows": [{k: v for k, v in y.items() if k != "enq_step"} for y in x["after"]["rows"]]}}
    assert node_report._first_step(old, 1, 5) == (3, 0.1)
    old["after"]["rows"][2]["queued_s"] = 0.006
    assert node_report._first_step(old, 1, 5)[0] == 2


def test_the_control_table_reads_a_failed_restart_and_a_control_alone():
    def row(slot: int, turn: int, ttft: float, queued: float = 0.001) -> dict:
        return {"slot": slot, "turn": turn, "ttft_s": ttft, "incarnation": 0, "queued_s": queued}

    control = {"status": "ok", "slot": 1, "restart_turn": 2, "after": {"rows": [row(1, 2, 0.1), row(1, 3, 0.05), row(0, 2, 0.2)]}}
    sticky = {"router": "sticky", "rows": [row(1, 2, 0.05)]}
    base = {"engines": 2, "arm": "kvd", "status": "ok", "cells": [sticky], "restart_control": control}
    # The restart failed after the control: the control's figures, no ratio to the replacement.
    failed = node_report._control_row({**base, "restart": {"status": "restart failed: EngineError: x"}})
    assert failed == "| 2 | kvd | 100 ms (1) | 2.00x | **–** | 75 ms (2) | – | – | – | – | – | ok |"
    # After a restart: the replacement against the control, and every engine's against the
    # control's (the kept engine 0 here gained what the replacement lost: 0.2 -> 0.1 s).
    restart = {"status": "ok", "slot": 1, "restart_turn": 2,
               "after": {"rows": [row(1, 2, 0.15, 0.03), row(1, 3, 0.05), row(0, 2, 0.1)]}}
    ok = node_report._control_row({**base, "restart": restart})
    # Its first-turn request waited 30 ms for the engine's first step, the control's did not:
    # in the engine, 0.12 s against 0.099 s.
    assert ok == "| 2 | kvd | 100 ms (1) | 2.00x | **1.50x** | 75 ms (2) | 1.33x | 1 / 0 | 1.21x | 0.83x | 1.00x | ok |"
    # The run was interrupted before the restart: its table still has the control.
    md = "\n".join(node_report._restarts([base]))
    assert "| 2 | kvd | 100 ms (1) | 2.00x | **–** |" in md
    # A control that failed in its first phase: its status, nothing to read.
    bad = node_report._control_row({**base, "restart_control": {"status": "before the restart: timeout"}})
    assert bad.startswith("| 2 | kvd | – |") and "before the restart: timeout" in bad

    # Over several runs, one line: the replacement's first turn to the control, and in the
    # engine only where both first steps took as many requests (the first run's did not).
    second = {**base, "restart_control": {**control, "after": {"rows": [row(1, 2, 0.05), row(1, 3, 0.05), row(0, 2, 0.2)]}},
              "restart": {**restart, "after": {"rows": [row(1, 2, 0.1), row(1, 3, 0.05), row(0, 2, 0.1)]}}}
    third = {**base, "restart": {"status": "restart failed: EngineError: x"}}  # no restart: not counted
    summary = node_report._control_summary([{**base, "restart": restart}, second, third])
    assert summary == ["- E=2, kvd, 2 restarts: the replacement's first turn to the control median 1.75x "
                       "(1.50-2.00x), within 1.2x in 0 of 2; in the engine, where both first steps took as many "
                       "requests (1 run), median 2.02x (2.02-2.02x), within 1.2x in 0; every engine's first turn "
                       "median 0.82x (0.80-0.83x)."]


def test_step_log_traces_every_engine_and_the_replacements_phase_has_its_own_clock(fake_node):
    args, convs = fake_node
    args.routers, args.step_log = "sticky", True
    r = node.run_arm(2, "shared", args, convs, time.monotonic() + 120)
    assert r["status"] == "ok", r["status"]
    with open(os.path.join(args.out, f"{r['label']}-e1.log")) as f:
        first, replacement = f.read().split("==== engine slot 1 incarnation 1")

    def lines(log: str, kind: str) -> list[str]:
        return [ln for ln in log.splitlines() if ln.startswith(kind + " ")]

    # Each engine, the replaced one and its replacement, logs one line a step (with kvd's hooks
    # and Python's collector in it) and each request's arrival and end: the replacement's steps
    # after the restart can be read against its predecessor's in the sticky cell.
    before = [y for y in r["cells"][0]["rows"] + r["restart"]["before"]["rows"] if y["slot"] == 1]
    after = [y for y in r["restart"]["after"]["rows"] if y["slot"] == 1]
    for log, rows in ((first, before), (replacement, after)):
        # The probe's request counts too.
        assert len(lines(log, "gen")) == len(lines(log, "done")) == len(rows) + 1
        steps = lines(log, "step")
        assert len(steps) >= len(rows)
        assert all(" ms, hooks " in ln and " ms, gc " in ln and "queues unknown" in ln for ln in steps)
        # The stand-in runs a request a step and returns it: one output a step that ran one.
        assert all(", outputs 1, " in ln for ln in steps)
    loop = r["restart"]["after"]["replacement_loop"]
    assert loop["steps"] >= len(after)


def test_a_warmed_restart_replays_the_slots_newest_prompts_from_a_real_kvd_each_marked(tmp_path, monkeypatch):
    """--warm through the bench: the replacement replays the newest prompts a real kvd remembers
    for its slot, the readiness probe's left out, oldest first, ``--warm-tokens`` each, and every
    request carries the warm's mark (``kvd.warm.WARM_PARAM``) into the engine's sampling
    params, which is how the connector tells a warm's replay from traffic."""
    from kvd import _native
    from kvd.warm import WARM_PARAM

    kvd_bin = os.environ.get("KVD_BIN")
    if not kvd_bin:
        pytest.skip("KVD_BIN is unset: scripts/test.sh builds kvd and sets it")
    monkeypatch.setattr(node.Node, "program", FAKE)
    args = node.parse_args(["--engines", "1", "--arms", "kvd", "--warm", "--kvd", kvd_bin, "--cpu-gib", "0.25",
                            "--gpus", "1", "--step-log", "--conversations", "1", "--out", str(tmp_path)])
    node.prepare(args)
    arm = node_arms.make_arm("kvd", args, "w")
    arm.start(1, 60)
    n = node.Node(1, arm, args, "w")
    try:
        n.start(60)
        (probe,) = [list(t) for t in n.probes]
        # What the connector would have remembered for slot 0 (the stand-in engine remembers
        # nothing): four turns and, between the last two, the probe's prompt.
        turns = [node.fresh(100 + i, 300 + 16 * i, args.vocab) for i in range(4)]
        c = _native.Client(arm.server.url, "test", role="tool", connect_timeout=2.0, request_timeout=5.0)
        group = node_arms.warm_group(0)
        for tokens in (turns[0], turns[1], turns[2], probe, turns[3]):
            c.remember(group, "", array.array("I", tokens).tobytes()).result(5)
        before = n.engines[0].metrics()
        assert not any(k.startswith("fake:requests_with_kv_param") for k in before)

        swap = n.restart(0, 60, warm_prompts=2)
        assert swap["incarnation"] == 1
        assert swap["warm"]["prompts"] == 2 and swap["warm"]["output_tokens"] == args.warm_tokens == 1
        assert swap["warm"]["tokens"] == len(turns[2]) + len(turns[3])
        # Only the warm's two requests carry the mark: the replacement's probe does not.
        after = n.engines[0].metrics()
        assert after[f"fake:requests_with_kv_param{{key={WARM_PARAM}}}"] == 2
        assert after["vllm:prompt_tokens_by_source{source=local_compute}"] == len(probe) + len(turns[2]) + len(turns[3])
        with open(os.path.join(args.out, "w-e0.log")) as f:
            replacement = f.read().split("==== engine slot 0 incarnation 1")[1]
        gens = [ln.split()[1] + " " + ln.split(", ")[-1] for ln in replacement.splitlines() if ln.startswith("gen ")]
        assert gens == [f"probe/0/1 {len(probe)} tokens", f"warm/0/1/0 {len(turns[2])} tokens",
                        f"warm/0/1/1 {len(turns[3])} tokens"]
    finally:
        n.stop()
        arm.stop()


def test_a_restart_runs_on_time_the_later_arms_spare_when_the_arms_own_share_is_spent(fake_node):
    args, convs = fake_node
    args.routers = "sticky"
    # 12 s of its own and nothing to borrow: the engines start and the sticky cell runs, but a
    # restart needs at least the 15 s margin over the replacement's start: skipped.
    r = node.run_arm(2, "none", args, convs, time.monotonic() + 12)
    assert r["cells"][0]["status"] == "ok", r["cells"][0]["status"]
    assert r["restart"]["status"].startswith("skipped:") and "needed" in r["restart"]["status"], r["restart"]
    # With time the arms after it can spare (a fresh machine's first engine build ate its share),
    # the restart runs on it too.
    r = node.run_arm(2, "none", args, convs, time.monotonic() + 12, t_first_end=time.monotonic() + 120)
    assert r["restart"]["status"] == "ok", r["restart"]


def test_a_control_that_runs_long_leaves_the_restart_skipped_and_says_so(fake_node, monkeypatch):
    args, convs = fake_node
    args.routers, args.restart_control = "sticky", True
    real_restart, real_clock, jump = node.run_restart, time.monotonic, [0.0]
    monkeypatch.setattr(time, "monotonic", lambda: real_clock() + jump[0])

    def control_runs_long(n, work, a, timeout_s, label, swap=True):
        res = real_restart(n, work, a, timeout_s, label, swap)
        if not swap:
            jump[0] += 200.0  # the clock moves on as if the control had taken 200 s more
        return res

    monkeypatch.setattr(node, "run_restart", control_runs_long)
    r = node.run_arm(2, "none", args, convs, time.monotonic() + 120)
    assert r["restart_control"]["status"] == "ok", r["restart_control"]
    assert "after the control" in r["restart"]["status"] and r["restart"]["status"].startswith("skipped:"), r["restart"]
    # The control's figures are still reported; the restart's row says why it has none.
    md = node_report.render([r], {"args": vars(args), "kv_bytes_per_token": 128 << 10, "link": None})
    assert "after the control" in md and "| 2 | none |" in md
    # With time the arms after it can spare, the same long control leaves the restart enough.
    r = node.run_arm(2, "none", args, convs, time.monotonic() + 120, t_first_end=time.monotonic() + 400)
    assert r["restart_control"]["status"] == "ok" and r["restart"]["status"] == "ok", r["restart"]


def test_report_merges_runs_of_one_engine_mode_only_also_those_recorded_before_the_signature_named_it(tmp_path):
    def run(folder: str, run_id: str, cudagraphs: bool, sig_has_mode: bool) -> None:
        sig = {"model": "llama8b", "conversations": 16}
        if sig_has_mode:
            sig["cudagraphs"] = cudagraphs
        doc = {"meta": {"args": {"cudagraphs": cudagraphs}, "kv_bytes_per_token": 128 << 10, "link": None},
               "result": {"run": run_id, "engines": 2, "arm": "kvd", "label": "node-E2-kvd", "status": "ok",
                          "sig": sig, "cells": []}}
        os.makedirs(tmp_path / folder, exist_ok=True)
        with open(tmp_path / folder / f"node-E2-kvd-{run_id}.json", "w") as f:
            json.dump(doc, f)

    run("old-eager", "a", False, False)
    run("old-graphs", "b", True, False)
    run("new-eager", "c", False, True)
    dirs = [str(tmp_path / d) for d in ("old-eager", "old-graphs", "new-eager")]
    results, _ = node_report.load(dirs)
    assert {r["run"]: r["sig"]["cudagraphs"] for r in results} == {"a": False, "b": True, "c": False}
    md = node_report.merge(dirs)
    assert "2 different workloads" in md and "Runs: a, c." in md


def test_the_readiness_probe_sends_as_many_fresh_tokens_as_asked(fake_node):
    args, convs = fake_node
    args.routers, args.step_log, args.probe_tokens = "sticky", True, 300
    r = node.run_arm(2, "shared", args, convs, time.monotonic() + 120)
    assert r["status"] == "ok" and r["restart"]["status"] == "ok", (r["status"], r["restart"])
    with open(os.path.join(args.out, f"{r['label']}-e1.log")) as f:
        log = f.read()
    # Both incarnations' probes, 300 tokens each.
    assert len(re.findall(r"^gen probe/1/[01] [\d.]+, 300 tokens$", log, re.M)) == 2, log[:2000]
    assert node_report.signature(args)["probe_tokens"] == 300


def test_a_restart_plan_that_cannot_fit_is_named_before_any_engine_starts(capsys, tmp_path, monkeypatch):
    # Session 35's wasted call: five CUDA-graph repeats in 440 s, 88 s each against ~140 s needed.
    base = ["node.py", "--dry-run", "--engines", "2", "--arms", "kvd", "--routers", "sticky", "--restart-arms", "kvd",
            "--restart-control", "--out", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", base + ["--cudagraphs", "--repeats", "5", "--budget-s", "440"])
    assert node.main() == 0
    out = capsys.readouterr().out
    assert "# warning: 88 s a run of an arm (440 s over 5)" in out
    assert "lower --repeats to 3 or raise --budget-s to 700" in out
    # Three repeats fit the same budget; so do five eager ones in 560 s (session 35's calls).
    for extra in (["--cudagraphs", "--repeats", "3", "--budget-s", "440"], ["--repeats", "5", "--budget-s", "560"]):
        monkeypatch.setattr(sys, "argv", base + extra)
        assert node.main() == 0
        assert "# warning" not in capsys.readouterr().out


def test_a_cells_kvd_figures_read_the_copy_threads_submit_time_from_a_real_kvd(tmp_path):
    """``kvd_delta`` over two scrapes of a real kvd around one store and one retrieve (``kvd.check``'s
    host-memory round trip, on the host copy thread): a job each way, its submit seconds, and
    the bucket bound of the slowest; the copy table prints them."""
    from kvd.check import round_trip

    import vllm_harness as vh

    kvd_bin = os.environ.get("KVD_BIN")
    if not kvd_bin:
        pytest.skip("KVD_BIN is unset: scripts/test.sh builds kvd and sets it")
    server = vh.KvdServer(kvd_bin, 0.25, 16, str(tmp_path / "kvd.log"))
    server.start()
    try:
        before = server.metrics()
        round_trip(server.url, 5.0, None)
        k = node_arms.kvd_delta(before, server.metrics())
    finally:
        server.kill()
    for direction in ("h2d", "d2h"):
        assert k[f"{direction}_copies"] == 1
        assert 0 < k[f"{direction}_submit_s"] <= k[f"{direction}_submit_slowest_s"] < float("inf")
    # The bound is a bucket's (kvd's are 1 µs × 2.5ⁱ): the least one at or above the job's time.
    assert any(math.isclose(k["h2d_submit_slowest_s"], 1e-6 * 2.5 ** i) for i in range(14))
    assert node_arms.slowest_bound({}, "kvd_copy_submit_duration_seconds", "h2d") is None

    result = {"engines": 1, "arm": "kvd", "cells": [{"router": "sticky", "label": "x", "server": k}]}
    (row,) = [ln for ln in node_report._kvd([result], {}) if ln.startswith("| 1 | sticky |")]
    assert re.search(r"\| \d\.\d{3} s \(≤ [\d.]+ ms\) / \d\.\d{3} s \(≤ [\d.]+ ms\) \|$", row), row


def test_the_kvd_base_arm_runs_the_binary_it_is_given_and_is_refused_without_one(tmp_path, capsys):
    """``--arms kvd-base`` measures another kvd build against the current one in one call: the arm
    starts ``--kvd-base``'s binary, says so when it is missing, and prepare refuses the arm
    without the flag; its copy figures get their own rows."""
    flags = ["--engines", "1", "--routers", "sticky", "--conversations", "2", "--turns", "2", "--out", str(tmp_path)]
    with pytest.raises(SystemExit) as e:
        node.prepare(node.parse_args([*flags, "--arms", "kvd,kvd-base"]))
    assert "--kvd-base PATH" in str(e.value)
    args = node.parse_args([*flags, "--arms", "kvd,kvd-base", "--kvd", "/bin/true", "--kvd-base", str(tmp_path / "none")])
    node.prepare(args)
    base, current = node_arms.make_arm("kvd-base", args, "b"), node_arms.make_arm("kvd", args, "k")
    assert isinstance(base, node_arms.Kvd) and base.name == "kvd-base"
    assert (base.binary, current.binary) == (str(tmp_path / "none"), "/bin/true")
    assert current.unavailable() == "" and str(tmp_path / "none") in base.unavailable()
    results = [{"engines": 1, "arm": a, "cells": [{"router": "sticky", "server": {"retrieved_gib": 1.0, "stored_gib": 2.0}}]}
               for a in ("kvd", "kvd-base")]
    rows = [ln for ln in node_report._kvd(results, {}) if ln.startswith("| 1 | sticky")]
    assert [r.split(" | ")[1] for r in rows] == ["sticky (kvd-base)", "sticky"]
    # Its own connector settings, where given: one setting against another with one binary.
    assert base.kv(0, 1) == current.kv(0, 1)
    args = node.parse_args([*flags, "--arms", "kvd,kvd-base", "--kvd", "/bin/true", "--kvd-base", "/bin/true",
                            "--kvd-extra", '{"kvd.presence": false}', "--kvd-base-extra", '{"kvd.layout": "BLNHC"}'])
    base, current = node_arms.make_arm("kvd-base", args, "b"), node_arms.make_arm("kvd", args, "k")
    extra = lambda arm: arm.kv(0, 1)["kv_connector_extra_config"]  # noqa: E731
    assert extra(base)["kvd.layout"] == "BLNHC" and "kvd.presence" not in extra(base)
    assert extra(current)["kvd.presence"] is False and "kvd.layout" not in extra(current)
    # Refused before any arm runs: JSON that is not an object, or settings for an arm not run.
    for bad, said in ((["--arms", "kvd", "--kvd-extra", "{kvd.layout: BLNHC}"], "--kvd-extra"),
                      (["--arms", "kvd", "--kvd-extra", "[1]"], "not a JSON object"),
                      (["--arms", "kvd", "--kvd-base-extra", "{}"], "add it to --arms")):
        with pytest.raises(SystemExit) as e:
            node.prepare(node.parse_args([*flags, *bad]))
        assert said in str(e.value), e.value
