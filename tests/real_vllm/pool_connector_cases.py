"""Cases for `PoolConnector` without an engine, run by the real-vLLM venv's python
(`test_pool_connector.py`): it imports vLLM, which the project's venv does not have.

    .venv-vllm/bin/python tests/real_vllm/pool_connector_cases.py POOL_DIR

The vLLM config, request and block objects are stand-ins with the attributes the
connector reads (the seam this file owns); the pool is a real `kvpool.Pool`.
Prints one line per case passed; exits non-zero on the first failure.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm_pool.connector import PoolConnector, fingerprint

from kvpool import Pool

BLOCK = 32
ROOT = Path(sys.argv[1])


def config(algo: str = "sha256_cbor", caching: bool = True, **extra: Any) -> Any:
    model = SimpleNamespace(
        model="tiny", revision=None, dtype="torch.float32",
        get_num_layers=lambda par: 2, get_num_kv_heads=lambda par: 1, get_head_size=lambda: 32,
    )  # fmt: skip
    return SimpleNamespace(
        model_config=model,
        cache_config=SimpleNamespace(
            block_size=BLOCK,
            cache_dtype="auto",
            enable_prefix_caching=caching,
            prefix_caching_hash_algo=algo,
        ),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
        kv_transfer_config=SimpleNamespace(
            kv_connector_extra_config={"pool_dir": str(ROOT), **extra}, is_kv_producer=True
        ),
    )


def groups(n: int = 1) -> Any:
    return SimpleNamespace(kv_cache_groups=[object()] * n)


def refused(match: str, cfg: Any, kv: Any = None) -> None:
    before = set(ROOT.rglob("*"))
    try:
        PoolConnector(cfg, KVConnectorRole.SCHEDULER, kv or groups())
    except ValueError as err:
        assert match in str(err), (match, str(err))
        assert set(ROOT.rglob("*")) == before, "a refused config changed the pool directory"
        print(f"refused: {err}")
        return
    raise AssertionError(f"accepted a config that should fail with {match!r}")


def request(req_id: str, n_tokens: int) -> Any:
    hashes = [
        hashlib.sha256(f"{req_id[:1]}{i}".encode()).digest() for i in range(n_tokens // BLOCK)
    ]
    return SimpleNamespace(request_id=req_id, num_tokens=n_tokens, block_hashes=hashes)


def blocks(ids: list[int]) -> Any:
    return SimpleNamespace(get_block_ids=lambda: (ids,))


def main() -> None:
    refused("sha256", config(algo="xxhash"))
    refused("--enable-prefix-caching", config(caching=False))
    refused("unknown kv_connector_extra_config ['capacity']", config(capacity=1))
    refused("capacity_gb must be > 0", config(capacity_gb=-1))
    refused("capacity_gb must be > 0", config(capacity_gb="1"))
    refused("capacity_gb must be > 0", config(capacity_gb=True))
    refused("one KV cache group", config(), groups(2))

    conn = PoolConnector(config(capacity_gb=0.001), KVConnectorRole.SCHEDULER, groups())
    pool = Pool(ROOT / fingerprint(config()), 2**20)
    assert conn.pool.root == pool.root
    req = request("a", 5 * BLOCK)  # 5 full blocks: at most 4 may come from the pool
    for h in req.block_hashes:
        pool.put(h.hex(), b"x" * 64)
    n, is_async = conn.get_num_new_matched_tokens(req, 0)
    assert (n, is_async) == (4 * BLOCK, False), n
    assert pool.active_leases() == 4
    # asked again (the request was not scheduled): leased afresh, not twice
    assert conn.get_num_new_matched_tokens(req, 0)[0] == 4 * BLOCK
    assert pool.active_leases() == 4
    print("counted 4 of 5 blocks (never the last token's), 4 leases")

    # the scheduler takes 2 of the 4 offered
    conn.update_state_after_alloc(req, blocks([10, 11, 12, 13, 14]), 2 * BLOCK)
    assert pool.active_leases() == 2  # the 2 the scheduler did not take are released
    meta = conn.build_connector_meta(
        SimpleNamespace(
            scheduled_new_reqs=[],
            num_scheduled_tokens={},
            scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
        )
    )
    assert [(x.block_id, x.key) for x in meta.loads] == [
        (10, req.block_hashes[0].hex()), (11, req.block_hashes[1].hex())
    ], meta.loads  # fmt: skip
    assert conn.stats["loaded_tokens"] == 2 * BLOCK
    print("took 2: loads into pages 10, 11; 2 leases released")

    gap = request("b", 4 * BLOCK)
    for i in (0, 2):
        pool.put(gap.block_hashes[i].hex(), b"y" * 64)
    assert conn.get_num_new_matched_tokens(gap, 0)[0] == BLOCK  # stops at the hole
    conn.request_finished(gap, [])  # finished unscheduled: its lease is released
    assert pool.active_leases() == 2
    print("a missing block ends the match; a finished request's leases are released")

    # saves: each block that becomes full carries its parent's hash and its tokens
    tokens = list(range(1000, 1000 + 3 * BLOCK + 5))
    new = SimpleNamespace(
        request_id="c", num_tokens=len(tokens), all_token_ids=tokens,
        block_hashes=[hashlib.sha256(f"c{i}".encode()).digest() for i in range(3)],
        lora_request=None, mm_features=None, prompt_embeds=None, cache_salt="salt",
    )  # fmt: skip
    conn.on_new_request(new)
    manager = SimpleNamespace(get_block_ids=lambda req_id: ([7, 8, 9, 10],), block_pool=None)
    conn.bind_kv_cache_manager(manager)
    meta = conn.build_connector_meta(
        SimpleNamespace(
            scheduled_new_reqs=[SimpleNamespace(req_id="c", num_computed_tokens=0)],
            num_scheduled_tokens={"c": len(tokens)},
            scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
        )
    )
    saved = [(x.block_id, x.key, json.loads(x.meta or b"null")) for x in meta.saves]
    assert [(b, k) for b, k, _ in saved] == [
        (7 + i, new.block_hashes[i].hex()) for i in range(3)
    ], saved  # fmt: skip
    for i, (_, _, m) in enumerate(saved):
        assert m["tokens"] == tokens[i * BLOCK : (i + 1) * BLOCK], m
        assert m["parent"] == (new.block_hashes[i - 1].hex() if i else None), m
        assert m["extra"] is (i == 0), m  # the salt is hashed into the first block only
    print("3 full blocks saved, each with its parent's hash and tokens; the salted one marked")


if __name__ == "__main__":
    main()
