"""GPU tests of the connector's worker and scheduler objects (run on a GPU host by
scripts/gpu-check.sh; deselected elsewhere by the ``gpu`` marker).

The KV cache is allocated exactly as vLLM 0.33's ``allocate_kv_cache`` does — one int8 buffer,
per-layer ``[blocks, heads, tokens, content]`` views by ``as_strided`` in the resolved layout —
and the connector objects are called in vLLM's order: lookup, allocate, build the plan, store
after the forward, overwrite the GPU blocks, look up again, load into other blocks, check every
byte."""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")

from kvd import _native  # noqa: E402
from kvd.config import KvdConfig  # noqa: E402
from kvd.connection import Connection  # noqa: E402
from kvd.scheduler import GroupInfo, KvdScheduler, SchedRequest  # noqa: E402
from kvd.testing import order_strides, until as _until  # noqa: E402
from kvd.worker import KvdWorker, WorkerGroup  # noqa: E402

CHUNK = 256
BLOCK = 16


def require_gpus(n: int) -> None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < n:
        pytest.fail(f"this test needs {n} GPU(s); found {torch.cuda.device_count() if torch.cuda.is_available() else 0}")


def allocate_kv(order: str, layers: int, blocks: int, heads: int, tokens: int, content: int, dtype, device="cuda"):
    """vLLM 0.33: one int8 buffer; each layer a [B, H, N, C] as_strided view in ``order``."""
    elem = torch.tensor([], dtype=dtype).element_size()
    acc, stride = order_strides(order, layers, blocks, heads, tokens, content)
    buf = torch.zeros(acc * elem, dtype=torch.int8, device=device)
    typed = buf.view(dtype)
    views = [
        torch.as_strided(typed, (blocks, heads, tokens, content), (stride["B"], stride["H"], stride["N"], stride["C"]), l * stride["L"])
        for l in range(layers)
    ]
    return buf, views


def randomize(buf):
    buf.copy_(torch.randint(-128, 128, buf.shape, dtype=torch.int8, device=buf.device))


def block_data(views, blocks):
    return torch.stack([torch.stack([v[b] for v in views]) for b in blocks]).view(torch.int8).clone()


# kvd's first pinning of the pool and GPU copies under load take longer than host tests allow.
until = functools.partial(_until, timeout=30.0, interval=0.0005)


def cfg(url):
    return KvdConfig(url=url, chunk_tokens=CHUNK, connect_timeout_s=2.0, request_timeout_s=10.0)


def stream():
    return int(torch.cuda.current_stream().cuda_stream)


def schedule_round_trip(url: str, views, buf, fp: int, shard: int = 0, shards=(0,), readers=1, store=True, seed=0, tokens=1100):
    """The multi-step schedule of one rank; returns (worker, scheduler)."""
    conf = cfg(url)
    worker = KvdWorker(conf, Connection(conf, f"w{shard}", "worker"), [WorkerGroup(fp, shard, store=store)], current_stream=stream)
    worker.register([views])
    sched = KvdScheduler(conf, [GroupInfo(fp, BLOCK, tuple(shards), readers)], Connection(conf, f"s{shard}", "scheduler"))
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(0, 32000, (tokens,), generator=g).tolist()
    a = SchedRequest("a", toks, len(toks))
    assert until(lambda: (lambda r: r if r[0] is not None else None)(sched.get_num_new_matched_tokens(a, 0))) == (0, False)
    nblocks = views[0].shape[0]
    perm = (torch.randperm(nblocks - 1, generator=g) + 1).tolist()  # block 0 is vLLM's null block
    need = -(-tokens // BLOCK)
    blocks_a, blocks_b = perm[:need], perm[need : 2 * need]
    sched.update_state_after_alloc("a", [blocks_a], 0)
    # "The forward": the model writes the request's blocks on the current stream.
    randomize(buf)
    meta = sched.build([(a, 0, tokens, [blocks_a])])
    worker.save(meta)
    full = tokens // CHUNK
    expected = block_data(views, blocks_a[: full * CHUNK // BLOCK])
    until(lambda: worker.get_finished() is not None and not worker.has_pending())
    assert worker.stats["stored_chunks"] == (full if store else 0)
    assert sched.request_finished("a")
    worker.save(sched.build([]))
    assert until(lambda: worker.get_finished()[0]) == {"a"}
    return worker, sched, toks, blocks_b, expected


@pytest.mark.parametrize(
    "order,layers,heads,content,dtype",
    [
        ("BLNHC", 32, 8, 256, torch.bfloat16),  # Llama-3.1-8B
        ("LBNHC", 32, 8, 256, torch.float16),
        ("LBHNC", 32, 8, 256, torch.float8_e4m3fn),
        ("BLNHC", 61, 1, 576, torch.bfloat16),  # DeepSeek MLA
        ("LHBNC", 16, 4, 128, torch.bfloat16),
    ],
)
def test_vllm_shaped_cache_round_trips_every_byte(kvd_factory, order, layers, heads, content, dtype):
    require_gpus(1)
    k = kvd_factory("--l1-size-gb", "4", "--chunk-tokens", str(CHUNK))
    buf, views = allocate_kv(order, layers, 256, heads, BLOCK, content, dtype)
    worker, sched, toks, blocks_b, expected = schedule_round_trip(k.url, views, buf, fp=hash((order, layers, str(dtype))) & 0xFFFF_FFFF)
    assert worker.registrations[0].shared_by == "ipc"
    randomize(buf)  # the GPU blocks change before the retrieve
    b = SchedRequest("b", toks, len(toks))
    hit, is_async = until(lambda: (lambda r: r if r[0] is not None else None)(sched.get_num_new_matched_tokens(b, 0)))
    full = len(toks) // CHUNK
    # At least one token is left to compute: 1100 tokens hold 4 whole chunks. One KV cache
    # group: the load is synchronous (b is in this step's forward).
    assert (hit, is_async) == (full * CHUNK, False)
    sched.update_state_after_alloc("b", [blocks_b], hit)
    worker.start_load(sched.build([]))
    # "The forward", on the current stream with no host synchronization: start_load made the
    # stream wait for kvd's copy, so the blocks read here are the loaded ones.
    loaded = block_data(views, blocks_b[: full * CHUNK // BLOCK])
    assert torch.equal(loaded, expected)
    assert worker.load_errors() == set() and worker.get_finished()[1] == set()
    assert worker.stats["loaded_chunks"] == full
    assert k.metric("kvd_copy_errors_total") == 0


def test_deepseek_v4_shaped_cache_round_trips_every_group(kvd_factory):
    """DeepSeek-V4's cache shapes on the GPU, as vLLM groups them: one group of layers of three
    shapes (C4 attention [B,1,64,584], its indexer [B,1,64,132], C128 attention [B,1,2,584];
    256-token blocks, so the C4 rows hold 4 tokens each and the C128 rows 128) and one
    sliding-window group (64-token blocks of [B,1,64,584], window 128, so a chunk's entry there
    is its last 2 blocks). Stored, overwritten, loaded into other blocks, every byte of every
    group checked; the blocks a sliding window leaves null are neither read nor written."""
    require_gpus(1)
    k = kvd_factory("--l1-size-gb", "2", "--chunk-tokens", str(CHUNK))
    blocks = 64
    u8 = torch.uint8
    shapes = [(64, 584)] * 3 + [(64, 132)] * 3 + [(2, 584)] * 2  # C4 attn, C4 indexer, C128 attn
    g0 = [torch.zeros((blocks, 1, n, c), dtype=u8, device="cuda") for n, c in shapes]
    g1 = [torch.zeros((blocks, 1, 64, 584), dtype=u8, device="cuda") for _ in range(4)]
    conf = cfg(k.url)
    worker = KvdWorker(conf, Connection(conf, "w", "worker"), [
        WorkerGroup(0xD5A4, 0, block_tokens=256),
        WorkerGroup(0xD5A5, 0, sliding=True, block_tokens=64, window=128),
    ], current_stream=stream)
    worker.register([g0, g1])
    until(lambda: all(r is not None for r in worker.registrations))
    assert worker.subs == [3, 1], "one registration per layer shape"
    assert worker.registrations[-1].chunk_blocks == 2, "the window's entry: the last 2 of a chunk's 4 blocks"
    sched = KvdScheduler(conf, [GroupInfo(0xD5A4, 256, (0,), 1), GroupInfo(0xD5A5, 64, (0,), 1, sliding=True, window=128)],
                         Connection(conf, "s", "scheduler"))
    sched.set_subs(worker.subs)
    g = torch.Generator().manual_seed(4)
    toks = torch.randint(0, 32000, (5 * CHUNK + 7,), generator=g).tolist()
    a = SchedRequest("a", toks, len(toks))
    assert until(lambda: (lambda r: r if r[0] is not None else None)(sched.get_num_new_matched_tokens(a, 0))) == (0, False)
    blocks_a = [list(range(1, 7)), list(range(1, 22))]
    sched.update_state_after_alloc("a", blocks_a, 0)
    for t in g0 + g1:
        t.copy_(torch.randint(0, 256, t.shape, dtype=u8, generator=g).to("cuda"))
    expected = [[t[blocks_a[0][:5]].clone() for t in g0], [t[blocks_a[1][:20]].clone() for t in g1]]
    worker.save(sched.build([(a, 0, len(toks), blocks_a)]))
    until(lambda: worker.get_finished() is not None and not worker.has_pending())
    assert worker.stats["stored_chunks"] == 5 * 4, "five chunks in each of four registrations"
    for t in g0 + g1:
        t.zero_()

    b = SchedRequest("b", toks, len(toks))
    hit = until(lambda: (lambda r: r if r[0] is not None else None)(sched.get_num_new_matched_tokens(b, 0)))
    assert hit == (5 * CHUNK, True)
    # vLLM's blocks for b: new ones for the full group; in the window group only the blocks of
    # the window before token 1280 (tokens 1153..1279: blocks 18 and 19 of 64 tokens) are real.
    blocks_b = [list(range(30, 36)), [0] * 18 + [40, 41, 42]]
    sched.update_state_after_alloc("b", blocks_b, 5 * CHUNK)
    worker.start_load(sched.build([]))
    assert until(lambda: worker.get_finished()[1]) == {"b"}
    assert worker.load_errors() == set() and worker.failed_loads() == set()
    torch.cuda.synchronize()
    for t, want in zip(g0, expected[0]):
        assert torch.equal(t[blocks_b[0][:5]], want)
    for t, want in zip(g1, expected[1]):
        assert torch.equal(t[[40, 41]], want[18:20]), "the window's blocks hold exactly what was stored"
        assert not t[0].any(), "the null block was not written"
        assert not t[42].any(), "nothing beyond the hit was written"
    assert k.metric("kvd_copy_errors_total") == 0


@pytest.mark.parametrize("stopped", [False, True], ids=["kvd-running", "kvd-sigstopped"])
def test_a_sliding_window_store_never_keeps_the_next_forwards_bytes(kvd_factory, stopped):
    """A sliding-window request prefills: a step's store of the window's tail blocks is sent,
    and the next step's forward (which vLLM may hand those very blocks) overwrites them on the
    model's stream. With kvd running, the connector orders that forward after kvd's copy (on the
    GPU, by kvd's event): kvd holds the first step's bytes. With kvd stopped (SIGSTOP) from before
    the store until after the overwrite, the connector's hold gives up only once the store's
    deadline has passed, and kvd, woken, copies nothing: a miss, never the overwritten bytes."""
    from kvd.metadata import KvdMetadata, StoreOp

    require_gpus(1)
    k = kvd_factory("--l1-size-gb", "1", "--chunk-tokens", str(CHUNK))
    # Gemma-3's sliding layers at a small width: 16-token blocks, window 32, so a chunk's entry
    # is its last 2 blocks (kvd.groups.window_entry).
    buf, views = allocate_kv("BLNHC", 8, 64, 2, BLOCK, 128, torch.bfloat16)
    conf = KvdConfig(url=k.url, chunk_tokens=CHUNK, connect_timeout_s=2.0, request_timeout_s=0.5, store_deadline_s=1.0)
    fp = 0x5A1D
    worker = KvdWorker(conf, Connection(conf, "w", "worker"),
                       [WorkerGroup(fp, 0, sliding=True, block_tokens=BLOCK, window=32)], current_stream=stream)
    worker.register([views])
    until(lambda: all(r is not None for r in worker.registrations))
    reg = worker.registrations[0]
    assert reg.chunk_blocks == 2
    tail, other = [14, 15], [30, 31]
    randomize(buf)  # the first step's forward
    written = block_data(views, tail)
    h = 0x5EED
    if stopped:
        k.sigstop()
    try:
        worker.save(KvdMetadata(stores=[StoreOp("a", 0, [[(h, tail)]])]))
        started = time.monotonic()
        worker.before_forward(KvdMetadata())  # the next step: its forward may reuse the blocks
        held = time.monotonic() - started
        for v in views:  # that forward, on the model's stream
            v[tail] = torch.full_like(v[tail], 7)
        torch.cuda.synchronize()
    finally:
        if stopped:
            os.kill(k.proc.pid, signal.SIGCONT)
    probe = Connection(conf, "probe", "scheduler")
    client = until(probe.client)
    if stopped:
        assert held >= conf.store_deadline_s, f"the forward was held {held:.2f} s, less than the store's deadline"
        time.sleep(1.0)  # kvd, woken, reads what was sent while it was stopped
        hits, _ = client.lookup(fp, 0, [0], [h], pin=False).result(5)
        assert hits == 0, "kvd stored a store it took after its deadline"
        assert k.metric("kvd_bytes_stored_total") == 0
    else:
        assert held < conf.store_deadline_s
        until(lambda: not worker.has_pending() if worker.get_finished() is not None else False)
        assert worker.stats["stored_chunks"] == 1
        live = until(worker.conn.client)
        _, slot = live.retrieve(reg.region, 0, [(h, other)]).result(5)
        if slot is not None:
            reg.stream_wait(slot, stream())
        torch.cuda.synchronize()
        assert torch.equal(block_data(views, other), written), "kvd holds what the first step wrote, not the overwrite"
    probe.close()
    worker.shutdown()


def test_mamba_hybrid_state_round_trips_beside_attention(kvd_factory):
    """A Mamba hybrid on the GPU, as vLLM 0.26 hands its state layers over: each layer's conv
    and SSM state as two views (bf16 and fp32) into one buffer of padded pages, beside a
    full-attention group (block size 256, as vLLM sets it for such models). The state after the
    step's last chunk is stored (one block per chunk), overwritten, and loaded into the block
    vLLM allocates for the boundary of the hit, byte for byte; the null block stays untouched."""
    require_gpus(1)
    k = kvd_factory("--l1-size-gb", "2", "--chunk-tokens", str(CHUNK))
    blocks, layers = 16, 2
    conv_shape, ssm_shape = (192, 3), (8, 64, 32)  # [channels, kernel - 1], [heads, head_dim, state]
    conv_bytes = 192 * 3 * 2
    page = 1 << 20  # padded to the attention page
    buf = torch.zeros(layers * blocks * page, dtype=torch.int8, device="cuda")
    state_views = []
    for l in range(layers):
        base = l * blocks * page
        conv = torch.as_strided(buf.view(torch.bfloat16), (blocks, *conv_shape), (page // 2, 3, 1), base // 2)
        ssm = torch.as_strided(buf.view(torch.float32), (blocks, *ssm_shape), (page // 4, 64 * 32, 32, 1),
                               (base + conv_bytes) // 4)
        state_views += [conv, ssm]
    attn_buf, attn = allocate_kv("BLNHC", 2, blocks, 4, CHUNK, 128, torch.bfloat16)
    conf = cfg(k.url)
    worker = KvdWorker(conf, Connection(conf, "w", "worker"), [
        WorkerGroup(0x3A3B, 0, state=True, block_tokens=CHUNK),
        WorkerGroup(0x3A3C, 0, block_tokens=CHUNK),
    ], current_stream=stream)
    worker.register([state_views, attn])
    until(lambda: all(r is not None for r in worker.registrations))
    assert worker.subs == [2, 1], "conv and SSM states are two registrations"
    assert [r.chunk_blocks for r in worker.registrations] == [1, 1, 1]
    sched = KvdScheduler(conf, [GroupInfo(0x3A3B, CHUNK, (0,), 1, state=True), GroupInfo(0x3A3C, CHUNK, (0,), 1)],
                         Connection(conf, "s", "scheduler"))
    sched.set_subs(worker.subs)
    g = torch.Generator().manual_seed(7)
    toks = torch.randint(0, 32000, (5 * CHUNK + 7,), generator=g).tolist()
    a = SchedRequest("a", toks, len(toks))
    assert until(lambda: (lambda r: r if r[0] is not None else None)(sched.get_num_new_matched_tokens(a, 0))) == (0, False)
    # vLLM's blocks for a after a step that ends on token 1280: the state group holds the state
    # there (block 5, index 4); earlier positions are null.
    blocks_a = [[0, 0, 0, 0, 5], list(range(1, 6))]
    sched.update_state_after_alloc("a", blocks_a, 0)
    randomize(buf)
    randomize(attn_buf)
    buf[:page].zero_()  # the null block of layer 0
    want_state = [v[5].clone() for v in state_views]
    want_attn = [t[1:6].clone() for t in attn]
    worker.save(sched.build([(a, 0, 5 * CHUNK, blocks_a)]))
    until(lambda: worker.get_finished() is not None and not worker.has_pending())
    assert worker.stats["stored_chunks"] == 2 + 5, "one state in each state registration, five attention chunks"
    randomize(buf)
    buf[:page].zero_()
    for t in attn:
        t.zero_()

    b = SchedRequest("b", toks, len(toks))
    hit = until(lambda: (lambda r: r if r[0] is not None else None)(sched.get_num_new_matched_tokens(b, 0)))
    assert hit == (5 * CHUNK, True)
    blocks_b = [[0, 0, 0, 0, 11], list(range(8, 13))]
    sched.update_state_after_alloc("b", blocks_b, 5 * CHUNK)
    worker.start_load(sched.build([]))
    assert until(lambda: worker.get_finished()[1]) == {"b"}
    assert worker.load_errors() == set() and worker.failed_loads() == set()
    torch.cuda.synchronize()
    for v, want in zip(state_views, want_state):
        # As bytes: random bits read as floats hold NaNs, which compare unequal to themselves.
        assert torch.equal(v[11].contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)), (
            "the state after token 1280 is where vLLM resumes from")
    for t, want in zip(attn, want_attn):
        assert torch.equal(t[8:13].contiguous().view(torch.uint8), want.contiguous().view(torch.uint8))
    assert not buf[:page].any(), "the null block was not written"
    assert k.metric("kvd_copy_errors_total") == 0


def process_gpu_mib(pid: int) -> int | None:
    """What nvidia-smi attributes to `pid` (None where it cannot say, as in some containers)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    rows = [line.split(",") for line in out.strip().splitlines() if line.strip()]
    mine = [int(m) for p, m in rows if int(p) == pid]
    return sum(mine) if mine else None


def test_client_uses_no_gpu_memory_beyond_its_cache(kvd_factory):
    require_gpus(1)
    k = kvd_factory("--l1-size-gb", "4", "--chunk-tokens", str(CHUNK))
    buf, views = allocate_kv("BLNHC", 32, 256, 8, BLOCK, 256, torch.bfloat16)
    torch.cuda.synchronize()
    free_before, _ = torch.cuda.mem_get_info()
    reserved_before = torch.cuda.memory_reserved()
    mine_before = process_gpu_mib(os.getpid())
    schedule_round_trip(k.url, views, buf, fp=77)
    torch.cuda.synchronize()
    free_after, _ = torch.cuda.mem_get_info()
    mine_after = process_gpu_mib(os.getpid())
    # What was taken outside PyTorch's allocator device-wide (the test's own tensors go through
    # it). This also counts what kvd's process took for this client (streams, events), so it
    # bounds the client's share from above; nvidia-smi's per-process figure, where it has one,
    # separates the two.
    outside = (free_before - free_after) - (torch.cuda.memory_reserved() - reserved_before)
    print(f"client GPU memory taken outside its KV cache and PyTorch: {outside / 2**20:.1f} MiB device-wide; "
          f"this process per nvidia-smi: {mine_before} -> {mine_after} MiB, "
          f"PyTorch reserved +{(torch.cuda.memory_reserved() - reserved_before) / 2**20:.0f} MiB")
    assert outside <= 16 << 20


def _rank_main(rank: int, url: str, barrier, q) -> None:
    torch.cuda.set_device(rank)
    buf, views = allocate_kv("BLNHC", 32, 256, 4, BLOCK, 256, torch.bfloat16)
    worker, sched, toks, blocks_b, expected = schedule_round_trip(url, views, buf, fp=0x7B2, shard=rank, shards=(0, 1), seed=5)
    # A TP2 lookup hits only once both ranks have stored their shard.
    barrier.wait(60)
    randomize(buf)
    b = SchedRequest(f"b{rank}", toks, len(toks))
    hit, is_async = until(lambda: (lambda r: r if r[0] is not None else None)(sched.get_num_new_matched_tokens(b, 0)))
    sched.update_state_after_alloc(b.req_id, [blocks_b], hit)
    worker.start_load(sched.build([]))
    if is_async:  # one group: synchronous, start_load ordered the stream after kvd's copy
        until(lambda: worker.get_finished()[1])
    torch.cuda.synchronize()
    ok = hit > 0 and torch.equal(block_data(views, blocks_b[: hit // BLOCK]), expected[: hit // BLOCK])
    q.put((rank, hit, ok, sorted(worker.load_errors())))


def test_tp2_two_ranks_on_two_gpus_share_one_kvd(kvd_factory):
    require_gpus(2)
    import torch.multiprocessing as mp

    k = kvd_factory("--l1-size-gb", "4", "--chunk-tokens", str(CHUNK))
    ctx = mp.get_context("spawn")
    q, barrier = ctx.Queue(), ctx.Barrier(2)
    procs = [ctx.Process(target=_rank_main, args=(r, k.url, barrier, q)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(q.get(timeout=180) for _ in range(2))
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert [r[0] for r in results] == [0, 1]
    assert all(hit == 4 * CHUNK and ok and not errors for _, hit, ok, errors in results), results
    log = "".join(k.log)
    assert 'thread="kvd-gpu0"' in log and 'thread="kvd-gpu1"' in log, "one copy thread per GPU"


VMM_CHILD = r"""
import os, sys, time, torch
sys.path.insert(0, os.path.dirname(sys.argv[1]))
from test_gpu import allocate_kv, schedule_round_trip, randomize, block_data, until, SchedRequest, CHUNK, BLOCK
buf, views = allocate_kv("BLNHC", 32, int(sys.argv[3]), 8, 16, 256, torch.bfloat16)
worker, sched, toks, blocks_b, expected = schedule_round_trip(sys.argv[2], views, buf, fp=0x5EC, tokens=2100)
print("SHARED_BY", worker.registrations[0].shared_by, "PID", os.getpid(), flush=True)
randomize(buf)
b = SchedRequest("b", toks, len(toks))
hit, is_async = until(lambda: (lambda r: r if r[0] is not None else None)(sched.get_num_new_matched_tokens(b, 0)))
sched.update_state_after_alloc("b", [blocks_b], hit)
worker.start_load(sched.build([]))
if is_async:
    until(lambda: worker.get_finished()[1])
torch.cuda.synchronize()
print("EQUAL", torch.equal(block_data(views, blocks_b[: hit // BLOCK]), expected[: hit // BLOCK]), hit, flush=True)
if len(sys.argv) > 4:
    print("HOLDING", flush=True)
    time.sleep(3600)
"""


def _vmm_child(url: str, blocks: int, hold: bool = False, prefix: tuple[str, ...] = ()):
    env = dict(os.environ, PYTORCH_ALLOC_CONF="expandable_segments:True", PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    args = [*prefix, sys.executable, "-c", VMM_CHILD, __file__, url, str(blocks)] + (["hold"] if hold else [])
    return subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_expandable_segments_cache_of_many_chunks_round_trips_by_descriptor(kvd_factory):
    require_gpus(1)
    k = kvd_factory("--l1-size-gb", "4", "--chunk-tokens", str(CHUNK))
    # 4096 blocks × 2 MiB = 8 GiB of expandable-segment memory: hundreds of 20 MiB chunks.
    p = _vmm_child(k.url, 4096)
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0, out
    assert "SHARED_BY vmm" in out, out
    assert "EQUAL True" in out, out
    assert k.metric("kvd_registration_refusals_total") == 0


def test_a_client_sharing_only_socket_paths_with_kvd_shares_vmm_memory(kvd_factory, tmp_path):
    """As in separate containers: the client runs in its own PID and network namespaces, so it
    reaches kvd only through two socket paths (the ZMQ ipc:// endpoint and the descriptor
    socket), and kvd could not use its PID (pidfd_getfd) if it tried."""
    require_gpus(1)
    unshare = shutil.which("unshare")
    if unshare is None or os.geteuid() != 0:
        pytest.skip("needs root and unshare(1) to put the client in its own namespaces")
    ipc, fd = tmp_path / "kvd.ipc", tmp_path / "kvd.fd.sock"
    k = kvd_factory("--l1-size-gb", "4", "--chunk-tokens", str(CHUNK), "--ipc", str(ipc), fd_socket=fd)
    p = _vmm_child(f"ipc://{ipc}", 1024, prefix=(unshare, "--pid", "--net", "--fork", "--mount-proc"))
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0, out
    # PID 1: the client is the first process of its own PID namespace.
    assert "SHARED_BY vmm PID 1" in out, out
    assert "EQUAL True" in out, out
    assert k.metric("kvd_registration_refusals_total") == 0


def test_a_killed_expandable_segments_client_gives_its_memory_back_within_10s(kvd_factory):
    require_gpus(1)
    k = kvd_factory("--l1-size-gb", "4", "--chunk-tokens", str(CHUNK))
    torch.cuda.init()
    free0, _ = torch.cuda.mem_get_info()
    p = _vmm_child(k.url, 2048, hold=True)
    for line in p.stdout:
        if line.startswith("HOLDING"):
            break
    free1, _ = torch.cuda.mem_get_info()
    assert free0 - free1 >= 4 << 30, "the child holds its 4 GiB cache"
    p.send_signal(signal.SIGKILL)
    p.wait()
    t = time.monotonic()
    while True:
        free, _ = torch.cuda.mem_get_info()
        if free + (256 << 20) >= free0:
            print(f"GPU memory back to baseline {time.monotonic() - t:.2f} s after SIGKILL")
            break
        assert time.monotonic() - t < 10, f"{(free0 - free) >> 20} MiB still held after 10 s"
        time.sleep(0.05)
