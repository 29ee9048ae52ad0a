"""`PoolConnector`: a vLLM V1 KV connector that shares prefix KV between engines through
a `kvpool.Pool` directory (host memory, `/dev/shm` by default).

    --kv-transfer-config '{"kv_connector": "PoolConnector",
                           "kv_connector_module_path": "vllm_pool.connector",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"pool_dir": "/dev/shm/ramjet-kv"}}'

Extra config (all optional): `pool_dir` (default `/dev/shm/ramjet-kv`), `capacity_gb`
(default 4), `durable` (fsync each block; for a disk pool, default false), `stats_path`
(a JSON file the scheduler side rewrites, atomically, whenever its counters change:
`loaded_tokens` and `loaded_blocks` from the pool, `save_blocks` asked of the worker;
default none).

What one pool block is. The block of `block_size` tokens whose vLLM block hash is `h`
(`request.block_hashes[i]`, the chained hash of the prefix caching; the engines must
use a cryptographic `--prefix-caching-hash-algo`, sha256 or sha256_cbor, and the same
`PYTHONHASHSEED` or none) is stored under key `h.hex()` in the pool namespace
`<pool_dir>/<fingerprint>`, where the fingerprint names the model, dtype, KV cache dtype,
block size, layer count, KV heads, head size and the none-hash seed: engines whose KV
differs in any of them never share blocks. The block's bytes are, for each attention
layer in the order of its name, that layer's cache page `kv_cache[layer][block_id]`,
copied as they lie in memory.

Why the page is copied whole (the CPU layout). The CPU attention backend's cache of a
layer is `[num_blocks, num_kv_heads, block_size, 2 * head_size]`, but its kernels view it
as `[num_blocks, num_kv_heads, 2 * block_size, head_size]`: per head, `block_size` rows of
keys, then `block_size` rows of values (`cpu_attn.py`, `forward` and
`do_kv_cache_update`), possibly in an ISA-specific order inside the page. Indexing the
declared shape by token offset (as vLLM's `ExampleConnector` does) therefore mixes keys
and values. The pool stores only full blocks, and a page is the whole of one block, so
copying pages byte for byte is exact whatever the order inside them; both engines run
the same build on the same machine (the fingerprint and the page size are checked).

Scheduler side. `get_num_new_matched_tokens` leases the blocks after the local hit that
the pool holds, in order, and never the block of the last prompt token (vLLM computes
it); a lease keeps eviction off a block until the worker has read it, so every block
counted can be loaded (vLLM runs with `kv_load_failure_policy` "fail" by default: a
load that fails fails its request). `update_state_after_alloc` records where each
block goes and releases leases the scheduler did not take. `build_connector_meta` hands the
worker this step's loads, and its saves: every block that becomes full in this step and
that the pool does not hold yet.

Eviction order. A prefix is usable only from its start, so every block of a request's
chain is stamped from one use (`kvpool.chain_stamp`: the request's last ask, its
deepest block least recent): the blocks the engine holds itself (touched), those it
leases from the pool, and those it computes and publishes in later steps. The pool's
LRU then takes a chain's tail before its start.

Worker side. Loads are synchronous: `start_load_kv` runs before the forward (the
scheduler marks the step `has_sync_kv_loads`), reads each leased block into its page
in every layer and releases the lease; a block that cannot be read is reported by
`get_block_ids_with_load_errors`, and vLLM recomputes it. `wait_for_save` runs after the
forward, when every layer of the step is written, and publishes the saved blocks,
each with its metadata (`block_meta`: parent hash, token ids, extra keys or not), from
which the pool's reporter maps vLLM's block hashes to router keys.
`wait_for_layer_load` and `save_kv_layer` have nothing to do.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.logger import init_logger
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvpool import Lease, Pool, chain_stamp

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = init_logger(__name__)

DEFAULT_POOL_DIR = "/dev/shm/ramjet-kv"
CRYPTO_HASHES = ("sha256", "sha256_cbor")


@dataclass(frozen=True)
class LoadItem:
    """Copy pool block `key` (held by `lease`, None if it could not be leased) into
    page `block_id`."""

    req_id: str
    block_id: int
    key: str
    lease: Lease | None


@dataclass(frozen=True)
class SaveItem:
    """Publish page `block_id` as pool block `key`, with its metadata (`block_meta`)."""

    block_id: int
    key: str
    meta: bytes | None = None
    used_ns: int | None = None
    """The use to stamp it with: its request's use of the chain (`chain_stamp`)."""


def block_meta(request: Request, i: int, block_size: int) -> bytes:
    """What block `i` of `request` holds, published beside it (`kvpool` metadata) so
    that a reporter can name the block in its own keys without reproducing vLLM's
    hash: the parent block's hash (hex; null for a first block), the block's token
    ids, and whether vLLM hashed extra keys into it (a LoRA adapter, multimodal
    inputs, prompt embeddings, or the cache salt of a first block), which tokens
    alone do not name. The reporter checks the hash against parent and tokens
    (`ramjet.sidecar.pool_watch.VllmPoolKeys`)."""
    extra = (
        request.lora_request is not None
        or bool(request.mm_features)
        or request.prompt_embeds is not None
        or (i == 0 and bool(request.cache_salt))
    )
    parent = request.block_hashes[i - 1].hex() if i > 0 else None
    tokens = list(request.all_token_ids[i * block_size : (i + 1) * block_size])
    return json.dumps({"v": 1, "parent": parent, "tokens": tokens, "extra": extra}).encode()


@dataclass
class PoolConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadItem] = field(default_factory=list)
    saves: list[SaveItem] = field(default_factory=list)


def fingerprint(vllm_config: VllmConfig) -> str:
    """The pool namespace: everything that makes two engines' pages of the same tokens
    differ."""
    from vllm.v1.core.kv_cache_utils import get_none_hash_seed

    model, cache, par = (
        vllm_config.model_config,
        vllm_config.cache_config,
        vllm_config.parallel_config,
    )
    spec = {
        "model": str(model.model),
        "revision": model.revision,
        "dtype": str(model.dtype),
        "cache_dtype": str(cache.cache_dtype),
        "block_size": cache.block_size,
        "layers": model.get_num_layers(par),
        "kv_heads": model.get_num_kv_heads(par),
        "head_size": model.get_head_size(),
        "tp": par.tensor_parallel_size,
        "hash": str(cache.prefix_caching_hash_algo),
        "none_hash_seed": get_none_hash_seed(),
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


class PoolConnector(KVConnectorBase_V1):
    _cache_hit_source = CacheHitSource.HOST

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        cache = vllm_config.cache_config
        if not cache.enable_prefix_caching:
            raise ValueError("PoolConnector needs --enable-prefix-caching (it keys blocks by hash)")
        if str(cache.prefix_caching_hash_algo) not in CRYPTO_HASHES:
            raise ValueError(
                "PoolConnector needs --prefix-caching-hash-algo sha256 or sha256_cbor: "
                f"pool keys shared between engines must not collide, got "
                f"{cache.prefix_caching_hash_algo}"
            )
        if len(kv_cache_config.kv_cache_groups) != 1:
            raise ValueError(
                "PoolConnector supports models with one KV cache group (full attention), "
                f"this one has {len(kv_cache_config.kv_cache_groups)}"
            )
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        unknown = set(extra) - {"pool_dir", "capacity_gb", "durable", "stats_path"}
        if unknown:
            raise ValueError(f"PoolConnector: unknown kv_connector_extra_config {sorted(unknown)}")
        capacity_gb = extra.get("capacity_gb", 4)
        if (
            isinstance(capacity_gb, bool)
            or not isinstance(capacity_gb, int | float)
            or capacity_gb <= 0
        ):
            raise ValueError(f"PoolConnector: capacity_gb must be > 0, got {capacity_gb!r}")
        self.block_size = cache.block_size
        self.namespace = fingerprint(vllm_config)
        root = Path(str(extra.get("pool_dir", DEFAULT_POOL_DIR))) / self.namespace
        self.pool = Pool(root, int(capacity_gb * 2**30), durable=bool(extra.get("durable", False)))
        logger.info("PoolConnector (%s): pool %s", role.name, root)
        # scheduler side
        stats_path = extra.get("stats_path")
        self._stats_path = Path(str(stats_path)) if stats_path else None
        self.stats = {"loaded_tokens": 0, "loaded_blocks": 0, "save_blocks": 0}
        self._stats_written: dict[str, int] = {}
        self._requests: dict[str, Request] = {}
        # req_id -> (first block index the pool supplies, the leases on those blocks)
        self._held: dict[str, tuple[int, list[Lease]]] = {}
        # req_id -> when it last asked for its chain: every block of the chain (its own
        # hit, the pool's, the ones it computes) is stamped from this one use
        self._use_ns: dict[str, int] = {}
        self._loads: list[LoadItem] = []
        # worker side
        self._layers: list[torch.Tensor] = []
        self._page_bytes = 0
        self._load_errors: set[int] = set()

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a save that is dropped is a later miss, nothing more

    # -- scheduler side --------------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        self._requests[request.request_id] = request

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        # the blocks are leased here, so the count is what the worker can surely read;
        # a later call for the same request (it was not scheduled) leases afresh
        req_id = request.request_id
        self._release_held(req_id)
        start = num_computed_tokens // self.block_size
        limit = min((request.num_tokens - 1) // self.block_size, len(request.block_hashes))
        # one use of the whole chain, its deepest block least recent (kvpool: eviction
        # takes a chain's tail before its start), the blocks this engine holds itself
        # included: else they age in the pool while the tail is fresh
        now = self._use_ns[req_id] = time.time_ns()
        for i in range(start):
            self.pool.touch(request.block_hashes[i].hex(), used_ns=chain_stamp(now, i))
        leases: list[Lease] = []
        for i in range(start, limit):
            lease = self.pool.lease(request.block_hashes[i].hex(), used_ns=chain_stamp(now, i))
            if lease is None:
                break
            leases.append(lease)
        if leases:
            self._held[req_id] = (start, leases)
        return len(leases) * self.block_size, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        req_id = request.request_id
        start, leases = self._held.pop(req_id, (0, []))
        n = num_external_tokens // self.block_size
        for lease in leases[n:]:  # the scheduler took fewer than were offered
            Pool.release(lease)
        if n <= 0:
            return
        block_ids = blocks.get_block_ids()[0]
        for i, lease in zip(range(start, start + n), leases, strict=False):
            self._loads.append(LoadItem(req_id, block_ids[i], lease.key, lease))
        self.stats["loaded_blocks"] += n
        self.stats["loaded_tokens"] += n * self.block_size

    def _release_held(self, req_id: str) -> None:
        for lease in self._held.pop(req_id, (0, []))[1]:
            Pool.release(lease)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = PoolConnectorMetadata(loads=self._loads)
        self._loads = []
        steps = [(r.req_id, r.num_computed_tokens) for r in scheduler_output.scheduled_new_reqs]
        cached = scheduler_output.scheduled_cached_reqs
        steps += zip(cached.req_ids, cached.num_computed_tokens, strict=True)
        for req_id, before in steps:
            request = self._requests.get(req_id)
            if request is None or self._kv_cache_manager is None:
                continue
            end = before + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            full = min(end // self.block_size, len(request.block_hashes))
            first = before // self.block_size
            if first >= full:
                continue
            block_ids = self._kv_cache_manager.get_block_ids(req_id)[0]
            for i in range(first, full):
                key = request.block_hashes[i].hex()
                if not self.pool.contains(key):
                    info = block_meta(request, i, self.block_size)
                    use = self._use_ns.get(req_id)
                    stamp = None if use is None else chain_stamp(use, i)
                    meta.saves.append(SaveItem(block_ids[i], key, info, stamp))
        self.stats["save_blocks"] += len(meta.saves)
        self._write_stats()
        return meta

    def _write_stats(self) -> None:
        if self._stats_path is None or self.stats == self._stats_written:
            return
        tmp = self._stats_path.with_name(self._stats_path.name + ".tmp")
        try:
            tmp.write_text(json.dumps(self.stats))
            tmp.replace(self._stats_path)
            self._stats_written = dict(self.stats)
        except OSError as err:
            logger.warning("PoolConnector: stats not written to %s: %s", self._stats_path, err)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._release_held(request.request_id)  # leased, never loaded
        self._requests.pop(request.request_id, None)
        self._use_ns.pop(request.request_id, None)
        return False, None

    # -- worker side -----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        layers = [kv_caches[name] for name in sorted(kv_caches)]
        if not layers:
            raise ValueError("PoolConnector: the engine registered no KV cache")
        shapes = {(tuple(t.shape), t.dtype) for t in layers}
        if len(shapes) != 1:
            raise ValueError(f"PoolConnector: layers differ in shape or dtype: {shapes}")
        page = layers[0][0]
        self._layers = layers
        self._page_bytes = page.numel() * page.element_size()
        logger.info(
            "PoolConnector: %d layers of %s %s, %d bytes per pool block",
            len(layers), tuple(layers[0].shape), layers[0].dtype,
            self._page_bytes * len(layers),
        )  # fmt: skip

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, PoolConnectorMetadata)
        if not meta.loads:
            return
        buf = torch.empty(self._page_bytes * len(self._layers), dtype=torch.uint8)
        view = buf.numpy().data
        for item in meta.loads:
            ok = item.lease is not None and Pool.read_lease_into(item.lease, view)
            if item.lease is not None:
                Pool.release(item.lease)
            if not ok:
                self._load_errors.add(item.block_id)
                continue
            for n, layer in enumerate(self._layers):
                src = buf[n * self._page_bytes : (n + 1) * self._page_bytes]
                page = layer[item.block_id]
                page.copy_(src.view(page.dtype).view(page.shape))

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv loaded every layer before the forward

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return  # wait_for_save publishes whole blocks once every layer is written

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, PoolConnectorMetadata)
        for item in meta.saves:
            pages = [layer[item.block_id].reshape(-1).view(torch.uint8) for layer in self._layers]
            try:
                data = torch.cat(pages).numpy().data
                self.pool.put(item.key, data, item.meta, used_ns=item.used_ns)
            except OSError as err:  # a cache: a block not saved is a later miss
                logger.warning("PoolConnector: block %s not saved: %s", item.key[:16], err)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        if errors:
            logger.warning("PoolConnector: %d pool blocks could not be loaded", len(errors))
        return errors
