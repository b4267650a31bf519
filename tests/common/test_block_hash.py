"""Block hashes: the documented scheme exactly, chained, deterministic across processes."""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys

import pytest

from common.block_hash import SCHEME, BlockHasher, block_hashes


def by_the_docstring(tokens: list[int], block_size: int, salt: bytes = b"") -> list[int]:
    """The scheme re-derived from its description, one block at a time."""
    parent = hashlib.blake2b(salt, digest_size=8).digest() if salt else bytes(8)
    out = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        data = parent + struct.pack(f"<{block_size}I", *tokens[start : start + block_size])
        parent = hashlib.blake2b(data, digest_size=8).digest()
        out.append(struct.unpack("<Q", parent)[0])
    return out


TOKENS = [(i * 7919) % 151_000 for i in range(70)]


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("salt", [b"", b"model-a"])
def test_hashes_follow_the_documented_scheme(block_size, salt):
    got = block_hashes(TOKENS, block_size, salt)
    assert got == by_the_docstring(TOKENS, block_size, salt)
    assert len(got) == len(TOKENS) // block_size
    assert all(0 <= h < 2**64 for h in got)


def test_pinned_values_so_the_scheme_cannot_drift():
    # Replicas and routers of different builds must agree: a change here is a new SCHEME.
    assert SCHEME == "blake2b64-v1"
    assert block_hashes([1, 2, 3, 4], 4) == [0x09222804E3E39BA2]
    assert block_hashes(list(range(32)), 16, b"salt") == [0xCB62C89A249E1C3C, 0xA9C87647898E4036]


def test_a_blocks_hash_names_its_whole_prefix():
    a = block_hashes(TOKENS, 4)
    changed = list(TOKENS)
    changed[9] += 1  # inside block 2
    b = block_hashes(changed, 4)
    assert a[:2] == b[:2]
    assert all(x != y for x, y in zip(a[2:], b[2:]))


def test_partial_blocks_have_no_hash_and_chains_continue_with_parent():
    assert block_hashes(TOKENS[:3], 4) == []
    assert block_hashes(TOKENS[:11], 4) == block_hashes(TOKENS[:8], 4)
    whole = block_hashes(TOKENS, 4)
    assert block_hashes(TOKENS[20:], 4, parent=whole[4]) == whole[5:]
    salted = block_hashes(TOKENS, 4, b"s")
    assert block_hashes(TOKENS[8:], 4, b"s", parent=salted[1]) == salted[2:]


def test_salt_and_block_size_change_every_hash():
    plain = block_hashes(TOKENS, 4)
    assert not set(plain) & set(block_hashes(TOKENS, 4, b"tenant"))
    assert not set(plain) & set(block_hashes(TOKENS, 8))


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="block_size"):
        block_hashes(TOKENS, 0)
    with pytest.raises(ValueError, match="token ids"):
        block_hashes([1, -2, 3, 4], 4)
    with pytest.raises(ValueError, match="token ids"):
        block_hashes([1, 2**32, 3, 4], 4)
    with pytest.raises(ValueError, match="scheme"):
        BlockHasher(16, scheme="md5-v0")


def test_hasher_is_what_a_router_rebuilds_from_a_registration():
    engine_side = BlockHasher(16, b"x")
    router_side = BlockHasher(engine_side.block_size, engine_side.salt, engine_side.scheme)
    assert router_side == engine_side
    assert router_side.hashes(TOKENS) == block_hashes(TOKENS, 16, b"x")


def test_other_processes_and_hash_seeds_agree():
    code = "from common.block_hash import block_hashes; print(block_hashes(list(range(64)), 16, b'k'))"
    outs = set()
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True,
                             cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        outs.add(run.stdout.strip())
    assert outs == {str(block_hashes(list(range(64)), 16, b"k"))}
