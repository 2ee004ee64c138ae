"""The native module against a real kvd: keys, client, errors, and libzmq interoperability."""

from __future__ import annotations

import ast
import struct
import subprocess
import sys
from pathlib import Path

import pytest

import kvd
from kvd import _native


def test_import_pulls_in_neither_vllm_nor_torch():
    out = subprocess.run(
        [sys.executable, "-c", "import sys, kvd; print('vllm' in sys.modules, 'torch' in sys.modules)"],
        capture_output=True, text=True, check=True,
    )
    assert out.stdout.split() == ["False", "False"]


def test_kvd_vllm_without_vllm_says_what_to_install():
    code = "import kvd.vllm"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    try:
        import vllm  # noqa: F401
    except ImportError:
        assert out.returncode != 0
        assert "pip install" in out.stderr and "vllm" in out.stderr


def test_chunk_hashes_are_deterministic_across_processes_and_seeds():
    tokens = list(range(1000))
    here = kvd.chunk_hashes(tokens, 256)
    code = "import kvd; print(kvd.chunk_hashes(list(range(1000)), 256))"
    for seed in ("0", "12345"):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={"PYTHONHASHSEED": seed, "PATH": "/usr/bin:/bin"})
        assert eval(out.stdout) == here
    assert len(here) == 3
    # Chained: a change in the first chunk changes every key; extras change overlapped chunks.
    other = kvd.chunk_hashes([7] + tokens[1:], 256)
    assert all(a != b for a, b in zip(here, other))
    img = kvd.chunk_hashes(tokens, 256, [(300, 100, b"image-a")])
    img_b = kvd.chunk_hashes(tokens, 256, [(300, 100, b"image-b")])
    assert img[0] == here[0] and img[1] != here[1] and img[1] != img_b[1]


def test_client_round_trips_and_counters(kvd):
    c = _native.Client(kvd.url, "pytest", role="tool")
    assert c.connected()
    assert c.server["chunk_tokens"] == 32
    assert c.server["protocol_version"] == _native.PROTOCOL_VERSION
    assert c.ping() >= 0
    hit, pin = c.lookup(1, 0, [0], [1, 2, 3], pin=True).result(5)
    assert (hit, pin) == (0, 0)
    assert c.stats()["sessions"] >= 1


def stub_typed_dicts() -> dict[str, dict[str, str]]:
    """The TypedDicts of kvd/_native.pyi: field name to annotation, per class."""
    tree = ast.parse(Path(kvd.__file__).with_name("_native.pyi").read_text())
    return {
        node.name: {f.target.id: ast.unparse(f.annotation) for f in node.body if isinstance(f, ast.AnnAssign) and isinstance(f.target, ast.Name)}
        for node in tree.body
        if isinstance(node, ast.ClassDef) and any(ast.unparse(b) == "TypedDict" for b in node.bases)
    }


def test_results_have_the_types_the_stubs_promise(kvd):
    """What stubtest cannot see: the types of what native calls return."""
    from kvd.layout import describe
    from kvd.testing import vllm_cache

    typed = stub_typed_dicts()
    c = _native.Client(kvd.url, "pytest", role="worker")
    for got, stub in ((c.server, typed["_ServerHello"]), (c.stats(), typed["_Stats"])):
        assert {k: type(v).__name__ for k, v in got.items()} == stub
    buf, views = vllm_cache("BLNHC", 2, 8, 2, 16, 64)
    spec = describe(views)
    reg = c.register(1, 0, "host", spec.layer_ptrs, spec.layout)
    # Pending[tuple[bytes, int | None]]: one outcome code per chunk; no event for host memory.
    assert c.store(reg.region, 0, [(5, [0, 1]), (6, [2, 3])]).result(5) == (bytes([_native.STORED] * 2), None)
    # Pending[tuple[int, int]]
    hit, pin = c.lookup(1, 0, [0], [5, 6], pin=True).result(5)
    assert type(hit) is int and type(pin) is int and hit == 2 and pin != 0
    assert c.retrieve(reg.region, 0, [(5, [4, 5]), (7, [6, 7])], pin_id=pin).result(5) == (
        bytes([_native.LOADED, _native.MISSING]),
        None,
    )
    # Pending[int]: the chunk pins dropped, here the one this lookup took.
    _, pin = c.lookup(1, 0, [0], [5], pin=True).result(5)
    released = c.release(pin).result(5)
    assert type(released) is int and released == 1


def test_a_copy_past_its_deadline_raises_expired_and_copies_nothing(kvd):
    """``deadline_ns`` is ``time.monotonic_ns()``'s clock: one already passed is refused with
    ``Expired`` (a ``ServerError``), nothing stored; one ahead stores as usual."""
    import time

    from kvd.layout import describe
    from kvd.testing import vllm_cache

    c = _native.Client(kvd.url, "pytest", role="worker")
    buf, views = vllm_cache("BLNHC", 2, 8, 2, 16, 64)
    spec = describe(views)
    reg = c.register(1, 0, "host", spec.layer_ptrs, spec.layout)
    with pytest.raises(_native.Expired, match="nothing was copied"):
        c.store(reg.region, 0, [(5, [0, 1])], deadline_ns=time.monotonic_ns() - 1).result(5)
    assert issubclass(_native.Expired, _native.ServerError)
    assert c.lookup(1, 0, [0], [5], pin=False).result(5)[0] == 0
    ahead = time.monotonic_ns() + 10**10
    assert c.store(reg.region, 0, [(5, [0, 1])], deadline_ns=ahead).result(5) == (bytes([_native.STORED]), None)
    with pytest.raises(_native.Expired):
        c.retrieve(reg.region, 0, [(5, [2, 3])], deadline_ns=time.monotonic_ns() - 1).result(5)
    assert kvd.metric("kvd_copies_expired_total") == 2


def test_layers_that_cannot_be_registered_are_a_value_error_naming_the_fix(kvd):
    from kvd.layout import describe
    from kvd.testing import vllm_cache

    c = _native.Client(kvd.url, "pytest", role="worker")
    buf, views = vllm_cache("BLNHC", 2, 8, 2, 16, 64)
    spec = describe(views)
    with pytest.raises(ValueError, match="not inside a kvd.HostBuffer"):
        c.register(1, 0, "host", [8], spec.layout)
    with pytest.raises(ValueError, match="past the end of its HostBuffer"):
        c.register(1, 0, "host", [buf.ptr + buf.size - 1], spec.layout)
    # Strides past the address space: an error, not an overflow (a panic in a debug build).
    with pytest.raises(ValueError, match="strides in bytes"):
        c.register(1, 0, "host", spec.layer_ptrs, {**spec.layout, "block_stride_bytes": 2**64 - 1})
    assert c.stats()["regions"] == 0
    # The client is still good for a registration that fits.
    assert c.register(1, 0, "host", spec.layer_ptrs, spec.layout).shared_by == "memfd"


def test_unreachable_kvd_is_connection_lost_quickly(tmp_path):
    import time

    t = time.monotonic()
    with pytest.raises(_native.ConnectionLost):
        _native.Client("tcp://127.0.0.1:1", "nobody", connect_timeout=0.5)
    assert time.monotonic() - t < 3


def test_server_errors_are_typed(kvd):
    c = _native.Client(kvd.url, "pytest", role="tool")
    with pytest.raises(_native.ServerError) as e:
        c.store(999, 0, [(1, [0])]).result(5)
    assert e.value.args[0] == "UnknownRegion" and "register again" in e.value.args[1]


def test_outcome_codes_come_from_the_wire_types():
    assert (kvd.STORED, kvd.ALREADY_STORED, kvd.REFUSED_POOL_FULL, kvd.SKIPPED) == (0, 1, 2, 3)
    assert (kvd.LOADED, kvd.MISSING) == (0, 1)
    assert kvd.SKIP == _native.SKIP == 0xFFFFFFFF


def test_not_ready_is_a_server_error_subclass_a_caller_can_retry_on(kvd_factory):
    from kvd.layout import describe
    from kvd.testing import vllm_cache

    # A 3 GiB pool first-touched by one thread takes seconds: kvd answers NotReady meanwhile.
    k = kvd_factory("--chunk-tokens", "32", "--l1-size-gb", "3", "--populate-threads", "1", wait_ready=False)
    c = _native.Client(k.url, "pytest", role="worker")
    buf, views = vllm_cache("BLNHC", 2, 8, 2, 16, 64)
    spec = describe(views)
    with pytest.raises(_native.NotReady) as e:
        c.register(1, 0, "host", spec.layer_ptrs, spec.layout)
    assert isinstance(e.value, _native.ServerError) and not isinstance(e.value, _native.Busy)
    assert e.value.args[0] == "NotReady" and "/healthz" in e.value.args[1]
    assert issubclass(_native.Busy, _native.ServerError)


def test_host_buffer_reads_and_writes():
    b = _native.HostBuffer(4096)
    b.write(100, b"kvd")
    assert b.read(100, 3) == b"kvd"
    b.fill_random(7)
    first = b.read(0, 4096)
    b.fill_random(7)
    assert b.read(0, 4096) == first
    with pytest.raises(_native.KvdError):
        b.read(4000, 200)


def test_libzmq_dealer_and_req_talk_to_kvd(kvd):
    zmq = pytest.importorskip("zmq")
    ctx = zmq.Context()
    for kind in (zmq.DEALER, zmq.REQ):
        s = ctx.socket(kind)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(kvd.url)
        name = b"pyzmq"
        hello = struct.pack("<H", _native.PROTOCOL_VERSION) + struct.pack("<H", len(name)) + name + struct.pack("<I", 1) + bytes([3])
        s.send(b"KV" + bytes([_native.PROTOCOL_VERSION, 1]) + struct.pack("<Q", 41) + hello)
        assert s.poll(5000), "no reply from kvd"
        reply = s.recv()
        assert reply[:2] == b"KV" and reply[3] == 0x81 and struct.unpack("<Q", reply[4:12])[0] == 41
        s.send(b"KV" + bytes([_native.PROTOCOL_VERSION, 8]) + struct.pack("<Q", 42))
        assert s.poll(5000)
        assert s.recv()[3] == 0x88
        # A garbage frame gets an error reply, and the connection keeps working.
        s.send(b"hello?")
        assert s.poll(5000)
        assert s.recv()[3] == 0xFF
        s.close()
    ctx.term()
