"""Checks an install without a GPU: ``python -m kvd.check --url tcp://HOST:PORT``.

A host-memory round trip through a running kvd, the path every vLLM worker takes but with a
``kvd.HostBuffer`` (a memfd kvd maps over its fd socket) in place of GPU memory: connect, register
a small KV cache laid out as vLLM lays out its own, store one chunk from some blocks, look it up,
retrieve it into other blocks and compare the bytes. Prints one line and exits 0 when the bytes
come back equal; otherwise prints what failed and the likely fix, and exits 1.

The chunk is keyed under a random model fingerprint, so it never meets a real model's chunks;
it stays in kvd's pool until evicted, like any other.
"""

from __future__ import annotations

import argparse
import secrets
import sys
import time
from typing import Sequence, cast

from kvd import _native
from kvd.layout import TensorLike, describe
from kvd.testing import blocks_bytes, vllm_cache

#: A small cache: 2 layers, 2 KV heads of 64 bf16 values; blocks of 16 tokens where kvd's chunk
#: is whole 16-token blocks, else one block per chunk.
LAYERS, HEADS, CONTENT, BLOCK_TOKENS = 2, 2, 64, 16


class CheckFailed(Exception):
    """A step of the round trip failed; the message says which and what to look at."""


def round_trip(url: str, timeout_s: float, fd_socket: str | None) -> str:
    """Runs the round trip against the kvd at ``url``; returns the line to print on success."""
    start = time.monotonic()
    try:
        client = _native.Client(url, "kvd.check", role="worker", connect_timeout=timeout_s,
                                request_timeout=timeout_s, fd_socket=fd_socket)
    except _native.ConnectionLost as e:
        raise CheckFailed(f"{e}: is `kvd serve` running there, with that --host and --port "
                          "(or --ipc path)?") from e
    except (ValueError, _native.KvdError) as e:
        raise CheckFailed(f"cannot connect to kvd at {url}: {e}") from e
    hello = client.server
    chunk_tokens = hello["chunk_tokens"]
    block_tokens = BLOCK_TOKENS if chunk_tokens % BLOCK_TOKENS == 0 else chunk_tokens
    per_chunk = chunk_tokens // block_tokens
    buf, views = vllm_cache("BLNHC", LAYERS, 2 * per_chunk, HEADS, block_tokens, CONTENT)
    buf.fill_random(secrets.randbits(32))
    # HostView has TensorLike's members; its `shape` is a tuple, which mypy will not take for
    # the protocol's settable Sequence.
    spec = describe(cast(Sequence[TensorLike], views))
    fingerprint, key = secrets.randbits(63), secrets.randbits(63)
    src, dst = list(range(per_chunk)), list(range(per_chunk, 2 * per_chunk))
    try:
        reg = client.register(fingerprint, 0, "host", spec.layer_ptrs, spec.layout)
    except (ValueError, _native.KvdError) as e:
        raise CheckFailed(f"kvd at {url} refused a host-memory registration: {e}; the memory goes "
                          f"over kvd's fd socket {fd_socket or hello['fd_socket']!r}, which this "
                          "process must be able to connect to (--fd-socket names it where the "
                          "path differs here)") from e
    try:
        codes, _ = client.store(reg.region, 0, [(key, src)]).result(timeout_s)
        if codes[0] not in (_native.STORED, _native.ALREADY_STORED):
            raise CheckFailed(f"kvd at {url} did not store the chunk (outcome {codes[0]}: "
                              "refused, pool full of pinned pages); see kvd_store_refusals_total")
        hit, pin = client.lookup(fingerprint, 0, [0], [key], pin=True).result(timeout_s)
        if hit != 1:
            raise CheckFailed(f"kvd at {url} stored the chunk but a lookup right after found "
                              f"{hit} chunks of 1")
        codes, _ = client.retrieve(reg.region, 0, [(key, dst)], pin_id=pin).result(timeout_s)
        if codes[0] != _native.LOADED:
            raise CheckFailed(f"kvd at {url} found the chunk but did not retrieve it (outcome "
                              f"{codes[0]})")
        if blocks_bytes(views, dst) != blocks_bytes(views, src):
            raise CheckFailed(f"kvd at {url} retrieved the chunk but its bytes differ from "
                              "those stored")
    except _native.KvdError as e:
        raise CheckFailed(f"kvd at {url} failed the round trip: {type(e).__name__}: {e}") from e
    finally:
        try:
            client.unregister(reg.region)
        except _native.KvdError:
            pass  # the session's end releases it too
    ms = (time.monotonic() - start) * 1e3
    kib = spec.block_bytes * LAYERS * per_chunk / 1024
    return (f"kvd.check: ok: {url} (kvd {hello['server_version']}, protocol "
            f"{hello['protocol_version']}): one {chunk_tokens}-token chunk ({kib:g} KiB) stored "
            f"from host memory and retrieved into other blocks, bytes equal, in {ms:.1f} ms")


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; returns the exit status."""
    p = argparse.ArgumentParser(prog="python -m kvd.check", description="Checks an install without a GPU: a host-memory round trip through a running kvd.")
    p.add_argument("--url", default="tcp://127.0.0.1:5555",
                   help="kvd's ZMQ endpoint, tcp://HOST:PORT or ipc://PATH (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=5.0, metavar="S",
                   help="seconds to connect and for each reply (default: %(default)s)")
    p.add_argument("--fd-socket", metavar="PATH",
                   help="kvd's fd socket as this process sees it (default: the path kvd announces)")
    args = p.parse_args(argv)
    if not args.url.startswith(("tcp://", "ipc://")):
        p.error(f"--url {args.url}: expected tcp://HOST:PORT or ipc://PATH")
    try:
        print(round_trip(args.url, args.timeout, args.fd_socket))
    except CheckFailed as e:
        print(f"kvd.check: FAILED: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
