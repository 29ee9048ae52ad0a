"""Engine KV events -> Ramjet residency in router keys, as deltas for the signed reports.

State, per KV-cache group (`group_idx`; the engines send one event per group):
- the group's kind, learned from its stores' `kv_cache_spec_kind` (None: full attention);
- `engine hash -> router key` for every block the group holds: the router key is the
  token-block key (`ramjet.keys.tokens.chain_keys`) computed from the event's `token_ids`,
  chained from the parent block's key (or the seed of the model and adapter for a first
  block), so a later `BlockRemoved` that names only engine hashes resolves;
- copies per key and medium: a block can be held in several media (GPU and CPU), and a
  `BlockRemoved` removes the copy of the medium it names; the block is in a tier while a
  copy is there. SGLang's demotion (a GPU removal while the host copy stays) therefore
  moves the block to the host tier. A store on a medium that already holds the block is
  no new copy: vLLM re-sends `BlockStored` for every reused block when a client asks for
  `vllm_xargs.kv_cache_report_mode: "full"`, so counting them would let any client
  inflate the signed residency (one removal would no longer clear the block). The cost:
  a block vLLM computed twice at once (two requests, one hash, two GPU blocks) is
  dropped at its first removal, an under-report until it is stored again. The same holds
  for two engine hashes that map to one router key (the engine keyed the same tokens
  twice): the first removal drops the key, the second finds no copy and is counted.

A key is resident when every prefix-caching group holds it; its tier is the slowest of
those groups' fastest copies (a restore waits for the slowest group). Sliding-window
groups (kind containing "sliding" or "swa") do not gate residency: with bounded replay
they leave prefix caching, and their state is replayed rather than restored.

`A store without `token_ids` (vLLM's OffloadingConnector reports its CPU copies by hash
alone) adds a copy to blocks the group already maps by that engine hash; others are
counted (`hash_only_unknown`), never guessed.

`AllBlocksCleared` drops everything (all groups and media). Stores whose parent is
unknown (history lost), whose block size differs from the pool's `block_tokens`, or
that carry `extra_keys` (multimodal hashes, cache salt: the router cannot compute those
keys) are not mapped; removals of unknown hashes are ignored. Both under-report
residency, never over-report it; each is counted in `stats`.

`apply(batch)` folds a batch into a `DeltaBuilder` (router-key level: stored, moved,
evicted); `snapshot()` is the current residency for a signed snapshot. Not thread-safe:
the sidecar calls it from one thread under its own lock.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from ramjet.keys.tokens import chain_keys, token_key_seed
from ramjet.reports.bodies import DeltaBuilder, TierKeys
from ramjet.sidecar.wire import AllBlocksCleared, BlockRemoved, BlockStored, EngineHash, Event
from ramjet.types import PrefixKey, Tier

VLLM_MEDIA: Mapping[str, Tier] = {"GPU": Tier.HBM, "CPU": Tier.HOST, "STORAGE": Tier.SSD}
SGLANG_MEDIA: Mapping[str, Tier] = {
    "GPU": Tier.HBM,
    "CPU_PINNED": Tier.HOST,
    "DISK": Tier.SSD,
    "EXTERNAL": Tier.SSD,
}
MEDIA: Mapping[str, Mapping[str, Tier]] = {"vllm": VLLM_MEDIA, "sglang": SGLANG_MEDIA}


def is_swa_kind(kind: str | None) -> bool:
    k = (kind or "").lower()
    return "sliding" in k or "swa" in k


@dataclass(slots=True)
class _Group:
    kind: str | None = None
    keys: dict[EngineHash, PrefixKey] = field(default_factory=dict)
    copies: dict[PrefixKey, dict[str, Tier]] = field(default_factory=dict)
    """The media (and their tiers) holding a copy of each key this group holds."""

    def best(self, key: PrefixKey) -> Tier | None:
        c = self.copies.get(key)
        return min(c.values()) if c else None


class ResidencyTracker:
    def __init__(self, model: str, media: Mapping[str, Tier], block_tokens: int) -> None:
        if block_tokens <= 0:
            raise ValueError("block_tokens must be positive")
        self.model = model
        self.media = media
        self.block_tokens = block_tokens
        self._seeds: dict[str | None, int] = {}
        self._groups: dict[int, _Group] = {}
        self._reported: dict[PrefixKey, Tier] = {}
        self.stats: Counter[str] = Counter()

    # -- queries -------------------------------------------------------------------------

    def tier_of(self, key: PrefixKey) -> Tier | None:
        return self._reported.get(key)

    def resident(self) -> dict[PrefixKey, Tier]:
        return dict(self._reported)

    def group_kinds(self) -> dict[int, str | None]:
        return {g: s.kind for g, s in self._groups.items()}

    def key_of(self, engine_hash: EngineHash, group: int = 0) -> PrefixKey | None:
        g = self._groups.get(group)
        return None if g is None else g.keys.get(engine_hash)

    def snapshot(self, chunk: int = 4096) -> list[TierKeys]:
        by_tier: dict[Tier, list[PrefixKey]] = {}
        for key, tier in self._reported.items():
            by_tier.setdefault(tier, []).append(key)
        return [
            TierKeys(tier=t.label, keys=tuple(ks[i : i + chunk]))
            for t, ks in sorted(by_tier.items())
            for i in range(0, len(ks), chunk)
        ]

    # -- changes -------------------------------------------------------------------------

    def reset(self) -> None:
        """Forget everything without reporting (a new epoch follows)."""
        self._groups.clear()
        self._reported.clear()

    def apply(self, events: tuple[Event, ...] | list[Event], out: DeltaBuilder) -> None:
        dirty: set[PrefixKey] = set()
        for ev in events:
            if isinstance(ev, BlockStored):
                self._stored(ev, dirty)
            elif isinstance(ev, BlockRemoved):
                self._removed(ev, dirty)
            elif isinstance(ev, AllBlocksCleared):
                self.stats["cleared"] += 1
                self._groups.clear()
                dirty.update(self._reported)
        for key in dirty:
            new = self._tier(key)
            old = self._reported.get(key)
            if new == old:
                continue
            if new is None:
                del self._reported[key]
                out.evicted(key)
            else:
                self._reported[key] = new
                if old is None:
                    out.stored(key, new)
                else:
                    out.moved(key, new)

    def _tier(self, key: PrefixKey) -> Tier | None:
        worst: Tier | None = None
        gated = False
        for g in self._groups.values():
            if is_swa_kind(g.kind):
                continue
            gated = True
            best = g.best(key)
            if best is None:
                return None
            worst = best if worst is None or best > worst else worst
        return worst if gated else None

    def _medium(self, medium: str | None) -> tuple[str, Tier] | None:
        name = medium or "GPU"
        tier = self.media.get(name)
        if tier is None:
            self.stats["unknown_medium"] += 1
            return None
        return name, tier

    def _seed(self, lora_name: str | None) -> int:
        s = self._seeds.get(lora_name)
        if s is None:
            s = self._seeds[lora_name] = token_key_seed(self.model, lora_name)
        return s

    def _stored(self, ev: BlockStored, dirty: set[PrefixKey]) -> None:
        medium = self._medium(ev.medium)
        if medium is None:
            return
        g = self._groups.get(ev.group_idx)
        if g is None:
            g = self._groups[ev.group_idx] = _Group()
            dirty.update(self._reported)  # a new group gates every key
        if ev.kv_cache_spec_kind is not None and ev.kv_cache_spec_kind != g.kind:
            g.kind = ev.kv_cache_spec_kind
            dirty.update(self._reported)
        if ev.hash_only:
            self._stored_copies(ev, g, medium, dirty)
            return
        if ev.block_size != self.block_tokens:
            self.stats["block_size_mismatch"] += len(ev.block_hashes)
            return
        if ev.extra_keys is not None and any(x is not None for x in ev.extra_keys):
            self.stats["extra_keys"] += len(ev.block_hashes)
            return
        if ev.cache_salt is not None:
            # SGLang namespaces the hashes by the request's salt: the blocks serve only
            # requests with that salt, which a key from the tokens cannot tell apart
            self.stats["cache_salt"] += len(ev.block_hashes)
            return
        if ev.parent_block_hash is None:
            parent = self._seed(ev.lora_name)
        else:
            known = g.keys.get(ev.parent_block_hash)
            if known is None:
                self.stats["unknown_parent"] += len(ev.block_hashes)
                return
            parent = known
        keys = chain_keys(ev.token_ids, parent, self.block_tokens)
        for h, key in zip(ev.block_hashes, keys, strict=True):
            prev = g.keys.get(h)
            if prev is not None and prev != key:
                self.stats["hash_conflict"] += 1  # same engine hash, other tokens: re-map
            g.keys[h] = key
            c = g.copies.setdefault(key, {})
            if medium[0] in c:
                self.stats["restored_same_medium"] += 1  # a re-report: no new copy
                continue
            c[medium[0]] = medium[1]
            dirty.add(key)
            self.stats["stored"] += 1

    def _stored_copies(
        self, ev: BlockStored, g: _Group, medium: tuple[str, Tier], dirty: set[PrefixKey]
    ) -> None:
        """A store without tokens adds a copy of blocks the group already maps (vLLM's
        OffloadingConnector copies GPU-resident blocks to CPU); hashes it never saw with
        tokens cannot be keyed and are counted, not guessed."""
        for h in ev.block_hashes:
            key = g.keys.get(h)
            if key is None:
                self.stats["hash_only_unknown"] += 1
                continue
            c = g.copies.setdefault(key, {})
            if medium[0] in c:
                self.stats["restored_same_medium"] += 1
                continue
            c[medium[0]] = medium[1]
            dirty.add(key)
            self.stats["stored"] += 1

    def _removed(self, ev: BlockRemoved, dirty: set[PrefixKey]) -> None:
        medium = self._medium(ev.medium)
        g = self._groups.get(ev.group_idx)
        if medium is None:
            return
        for h in ev.block_hashes:
            key = None if g is None else g.keys.get(h)
            if key is None or g is None:
                self.stats["unknown_removed"] += 1
                continue
            c = g.copies.get(key)
            if c is None:
                # another engine hash mapped to this key and its removal dropped the
                # last copy already (two engine blocks, one router key): forget this alias
                del g.keys[h]
                self.stats["removed_absent_copy"] += 1
                continue
            if c.pop(medium[0], None) is None:
                self.stats["removed_absent_copy"] += 1
                continue
            if not c:
                del g.copies[key]
                del g.keys[h]
            dirty.add(key)
            self.stats["removed"] += 1
