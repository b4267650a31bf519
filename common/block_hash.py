"""Content addresses of full KV-cache blocks, shared by replicas and the router.

Scheme "blake2b64-v1" (SCHEME):

- token_ids are cut into blocks of block_size tokens; only full blocks are
  hashed (a trailing partial block has no address).
- Each token is packed as an unsigned 32-bit little-endian integer.
- Block i's hash is the 8-byte BLAKE2b digest (hashlib.blake2b,
  digest_size=8, no key, no salt parameter) of
      parent(i) as 8 bytes little-endian  ||  the block's packed tokens
  read back as an unsigned little-endian 64-bit integer.
- parent(0) is `parent` when given (the hash of the block just before
  token_ids[0]); otherwise the root: 8 zero bytes when salt is empty, else the
  first 8 bytes of BLAKE2b(salt, digest_size=8). parent(i) is block i-1's hash.

So a block's hash names its tokens and every token before it (and the salt):
two sequences share a block's hash only if they share the whole prefix up to
its end. The salt carries anything else that would change the KV (a model
identity, a tenant); a replica's engine uses the empty salt today, since its
cache only ever holds one model. Pure and deterministic across processes and
machines: no Python hash(), no randomisation.
"""

from __future__ import annotations

import array
import struct
import sys
from dataclasses import dataclass
from hashlib import blake2b

SCHEME = "blake2b64-v1"
_ROOT = bytes(8)
_MAX_TOKEN = 2**32 - 1


def _root(salt: bytes) -> bytes:
    return blake2b(salt, digest_size=8).digest() if salt else _ROOT


def _packed(token_ids) -> bytes:
    try:
        packed = array.array("I", token_ids)
    except (OverflowError, TypeError) as e:
        raise ValueError(f"token ids must be integers in [0, {_MAX_TOKEN}]: {e}") from None
    if packed.itemsize != 4:  # no platform Python runs on today, but the scheme is fixed at 4 bytes
        return struct.pack(f"<{len(packed)}I", *packed)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def block_hashes(token_ids, block_size: int, salt: bytes = b"", parent: int | None = None) -> list[int]:
    """The hash of each full block of token_ids, in order (len(token_ids) // block_size of them).

    parent continues a chain: pass the hash of the block that precedes
    token_ids[0] (token_ids must then start on a block boundary of the whole
    sequence), and the result equals the tail of hashing the whole sequence.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    num_blocks = len(token_ids) // block_size
    if num_blocks == 0:
        return []
    buf = _packed(token_ids[: num_blocks * block_size])
    prev = _root(salt) if parent is None else parent.to_bytes(8, "little")
    step = 4 * block_size
    digests = []
    append = digests.append
    for offset in range(0, num_blocks * step, step):
        prev = blake2b(prev + buf[offset : offset + step], digest_size=8).digest()
        append(prev)
    return list(struct.unpack(f"<{num_blocks}Q", b"".join(digests)))


@dataclass(frozen=True)
class BlockHasher:
    """What a replica tells the router so that both address blocks alike:
    the scheme's name, the block size and the salt."""

    block_size: int
    salt: bytes = b""
    scheme: str = SCHEME

    def __post_init__(self) -> None:
        if self.scheme != SCHEME:
            raise ValueError(f"unknown block hash scheme {self.scheme!r}; this build knows {SCHEME!r}")
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")

    def hashes(self, token_ids, parent: int | None = None) -> list[int]:
        return block_hashes(token_ids, self.block_size, self.salt, parent)
