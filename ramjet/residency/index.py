"""`BlockIndex`: one engine's exact global-KV residency in typed arrays.

What it keeps per block: the 8-byte key, and a 4-byte word holding a tier (2 bits) and
a run id (30 bits). A run is the group of blocks one report (one `put` call, one
snapshot group) confirmed together: its confirmation time and expiry are kept once per
run, not once per block ("coarse expiry per run"). About 20-30 bytes per block in all
(the table's slots at 50-80 % load, 12 bytes each, plus 8 bytes in its run's key list).

Layout. The keys are spread over `SHARDS` shards by their low 12 bits, and a key's home
slot in its shard is the bits above modulo the shard's size (prefix keys are xxhash
outputs: uniform, so no further mixing); each shard is an open-addressing table (linear probing,
tombstones) of two parallel arrays, `array('Q')` keys and `array('I')` words (0 empty,
1 a tombstone). A shard grows, shrinks and drops its tombstones by rehashing alone, so
no single step touches more than one shard (a 20M-block index: ~5k blocks a shard, about
a millisecond compiled): the event loop is never stalled by a whole-table rehash.

Order. Runs are numbered in the order they were made (`seq`) and each keeps its keys in
the order they were put, so the least recently confirmed live block is the first key of
the oldest live run still owned by that run; that is the `OrderedDict` order of the old
store (`DictStore`), and eviction under a cap follows the same rule (see
`ramjet.residency.store.MemoryStore`). A run's ids are recycled once no block uses it.

Expiry. `sweep(now, shards)` tombstones the expired blocks of a few shards per call
(`ramjet.residency.store.MemoryStore.expire` calls it in bounded steps); `lookup` never
answers for an expired block whatever the sweep's progress.
"""

from __future__ import annotations

import heapq
from array import array
from collections.abc import Sequence
from typing import Any, Final

SHARD_BITS: Final = 12
SHARDS: Final = 1 << SHARD_BITS
_SHARD_MASK: Final = SHARDS - 1
_EMPTY: Final = 0
_TOMB: Final = 1
_MIN_SLOTS: Final = 8
_DUE_POPS: Final = 256
_GROWTH: Final = 8
"""The most a shard grows by in one rehash toward a reserved size (`reserve`): its
4,096 shards cross their load together (uniform keys), so a jump from 8 slots straight
to the reserved share put every shard's new arrays (11 MB of fresh pages for a
524k-key snapshot, 430 MB for a 20M one's marks) in the few pieces where they crossed:
a 9 ms piece of 2,048 keys against a median of 1.4 ms. By steps of at most 8x each
inserted key pays a bounded share of the growths, about 500 bytes of new arrays."""
OBJECT_BYTES: Final = 512
"""What `release` counts for an entry of a run heap (a tuple and its float and ints) or
of the free list: a step of `RELEASE_BYTES` frees 16k of them, about a millisecond.
At 128 a step freed 65k: 4.2 ms of (float, int, int) tuple deallocations measured alone
on the 2-core host (3.0 ms for the (int, int) ones), as much as a whole step's budget."""
_GARBAGE_KEYS: Final = 8192
"""A run's key list longer than this goes to `garbage` when the run dies, wherever."""
ARRAY_BYTES: Final = 32 << 10
"""What `release` counts for freeing one array beyond its items: glibc's free of one
chunk among millions (its unlink and consolidation) and the object's own teardown, 2-4 us
measured compiled; a step of `RELEASE_BYTES` frees at most 256 arrays. A sweep's pass
empties its expired runs together in its last shards: at 20M blocks thousands of small
key lists at once, each freed where it died cost 4 us (2.5 ms a shard of 555 runs of
128 keys at 4M blocks), so a sweep's emptied runs leave every list to `garbage`."""
RELEASE_BYTES: Final = 8 << 20
"""Bytes of a dropped index's arrays freed in one step (`BlockIndex.release`): about a
millisecond; 150 MB at once (38 run arrays of a 20M-block snapshot) was a 25 ms turn."""


_ZERO_Q: Final = array("Q", [0])
_ZERO_I: Final = array("I", [0])


def _cut_objects(items: list[Any], budget: int) -> int:
    """Drop about `budget` bytes of `items` (`OBJECT_BYTES` each) from its end; returns
    what is left of `budget`: above 0 once `items` is empty."""
    n = len(items)
    cut = min(n, max(1, budget // OBJECT_BYTES))
    del items[n - cut :]
    return budget - cut * OBJECT_BYTES if cut == n else 0


def _free_tail(arrays: list[array[int] | None], budget: int) -> int:
    """Free about `budget` bytes of the key lists at the end of `arrays`: whole lists
    popped, a longer one cut from its end (its memory returned a slice at a time). Returns
    what is left of `budget`: above 0 once `arrays` is empty, at most 0 while some is
    left. Each array popped counts `ARRAY_BYTES` more, each None `OBJECT_BYTES`."""
    while arrays and budget > 0:
        keys = arrays[-1]
        if keys is None:
            arrays.pop()
            budget -= OBJECT_BYTES
            continue
        held = 8 * len(keys)
        if held > budget:
            del keys[len(keys) - budget // 8 :]
            return 0
        arrays.pop()
        budget -= held + ARRAY_BYTES
    return budget


def _slots(used: int) -> int:
    """Slots for a shard of `used` blocks: 50 % load right after a rehash."""
    return max(_MIN_SLOTS, used * 2)


class _Shard:
    __slots__ = ("filled", "keys", "limit", "used", "words")

    def __init__(self, slots: int, s: int) -> None:
        # made at their size, zeroed, by repeating one zero: `array(code, bytes(n))`
        # allocated and freed a zeroed temporary of the same size per array, whose freed
        # chunks (a reserved index's first growths: thousands at once) fragmented the C
        # heap, and later allocations searched them
        self.keys: array[int] = _ZERO_Q * slots
        self.words: array[int] = _ZERO_I * slots
        self.used = 0
        """Live blocks."""
        self.filled = 0
        """Live blocks and tombstones."""
        self.limit = _limit(slots, s)
        """The most `filled` before the shard grows: 62-80 % load by shard number `s`,
        so shards filled alike (uniform keys) do not all grow in the same few puts (a
        loop stall of hundreds of rehashes); each grows at its own point."""


def _limit(slots: int, s: int) -> int:
    return slots * (160 + 3 * (s & 15)) >> 8


class BlockIndex:
    """One engine's exact blocks of the global table. Single-threaded."""

    def __init__(self) -> None:
        self.shards: list[_Shard | None] = [None] * SHARDS
        self.grow_slots = _MIN_SLOTS
        """The fewest slots a growing shard rehashes to (`reserve`)."""
        self.count = 0
        """Live blocks (expired ones count until swept)."""
        # runs, by id (id 0 unused: a word of 0 or 1 is an empty slot or a tombstone)
        self.conf: array[float] = array("d", [0.0])
        self.exp: array[float] = array("d", [0.0])
        self.refs: array[int] = array("q", [0])
        self.seq: array[int] = array("q", [0])
        self.run_keys: list[array[int] | None] = [None]
        self.run_head: array[int] = array("q", [0])
        self._free: list[int] = [0]
        """Ids of runs no block uses, to recycle: a stack of `_free_n` entries in a list
        as long as `conf` (grown as ids are made), never resized when a run dies."""
        self._free_n = 0
        self._next_seq = 1
        self._order: list[tuple[int, int]] = []
        """Min-heap of (seq, run), cleaned lazily: the oldest live run first."""
        self._expiry: list[tuple[float, int, int]] = []
        """Min-heap of (expires_at, seq, run), cleaned lazily."""
        self._dead: list[array[int] | None] = [None]
        """Key lists of runs no block uses any more, left for `release_garbage` (the
        `garbage`): a stack of `_dead_n` entries, in a list as long as `conf` (a run's
        list is left here once per death), appended to only past that. A sweep's pass
        drops its expired runs together in its last shards: at 20M blocks a few dozen
        lists of 4 MB (a snapshot part's run), 6-10 ms to free at once, or thousands of
        small ones (`ARRAY_BYTES`). And nothing is allocated where they die: growing a
        list by appends there was a `realloc` of the C heap every few hundred deaths,
        10-14 ms of `_int_malloc` in one step of a 20M-block Redis mirror."""
        self._dead_n = 0

    # -- runs ---------------------------------------------------------------------------

    def new_run(self, confirmed_at: float, expires_at: float) -> int:
        """A new run: the most recently confirmed. It is held open (never recycled, even
        while no block uses it) until `close_run`."""
        seq = self._next_seq
        self._next_seq += 1
        if self._free_n:
            self._free_n -= 1
            run = self._free[self._free_n]
            self.conf[run] = confirmed_at
            self.exp[run] = expires_at
            self.refs[run] = 1
            self.seq[run] = seq
            self.run_keys[run] = array("Q")
            self.run_head[run] = 0
        else:
            run = len(self.conf)
            if run >= 1 << 30:
                raise OverflowError("more than 2**30 live runs in one block index")
            self.conf.append(confirmed_at)
            self.exp.append(expires_at)
            self.refs.append(1)
            self.seq.append(seq)
            self.run_keys.append(array("Q"))
            self.run_head.append(0)
            self._free.append(0)  # room for the id when it is free: none made at its death
            self._dead.append(None)
        heapq.heappush(self._order, (seq, run))
        heapq.heappush(self._expiry, (expires_at, seq, run))
        return run

    def close_run(self, run: int) -> None:
        """The run takes no more blocks: recycled once none uses it."""
        self._release(run)

    def _release(self, run: int, bulk: bool = False) -> None:
        """One block fewer in `run`. At its last, the run's id goes on the free list and
        its key list to `garbage` when long, or from a `bulk` walk (a sweep, a mark's
        drop: thousands of runs die in one shard); a put's or a removal's few deaths
        free a short list where they happen (left to the garbage steps, the lists that
        replays emptied piled up where nothing stepped the expiry: a 20M-block Redis
        benchmark's writer read 2,654 MiB RSS after its load and 4,054 at its end,
        against 2,524 and 3,529 with them freed)."""
        n = self.refs[run] - 1
        self.refs[run] = n
        if n == 0:
            keys = self.run_keys[run]
            if keys is not None and (bulk or len(keys) > _GARBAGE_KEYS):
                d = self._dead_n
                if d < len(self._dead):
                    self._dead[d] = keys
                else:
                    self._dead.append(keys)  # an id dead again before its list was freed
                self._dead_n = d + 1
            self.run_keys[run] = None
            self.seq[run] = 0
            self._free[self._free_n] = run  # one entry per id at most: room for it
            self._free_n += 1

    def _live_run(self, seq: int, run: int) -> bool:
        return self.seq[run] == seq and self.refs[run] > 0

    def oldest(self) -> tuple[float, int]:
        """(confirmed_at, run) of the oldest live run; run 0 when the index is empty."""
        order = self._order
        while order:
            seq, run = order[0]
            if self._live_run(seq, run):
                return self.conf[run], run
            heapq.heappop(order)
        return 0.0, 0

    def next_expiry(self) -> float:
        """The earliest expiry of a live run (inf when none)."""
        heap = self._expiry
        while heap:
            exp, seq, run = heap[0]
            if self._live_run(seq, run):
                return exp
            heapq.heappop(heap)
        return float("inf")

    def expiry_due(self, now: float, pops: int = _DUE_POPS) -> bool:
        """Whether a live run may have expired at `now`: `next_expiry() <= now`, but the
        heap's dead entries are dropped `pops` at most per call (a sweep's pass frees
        its expired runs together in its last shards: ~10k at 20M blocks, 5-10 ms of
        pops in one call); while dead expired entries are left it answers True (the
        sweep's next step finds out), never False with a live run expired."""
        heap = self._expiry
        popped = 0
        while heap:
            exp, seq, run = heap[0]
            if exp > now:
                return False  # every entry left expires later
            if self._live_run(seq, run):
                return True
            if popped >= pops:
                return True
            heapq.heappop(heap)
            popped += 1
        return False

    # -- blocks -------------------------------------------------------------------------

    def lookup(self, key: int) -> int:
        """The block's word (run << 2 | tier), 0 when absent; expired blocks included."""
        sh = self.shards[key & _SHARD_MASK]
        if sh is None:
            return 0
        keys, words = sh.keys, sh.words
        n = len(words)
        i = (key >> SHARD_BITS) % n
        while True:
            w = words[i]
            if w == _EMPTY:
                return 0
            if w != _TOMB and keys[i] == key:
                return w
            i += 1
            if i == n:
                i = 0

    def live(self, key: int, now: float) -> int:
        """`lookup`, 0 when the block's run expired at or before `now`."""
        w = self.lookup(key)
        if w and self.exp[w >> 2] > now:
            return w
        return 0

    def put(self, key: int, run: int, tier: int) -> bool:
        """Put the block in `run` with `tier`; True when it was not held. A block already
        in `run` keeps its place and takes the tier."""
        s = key & _SHARD_MASK
        sh = self.shards[s]
        if sh is None:
            sh = self.shards[s] = _Shard(_MIN_SLOTS, s)
        keys, words = sh.keys, sh.words
        n = len(words)
        i = (key >> SHARD_BITS) % n
        tomb = -1
        word = run << 2 | tier
        while True:
            w = words[i]
            if w == _EMPTY:
                break
            if w == _TOMB:
                if tomb < 0:
                    tomb = i
            elif keys[i] == key:
                old = w >> 2
                words[i] = word
                if old != run:
                    self._release(old)
                    self.refs[run] += 1
                    lst = self.run_keys[run]
                    assert lst is not None
                    lst.append(key)
                return False
            i += 1
            if i == n:
                i = 0
        if tomb >= 0:
            i = tomb
        else:
            sh.filled += 1
        keys[i] = key
        words[i] = word
        sh.used += 1
        self.count += 1
        self.refs[run] += 1
        lst = self.run_keys[run]
        assert lst is not None
        lst.append(key)
        if sh.filled > sh.limit:
            self._rehash(s, sh)
        return True

    def reserve(self, blocks: int) -> None:
        """Expect `blocks` blocks in all (a snapshot staged into a new index knows its
        size): a shard that outgrows its slots grows by up to `_GROWTH` times toward its
        share, so the puts rehash each shard a few times instead of at every
        doubling. 0 (or a small index) goes back to growing by doubling. A shard is
        still made small and grown as it fills: no single step allocates (and first
        touches) every shard's full size."""
        if blocks < SHARDS * _MIN_SLOTS:
            self.grow_slots = _MIN_SLOTS
        else:
            self.grow_slots = blocks * 9 // (5 * SHARDS)  # ~56 % load when all are in

    def put_many(self, keys: Sequence[int], run: int, tier: int) -> int:
        """`put` of each key (one call for a report's group); returns how many were new.

        The hot loop of a snapshot or a delta: a key's shard and slot are read straight
        from its bits (prefix keys are xxhash outputs), and the run's key list takes the
        whole group in one C-level `extend` unless a key was already held (then only
        the keys `put` would append)."""
        shards = self.shards
        lst = self.run_keys[run]
        assert lst is not None
        word = run << 2 | tier
        new = 0
        held: list[int] | None = None  # positions of keys this run already held
        pos = -1
        for key in keys:
            pos += 1
            s = key & _SHARD_MASK
            sh = shards[s]
            if sh is None:
                sh = _Shard(_MIN_SLOTS, s)
                shards[s] = sh
            words = sh.words
            n = len(words)
            i = (key >> SHARD_BITS) % n
            w = words[i]
            if w == _EMPTY:  # the common case: a free home slot
                sh.keys[i] = key
                words[i] = word
                sh.filled += 1
                sh.used += 1
                new += 1
                if sh.filled > sh.limit:
                    self._rehash(s, sh)
                continue
            skeys = sh.keys
            tomb = -1
            found = False
            while True:
                if w == _TOMB:
                    if tomb < 0:
                        tomb = i
                elif skeys[i] == key:
                    old = w >> 2
                    words[i] = word
                    if old != run:
                        self._release(old)
                        self.refs[run] += 1
                    else:
                        if held is None:
                            held = []
                        held.append(pos)
                    found = True
                    break
                i += 1
                if i == n:
                    i = 0
                w = words[i]
                if w == _EMPTY:
                    break
            if found:
                continue
            if tomb >= 0:
                i = tomb
            else:
                sh.filled += 1
            skeys[i] = key
            words[i] = word
            sh.used += 1
            new += 1
            if sh.filled > sh.limit:
                self._rehash(s, sh)
        if held is None:
            lst.extend(keys)
        else:
            skip = set(held)
            lst.extend([k for j, k in enumerate(keys) if j not in skip])
        self.count += new
        self.refs[run] += new
        return new

    def words(self, keys: Sequence[int], now: float) -> list[int]:
        """`live` of each key (one call for a prompt's blocks): 0 where not held."""
        shards = self.shards
        exp = self.exp
        out: list[int] = []
        for key in keys:
            sh = shards[key & _SHARD_MASK]
            found = 0
            if sh is not None:
                skeys, words = sh.keys, sh.words
                n = len(words)
                i = (key >> SHARD_BITS) % n
                while True:
                    w = words[i]
                    if w == _EMPTY:
                        break
                    if w != _TOMB and skeys[i] == key:
                        if exp[w >> 2] > now:
                            found = w
                        break
                    i += 1
                    if i == n:
                        i = 0
            out.append(found)
        return out

    def remove(self, key: int) -> bool:
        """Drop the block; True when it was held."""
        s = key & _SHARD_MASK
        sh = self.shards[s]
        if sh is None:
            return False
        keys, words = sh.keys, sh.words
        n = len(words)
        i = (key >> SHARD_BITS) % n
        while True:
            w = words[i]
            if w == _EMPTY:
                return False
            if w != _TOMB and keys[i] == key:
                words[i] = _TOMB
                sh.used -= 1
                self.count -= 1
                self._release(w >> 2)
                if sh.used == 0 or (sh.used * 8 < n and n > _MIN_SLOTS):
                    self._rehash(s, sh)
                return True
            i += 1
            if i == n:
                i = 0

    def _rehash(self, s: int, old: _Shard) -> None:
        if old.used == 0:
            self.shards[s] = None
            return
        n = max(_slots(old.used), min(self.grow_slots, len(old.words) * _GROWTH))
        if old.used * 4 < n:  # a few blocks into a large shard (`reserve`): in place
            sh = _Shard(n, s)
            nkeys, nwords = sh.keys, sh.words
            for key, w in zip(old.keys, old.words, strict=True):
                if w > _TOMB:
                    i = (key >> SHARD_BITS) % n
                    while nwords[i] != _EMPTY:
                        i += 1
                        if i == n:
                            i = 0
                    nkeys[i] = key
                    nwords[i] = w
            sh.used = sh.filled = old.used
            self.shards[s] = sh
            return
        # built in lists, then packed in one C pass each: an item of a list is read and
        # written natively (compiled), an item of an array through the generic protocol,
        # several times slower; the old arrays are read by their C iterators
        keys: list[int] = [0] * n
        words: list[int] = [0] * n
        for key, w in zip(old.keys, old.words, strict=True):
            if w > _TOMB:
                i = (key >> SHARD_BITS) % n
                while words[i] != _EMPTY:
                    i += 1
                    if i == n:
                        i = 0
                keys[i] = key
                words[i] = w
        sh = _Shard(0, s)
        sh.keys = array("Q", keys)
        sh.words = array("I", words)
        sh.limit = _limit(n, s)
        sh.used = sh.filled = old.used
        self.shards[s] = sh

    def evict_oldest(self) -> bool:
        """Drop the least recently confirmed block (the first key of the oldest live run
        that the run still owns); False when the index is empty."""
        skipped: list[tuple[int, int]] = []
        try:
            while True:
                _, run = self.oldest()
                if run == 0:
                    return False
                lst = self.run_keys[run]
                assert lst is not None
                head = self.run_head[run]
                while head < len(lst):
                    key = lst[head]
                    head += 1
                    if self.lookup(key) >> 2 == run:
                        self.run_head[run] = head
                        self.remove(key)
                        return True
                self.run_head[run] = head
                # an open run with no block left in it: look past it, keep it in order
                skipped.append(heapq.heappop(self._order))
        finally:
            for item in skipped:
                heapq.heappush(self._order, item)

    def shard_keys(self, s: int) -> list[int]:
        """The keys held in shard `s` (a copy)."""
        sh = self.shards[s]
        if sh is None:
            return []
        keys, words = sh.keys, sh.words
        return [keys[j] for j in range(len(words)) if words[j] > _TOMB]

    def shard_items(self, s: int) -> list[tuple[int, int]]:
        """(key, word) of the blocks held in shard `s` (a copy)."""
        sh = self.shards[s]
        if sh is None:
            return []
        keys, words = sh.keys, sh.words
        return [(keys[j], words[j]) for j in range(len(words)) if words[j] > _TOMB]

    def missing(self, keys: Sequence[int]) -> list[int]:
        """The keys of `keys` this index does not hold (expired or not)."""
        return [k for k in keys if not self.lookup(k)]

    def items(self) -> list[tuple[int, int]]:
        """(key, word) of every held block, by shard (for inspection and tests)."""
        out: list[tuple[int, int]] = []
        for sh in self.shards:
            if sh is None:
                continue
            keys, words = sh.keys, sh.words
            for j in range(len(words)):
                w = words[j]
                if w > _TOMB:
                    out.append((keys[j], w))
        return out

    def mark(self) -> int:
        """The seq the next run will have: the runs made from now on are at or after it
        (`drop_before`)."""
        return self._next_seq

    def blocks_before(self, mark: int) -> int:
        """Blocks held by the runs made before `mark` (`mark()`), at most: a run still
        open counts one more. 0: `drop_before` would drop nothing."""
        seq, refs = self.seq, self.refs
        n = 0
        for r in range(1, len(seq)):
            s = seq[r]
            if 0 < s < mark:
                n += refs[r]
        return n

    def drop_before(self, mark: int, start: int, shards: int) -> tuple[int, int, int]:
        """Tombstone the blocks of shards `start` .. `start + shards - 1` whose run was
        made before `mark` (`mark()`): those no put named since; returns (blocks dropped,
        slots looked at, the next shard: SHARDS when done)."""
        dropped = looked = 0
        end = min(SHARDS, start + shards)
        seq = self.seq
        for s in range(start, end):
            sh = self.shards[s]
            if sh is None:
                continue
            words = sh.words
            n = len(words)
            looked += n
            before = dropped
            for j, w in enumerate(words):
                if w > _TOMB and seq[w >> 2] < mark:
                    words[j] = _TOMB
                    sh.used -= 1
                    self._release(w >> 2, True)
                    dropped += 1
            if dropped > before and ((sh.used * 8 < n and n > _MIN_SLOTS) or sh.used == 0):
                self._rehash(s, sh)
        self.count -= dropped
        return dropped, looked, end

    def nbytes(self) -> int:
        """Bytes of the index's large arrays (shards, runs' key lists, `garbage`) and of
        its runs' heaps and free list (`OBJECT_BYTES` an entry): what `release` frees."""
        held = sum(8 * len(sh.keys) + 4 * len(sh.words) for sh in self.shards if sh is not None)
        lists = (self.garbage, self.run_keys)
        held += sum(8 * len(keys) for ks in lists for keys in ks if keys is not None)
        return held + OBJECT_BYTES * (len(self._order) + len(self._expiry) + len(self._free))

    @property
    def garbage(self) -> list[array[int] | None]:
        """The key lists left for `release_garbage` (a copy, for inspection)."""
        return self._dead[: self._dead_n]

    def has_garbage(self) -> bool:
        """Whether `release_garbage` has work left."""
        return self._dead_n > 0

    def release_garbage(self, budget: int) -> int:
        """Free about `budget` bytes of `garbage` (`ARRAY_BYTES` more a list), a long list
        cut from its end; returns what is left of `budget` (above 0 once none is left).
        Its slots stay: a later death takes one without growing the list."""
        dead = self._dead
        n = self._dead_n
        while n and budget > 0:
            keys = dead[n - 1]
            assert keys is not None  # a slot below `_dead_n` always holds a list
            held = 8 * len(keys)
            if held > budget:
                del keys[len(keys) - budget // 8 :]
                self._dead_n = n
                return 0
            dead[n - 1] = None
            n -= 1
            budget -= held + ARRAY_BYTES
        self._dead_n = n
        return budget

    def release(self, budget: int) -> int:
        """Free about `budget` bytes of this index's arrays, for an index no longer read
        (a snapshot replaced it, a purge dropped it, a staging's marks are done): shards
        first, then the runs' key lists, a long run's list cut from its end. Returns
        what is left of `budget`: above 0 once nothing large is left to free (the rest
        is a few small arrays, freed with the index), at most 0 while some is. Freeing
        a 20M-block index at once is about 600 MB and a 15-25 ms loop turn."""
        budget = self.release_garbage(budget)
        shards = self.shards
        while budget > 0 and shards:
            sh = shards.pop()
            if sh is not None:
                budget -= 8 * len(sh.keys) + 4 * len(sh.words)
        if budget > 0:
            budget = _free_tail(self.run_keys, budget)
        # the runs' heaps and free list: a Python tuple or int per run, ~100k runs at 20M
        # blocks (a run per report piece), 35 ms to free at once (a tuple's dealloc each)
        if budget > 0:
            budget = _cut_objects(self._order, budget)
        if budget > 0:
            budget = _cut_objects(self._expiry, budget)
        if budget > 0:
            budget = _cut_objects(self._free, budget)
        return budget

    def sweep(self, now: float, start: int, shards: int) -> tuple[int, int]:
        """Tombstone the expired blocks of shards `start` .. `start + shards - 1`;
        returns (blocks dropped, the next shard to sweep, SHARDS when done)."""
        dropped = 0
        end = min(SHARDS, start + shards)
        exp = self.exp
        for s in range(start, end):
            sh = self.shards[s]
            if sh is None:
                continue
            words = sh.words
            n = len(words)
            for j, w in enumerate(words):
                if w > _TOMB and exp[w >> 2] <= now:
                    words[j] = _TOMB
                    sh.used -= 1
                    self._release(w >> 2, True)
                    dropped += 1
            if dropped and ((sh.used * 8 < n and n > _MIN_SLOTS) or sh.used == 0):
                self._rehash(s, sh)
        self.count -= dropped
        return dropped, end
