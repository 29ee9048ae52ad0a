"""The fleet fabric: engines as islands, or engines that share host, SSD and SWA pools.

`islands` (the default) is the model every other module describes: each engine has its
own `TieredCache` (HBM → host → SSD) and its own `SwaPool`.

`shared` is one server whose engines share their host memory and NVMe:

- HBM stays per engine (`FabricCache.hbm`, LRU, the preset's capacity).
- The host and SSD tiers are one `SharedPool` for all engines of the run: a two-tier LRU
  (host → SSD → evicted) whose capacities default to the members' tiers together.
- The SWA pool is one `SwaPool` for all engines (capacity: the members' together by
  default), so a session's SWA state can be resumed on any engine. A state is held
  where it was stored (`Fabric.swa_local`, `Pools.swa_owner`): the engine that stored
  it resumes it as on islands, where an engine's own SWA pool restores free; any other
  member pulls it over the host link.
- Write-through: when an engine computes a request's blocks (first token), the blocks not
  yet in the pool are written to the host pool in the background, through a write queue
  of `write_bytes_per_s`; they become pool hits when the write completes. Without
  write-through (`write_through=False`) the pool is filled only by HBM demotion, as the
  islands' host tier is. SWA state is stored in the shared pool at a request's end; its
  bytes are charged to the same write queue.
- A pull from the pool into an engine (a restore of host or SSD blocks, or of SWA
  state another engine stored) crosses the pool's link. **Contention**: each pool tier has one link of
  `*_bytes_per_s` that serves transfers in arrival order (FIFO) at its full bandwidth;
  a transfer that arrives while others are queued starts when they are done, so n pulls
  issued together finish at 1/n, 2/n, ..., n/n of n times a lone pull's transfer time
  (fair sharing finishes them all at n/n: FIFO has the same throughput and a lower
  mean). The per-transfer latency (`*_latency_s`) is paid once per pull and does not
  occupy the link. A write-through occupies the host link for its bytes as well (at the
  link's bandwidth, reserved when the write is issued), so writes slow reads.

The router's view (`simulations.views.ExactResidency` over a `FabricCache`): an engine's
own HBM as HBM, the pool's blocks as host/SSD matches for every member, and the SWA
match from the shared SWA pool. So the cost model (`ramjet.policy.cost.prompt_work`)
prices "pull from the pool into this engine" with the profile's tier bandwidths, which
the pool links default to; what it cannot see is the link's queue (contention), which
the engine pays when it starts the job.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ramjet.policy.profile import EngineProfile
from ramjet.types import PrefixKey
from simulations.cache import HBM, HOST, SSD, SwaPool

FABRICS = ("islands", "shared")


@dataclass(frozen=True)
class Fabric:
    """How the engines of a run share memory. Sizes in tokens / sequences (None: the
    members' own tiers together), bandwidths in bytes/s, latencies in seconds (None:
    the engine profile's host / ssd tier figures)."""

    kind: str = "islands"
    host_pool_tokens: int | None = None
    ssd_pool_tokens: int | None = None
    swa_pool_sequences: int | None = None
    host_bytes_per_s: float | None = None
    host_latency_s: float | None = None
    ssd_bytes_per_s: float | None = None
    ssd_latency_s: float | None = None
    write_bytes_per_s: float = 12.5e9
    """Write-through bandwidth into the host pool (an **estimate**: a quarter of the
    PCIe 5 x16 link the host tier is priced at)."""
    write_through: bool = True
    swa_local: bool = True
    """A session's SWA state is held where it was stored: resumed on the engine that
    stored it, it is read as on islands (free); another member pulls it over the host
    link. False: every SWA resume pulls it, the storing engine's too."""

    def __post_init__(self) -> None:
        if self.kind not in FABRICS:
            raise ValueError(f"unknown fabric {self.kind!r}; expected one of {', '.join(FABRICS)}")
        for name in ("host_pool_tokens", "ssd_pool_tokens", "swa_pool_sequences"):
            v = getattr(self, name)
            if v is not None and v < 0:
                raise ValueError(f"fabric {name} must be >= 0, got {v}")
        for name in ("host_bytes_per_s", "ssd_bytes_per_s", "write_bytes_per_s"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"fabric {name} must be > 0, got {v}")
        for name in ("host_latency_s", "ssd_latency_s"):
            v = getattr(self, name)
            if v is not None and v < 0:
                raise ValueError(f"fabric {name} must be >= 0, got {v}")

    @property
    def shared(self) -> bool:
        return self.kind == "shared"


ISLANDS = Fabric()


class Link:
    """One pool link: transfers served FIFO at `bytes_per_s`, `latency_s` per transfer
    (not occupying the link). `busy_until`: when the queued transfers are done."""

    __slots__ = ("busy_until", "bytes", "bytes_per_s", "latency_s", "transfers", "waited_s")

    def __init__(self, bytes_per_s: float, latency_s: float) -> None:
        self.bytes_per_s = bytes_per_s
        self.latency_s = latency_s
        self.busy_until = 0.0
        self.bytes = 0.0
        self.transfers = 0
        self.waited_s = 0.0
        """Total time transfers spent queued behind others (the contention)."""

    def occupy(self, now: float, nbytes: float) -> float:
        """Queue `nbytes` on the link; the time its transfer ends (latency excluded)."""
        start = max(now, self.busy_until)
        self.waited_s += start - now
        self.busy_until = start + nbytes / self.bytes_per_s
        self.bytes += nbytes
        self.transfers += 1
        return self.busy_until

    def pull(self, now: float, nbytes: float) -> float:
        """Seconds from `now` until a pull of `nbytes` has arrived (0 for no bytes)."""
        if nbytes <= 0:
            return 0.0
        return self.occupy(now, nbytes) - now + self.latency_s


class SharedPool:
    """The host and SSD tiers shared by every engine of the fabric: key → tier, an LRU per
    tier (most recent first), host overflow demotes to SSD, SSD overflow evicts."""

    __slots__ = ("block", "capacity", "demotions", "evictions", "lru", "where")

    def __init__(self, host_tokens: int, ssd_tokens: int, block_tokens: int) -> None:
        self.block = block_tokens
        self.capacity = [0, max(0, host_tokens // block_tokens), max(0, ssd_tokens // block_tokens)]
        self.lru: list[OrderedDict[PrefixKey, None]] = [OrderedDict(), OrderedDict(), OrderedDict()]
        self.where: dict[PrefixKey, int] = {}
        self.demotions = 0
        self.evictions = 0

    def put(self, keys: Sequence[PrefixKey]) -> None:
        """Make `keys` most recent in the host tier (promoting SSD copies), last key first
        so that a prefix's head stays at least as recent as its tail; then rebalance."""
        where, lru = self.where, self.lru
        host = lru[HOST]
        for k in reversed(keys):
            t = where.get(k)
            if t != HOST:
                if t is not None:
                    del lru[t][k]
                where[k] = HOST
                host[k] = None
            host.move_to_end(k, last=False)
        self._rebalance()

    def refresh(self, keys: Sequence[PrefixKey]) -> None:
        """A use: the pooled ones among `keys` become most recent in their tier."""
        where, lru = self.where, self.lru
        for k in reversed(keys):
            t = where.get(k)
            if t is not None:
                lru[t].move_to_end(k, last=False)

    def _rebalance(self) -> None:
        lru, cap, where = self.lru, self.capacity, self.where
        for tier in (HOST, SSD):
            od = lru[tier]
            while len(od) > cap[tier]:
                k, _ = od.popitem(last=True)
                if tier == SSD:
                    del where[k]
                    self.evictions += 1
                else:
                    where[k] = SSD
                    lru[SSD][k] = None
                    lru[SSD].move_to_end(k, last=False)
                    self.demotions += 1


class FabricWhere:
    """`key → tier` as one member sees it: HBM if in its own HBM, else the pool's tier."""

    __slots__ = ("hbm", "pool")

    def __init__(self, hbm: OrderedDict[PrefixKey, None], pool: dict[PrefixKey, int]) -> None:
        self.hbm, self.pool = hbm, pool

    def get(self, k: PrefixKey) -> int | None:
        if k in self.hbm:
            return HBM
        return self.pool.get(k)

    def __contains__(self, k: object) -> bool:
        return k in self.hbm or k in self.pool


class FabricCache:
    """One member's global KV on the shared fabric: its own HBM (LRU) over the shared
    pool. The same surface as `TieredCache` (`match`, `matched_blocks`, `touch`,
    `used_blocks`, `capacity`, `utilization`, `where`, counters)."""

    __slots__ = ("block", "demoted", "hbm", "hbm_capacity", "pool", "where")

    def __init__(self, hbm_tokens: int, pool: SharedPool, block_tokens: int) -> None:
        self.block = block_tokens
        self.hbm_capacity = max(0, hbm_tokens // block_tokens)
        self.hbm: OrderedDict[PrefixKey, None] = OrderedDict()
        self.pool = pool
        self.where = FabricWhere(self.hbm, pool.where)
        self.demoted = 0

    @property
    def capacity(self) -> list[int]:
        return [self.hbm_capacity, self.pool.capacity[HOST], self.pool.capacity[SSD]]

    @property
    def demotions(self) -> int:
        return self.demoted + self.pool.demotions

    @property
    def evictions(self) -> int:
        return self.pool.evictions

    def match(self, keys: Sequence[PrefixKey], tokens: Sequence[int]) -> tuple[int, int, int]:
        hbm, pool = self.hbm, self.pool.where
        counts = [0, 0, 0]
        for i, k in enumerate(keys):
            if k in hbm:
                counts[HBM] += tokens[i]
                continue
            t = pool.get(k)
            if t is None:
                break
            counts[t] += tokens[i]
        return counts[0], counts[1], counts[2]

    def matched_blocks(self, keys: Sequence[PrefixKey]) -> int:
        n = 0
        for k in keys:
            if k not in self.where:
                break
            n += 1
        return n

    def touch(self, keys: Sequence[PrefixKey]) -> None:
        """`keys` most recent in this HBM (a pooled copy stays in the pool); an HBM
        overflow drops the least recent block, demoting it to the pool if the pool has
        no copy (without write-through, the only way in)."""
        hbm = self.hbm
        for k in reversed(keys):
            hbm[k] = None
            hbm.move_to_end(k, last=False)
        self.pool.refresh(keys)
        dropped: list[PrefixKey] = []
        while len(hbm) > self.hbm_capacity:
            k, _ = hbm.popitem(last=True)
            if k not in self.pool.where:
                dropped.append(k)
        if dropped:
            self.demoted += len(dropped)
            dropped.reverse()  # least recent last, as `put` expects a prefix's order
            self.pool.put(dropped)

    def used_blocks(self, tier: int) -> int:
        return len(self.hbm) if tier == HBM else len(self.pool.lru[tier])

    def utilization(self) -> float:
        cap = self.hbm_capacity
        return len(self.hbm) / cap if cap else 1.0


class Pools:
    """The shared pools of one run and their links: what the engines call to pull and to
    write through. `schedule(t, fn)` is the simulator's event hook (a write-through is
    published when its write completes)."""

    def __init__(
        self,
        fabric: Fabric,
        profile: EngineProfile,
        *,
        engines: int,
        hbm_tokens: int,
        host_tokens: int,
        ssd_tokens: int,
        swa_sequences: int,
        swa_ttl_s: float,
        block_tokens: int,
        schedule: Callable[[float, Callable[[float], None]], None],
    ) -> None:
        if not fabric.shared:
            raise ValueError("Pools are for the shared fabric")
        self.fabric = fabric
        self.bpt = profile.global_kv_bytes_per_token
        self.swa_bytes = profile.swa_bytes_per_sequence
        host_t = profile.tiers.get("host")
        ssd_t = profile.tiers.get("ssd")
        self.host = Link(
            fabric.host_bytes_per_s or (host_t.bandwidth_bytes_per_s if host_t else 50e9),
            fabric.host_latency_s
            if fabric.host_latency_s is not None
            else (host_t.latency_s if host_t else 0.0005),
        )
        self.ssd = Link(
            fabric.ssd_bytes_per_s or (ssd_t.bandwidth_bytes_per_s if ssd_t else 5e9),
            fabric.ssd_latency_s
            if fabric.ssd_latency_s is not None
            else (ssd_t.latency_s if ssd_t else 0.001),
        )
        self.writes = Link(fabric.write_bytes_per_s, 0.0)
        pool_host = fabric.host_pool_tokens
        pool_ssd = fabric.ssd_pool_tokens
        self.pool = SharedPool(
            host_tokens * engines if pool_host is None else pool_host,
            ssd_tokens * engines if pool_ssd is None else pool_ssd,
            block_tokens,
        )
        swa_cap = fabric.swa_pool_sequences
        self.swa = SwaPool(swa_sequences * engines if swa_cap is None else swa_cap, swa_ttl_s)
        self.hbm_tokens = hbm_tokens
        self.block = block_tokens
        self._schedule = schedule
        self._writing: set[PrefixKey] = set()
        self.swa_owner: dict[PrefixKey, int] = {}
        """The engine that stored each SWA state last (`Fabric.swa_local`)."""
        self.pulls = 0
        self.pull_s = 0.0

    def cache(self) -> FabricCache:
        """A new member's global KV: its own HBM over the shared pool."""
        return FabricCache(self.hbm_tokens, self.pool, self.block)

    def pull(self, now: float, host_tokens: float, ssd_tokens: float, swa: bool) -> float:
        """Seconds to bring `host_tokens` from the host pool, `ssd_tokens` from the SSD
        pool (in parallel, over their own links) and, with `swa`, one sequence's SWA state
        from the host pool into an engine, starting `now`, queued behind earlier transfers."""
        host_bytes = host_tokens * self.bpt + (self.swa_bytes if swa else 0.0)
        t = max(self.host.pull(now, host_bytes), self.ssd.pull(now, ssd_tokens * self.bpt))
        if t > 0:
            self.pulls += 1
            self.pull_s += t
        return t

    def write_through(self, keys: Sequence[PrefixKey], tokens: Sequence[int], now: float) -> None:
        """Publish the blocks of `keys` that the pool lacks (and is not already writing):
        through the write queue and the host link; pool hits once the write is done."""
        if not self.fabric.write_through:
            return
        where, writing = self.pool.where, self._writing
        new: list[PrefixKey] = []
        nbytes = 0.0
        for k, n in zip(keys, tokens, strict=True):
            if k not in where and k not in writing:
                new.append(k)
                nbytes += n * self.bpt
        if not new:
            return
        writing.update(new)
        done = self.writes.occupy(now, nbytes)
        self.host.occupy(now, nbytes)  # the write crosses the host link too: reads wait

        def publish(t: float) -> None:
            writing.difference_update(new)
            self.pool.put(new)

        self._schedule(done, publish)

    def swa_remote(self, key: PrefixKey | None, engine: int) -> bool:
        """Whether `engine` must pull the SWA state of `key` from the pool: another
        engine stored it (or every resume pulls, without `Fabric.swa_local`)."""
        if not self.fabric.swa_local or key is None:
            return True
        return self.swa_owner.get(key) != engine

    def swa_written(self, now: float, key: PrefixKey | None = None, engine: int = -1) -> None:
        """A sequence's SWA state stored in the pool by `engine`: its bytes through the
        write queue and the host link (the entry is live at once: the pool's SWA store is
        small)."""
        if key is not None:
            owner = self.swa_owner
            owner.pop(key, None)  # most recent last: the oldest go first when pruned
            owner[key] = engine
            if len(owner) > 2 * max(self.swa.capacity, 1):
                entries = self.swa.entries
                for k in [k for k in owner if k not in entries]:
                    del owner[k]
        if self.swa_bytes > 0:
            self.writes.occupy(now, self.swa_bytes)
            self.host.occupy(now, self.swa_bytes)
