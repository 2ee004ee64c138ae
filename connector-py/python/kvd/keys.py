"""Keys: a stored chunk is found by (fingerprint, salt, shard, chained chunk hash).

Chunk hashes are computed from token ids by ``kvd._native.chunk_hashes`` — deterministic,
independent of PYTHONHASHSEED and the process — with multimodal inputs folded into every chunk
they overlap and LoRA adapters into the chain's seed, so a different image or adapter is a miss,
never a wrong hit.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Sequence

from kvd import _native

KEY_VERSION = "kvd-keys-1"


def _digest(*parts: object, size: int) -> int:
    h = hashlib.blake2b(digest_size=size)
    for p in parts:
        b = p if isinstance(p, bytes) else repr(p).encode()
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return int.from_bytes(h.digest(), "little")


def fingerprint(*parts: object) -> int:
    """A 64-bit fingerprint of the model and KV layout facts given, stable across processes."""
    return _digest(KEY_VERSION, *parts, size=8)


def salt_hash(cache_salt: str | None) -> int:
    """The key component for a request's ``cache_salt`` (0 for none)."""
    return 0 if not cache_salt else _digest("salt", cache_salt, size=8) or 1


@dataclass(frozen=True)
class Span:
    """Token positions ``[start, start + length)`` that carry an identity (a multimodal input)."""

    start: int
    length: int
    identity: bytes


@dataclass
class ChunkHasher:
    """Chained chunk hashes of one request's tokens, extended as tokens are added."""

    chunk_tokens: int
    spans: Sequence[Span] = ()
    namespace: object = None
    _hashes: list[int] = field(default_factory=list)

    def seed(self) -> int:
        return 0 if self.namespace is None else _digest("ns", self.namespace, size=16)

    def hashes(self, tokens: Sequence[int], n_chunks: int) -> list[int]:
        """Hashes of the first ``n_chunks`` chunks of ``tokens`` (which must hold them)."""
        if n_chunks > len(self._hashes):
            # Chaining means recomputing from the start; requests grow rarely enough that this
            # stays cheap (a few µs per chunk in native code).
            extras = [(s.start, s.length, s.identity) for s in self.spans]
            # (A slice of vLLM's token list is a list already: no second copy.)
            self._hashes = _native.chunk_hashes(
                tokens[: n_chunks * self.chunk_tokens], self.chunk_tokens, extras, self.seed()
            )
        return self._hashes[:n_chunks]

    def known(self, n_chunks: int) -> list[int]:
        """The first ``n_chunks`` hashes, already computed by an earlier ``hashes`` call."""
        if n_chunks > len(self._hashes):
            raise RuntimeError(f"chunk hashes {len(self._hashes)}..{n_chunks} were never computed")
        return self._hashes[:n_chunks]

    def index(self, chunk_hash: int) -> int | None:
        """The position of a chunk among those already computed, or None."""
        try:
            return self._hashes.index(chunk_hash)
        except ValueError:
            return None
