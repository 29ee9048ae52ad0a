"""Key layout and the Lua scripts behind `RedisStore`: one engine's residency in Redis.

Key layout (`P` is the configured key prefix, `E` the engine id; `{P:E}` is the Redis
Cluster hash tag, so every key of one engine lives in one slot and one script changes
them atomically). A "kind" is a table and a source: `gx` global exact, `ga` global
approximate, `sx` SWA exact, `sa` SWA approximate.

| key | type | holds | TTL |
|---|---|---|---|
| `{P:E}:st` | hash | `epoch`, `seq` (last report applied), `gen` (batch counter), `at` (last write ms) | retention |
| `{P:E}:<kind>:<key16>` | string | `"<tier>,<confirmed_ms>,<mac>"`: one entry | its expiry (PXAT) |
| `{P:E}:i:<kind>` | zset | index: key16 → expiry ms (resync, caps, purge) | retention |
| `{P:E}:log` | stream | one entry per applied batch, tailed by every replica | retention |
| `{P:E}:vc` | hash | the report verifier's shared cursor (`ramjet.reports.redis_cursors`) | retention |

`key16` is the 64-bit prefix key as 16 hex digits; times are Unix milliseconds on the
Redis server's clock for expiry (PXAT) and on the writer's wall clock for confirmation.
Retention is the longest entry TTL plus a slack (a day by default), refreshed on every
write, so no key lives forever and a silent engine leaves nothing behind.

`APPLY` runs one batch of store operations for one engine, atomically:
- mode `seq` (a verified report's changes): refused as `stale` when `epoch` < the stored
  epoch and as `dup` when equal with `seq` <= the stored seq, changing nothing; else
  applied and (epoch, seq) stored. Two replicas applying one report, in either order,
  leave one result.
- mode `free` (the router's own routing, or store calls outside a report): applied.
- both refuse with `missing` while `st` does not exist: Redis holds no copy of this engine
  (first use, restart, or everything expired). The replica then sends mode `seed`: its
  whole local copy of the engine, applied only while `st` is still missing (the first
  replica to seed wins; the others get `dup` and pull), then retries its batch.
Ops (ARGV[5], JSON list), mirroring `ResidencyStore`:
`["p", kind, tier, confirmed_ms, expires_ms, [key16...]]` put (exact puts drop the
approximate twin; approximate puts skip keys with a live exact entry),
`["r", table, [key16...]]` remove both sources, `["R", table, confirmed_ms,
[[key16, tier, expires_ms]...]]` replace the exact content, `["E", ...]` (same shape)
more exact entries of the replace before it (a chunked snapshot), `["P"]` purge the
engine. Each record may carry its MAC (`redis_ops.Sealer`), stored in the entry's value;
the batch's MAC, epoch and seq go into its log entry. A stored epoch more than the max
clock skew in the future counts as none (it would refuse every real report).
Then expired index members go, and caps evict the members that expire soonest
(ZPOPMIN), deleting their keys; the batch and those evictions are appended to the log
(XADD MAXLEN ~) with the new `gen`. Entry keys are reached by name from KEYS[1]'s prefix:
legal on Cluster because the hash tag puts them in KEYS[1]'s slot.

`TAIL` returns (gen, epoch, seq) and the log entries after a stream id in one atomic read,
so a replica can tell "nothing new" from "log trimmed or Redis restarted: pull in full".
A page holds at most `count` entries and, past its first entry, at most `max bytes` of
field values: a reply is taken in by the loop in one piece (parsed in one turn), so its
size, not only its entry count, is what a turn spends on it.
"""

from __future__ import annotations

import re

from ramjet.residency.redis_link import LuaScript
from ramjet.types import EngineId

_ENGINE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
KINDS = ("gx", "ga", "sx", "sa")


def engine_tag(prefix: str, engine: EngineId) -> str:
    """`{prefix:engine}`: the hash tag shared by all of one engine's keys."""
    if not _ENGINE.match(engine):
        raise ValueError(f"engine id {engine!r} cannot be used in a Redis key")
    return "{" + f"{prefix}:{engine}" + "}"


class EngineKeys:
    """Names of one engine's keys."""

    __slots__ = ("base", "log", "st", "vc")

    def __init__(self, prefix: str, engine: EngineId) -> None:
        self.base = engine_tag(prefix, engine)
        self.st = f"{self.base}:st"
        self.log = f"{self.base}:log"
        self.vc = f"{self.base}:vc"

    def index(self, kind: str) -> str:
        return f"{self.base}:i:{kind}"

    def entry(self, kind: str, key16: str) -> str:
        return f"{self.base}:{kind}:{key16}"

    def packed(self, kind: str) -> str:
        """The packed encoding's hash of one kind (`APPLY_PACKED`)."""
        return f"{self.base}:b:{kind}"


def key16(key: int) -> str:
    return f"{key:016x}"


APPLY = LuaScript(
    "ramjet_residency_apply",
    r"""
-- KEYS: st, log.  ARGV: mode, epoch, seq, retention_ms, ops json, caps "gcap,scap,logmax",
-- origin, batch mac, max clock skew ms, log max age ms.  Returns {status, gen, epoch, seq}.
local st, log = KEYS[1], KEYS[2]
local base = string.sub(st, 1, -4)
local mode, epoch, seq = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local retention = tonumber(ARGV[4])
local ops = cjson.decode(ARGV[5])
local gcap, scap, logmax = string.match(ARGV[6], "^(%d+),(%d+),(%d+)$")
local caps = {gx = tonumber(gcap), ga = tonumber(gcap), sx = tonumber(scap), sa = tonumber(scap)}
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local cur = redis.call('HMGET', st, 'epoch', 'seq', 'gen')
local cepoch, cseq, gen = tonumber(cur[1]), tonumber(cur[2]), tonumber(cur[3])
-- an epoch is a wall-clock start time: one in the future was not written by a replica
-- (or its clock is wrong) and would refuse every real report, so it does not count
if cepoch ~= nil and cepoch > now + tonumber(ARGV[9]) then cepoch, cseq = nil, nil end
if gen == nil then
  if mode ~= 'seed' then return {'missing', 0, -1, -1} end
  gen = 0
elseif mode == 'seed' then
  return {'dup', gen, cepoch or -1, cseq or -1}
end
if mode == 'seq' and cepoch ~= nil then
  if epoch < cepoch then return {'stale', gen, cepoch, cseq} end
  if epoch == cepoch and seq <= cseq then return {'dup', gen, cepoch, cseq} end
end
-- the first write must be one Redis refuses at maxmemory (HSET is deny-oom): after any
-- write (a DEL), Redis lets the rest of a script write past maxmemory
redis.call('HSET', st, 'at', now)
if mode == 'seq' or (mode == 'seed' and epoch >= 0) then
  redis.call('HSET', st, 'epoch', epoch, 'seq', seq)
end

local function ekey(kind, k) return base .. ':' .. kind .. ':' .. k end
local function idx(kind) return base .. ':i:' .. kind end
local function drop(kind, k) redis.call('DEL', ekey(kind, k)); redis.call('ZREM', idx(kind), k) end
local function clear(kind)
  local members = redis.call('ZRANGE', idx(kind), 0, -1)
  for i = 1, #members, 500 do
    local batch = {}
    for j = i, math.min(i + 499, #members) do batch[#batch + 1] = ekey(kind, members[j]) end
    redis.call('DEL', unpack(batch))
  end
  redis.call('DEL', idx(kind))
end
local function set(kind, k, tier, confirmed, exp, mac)
  if exp > now then
    redis.call('SET', ekey(kind, k), tier .. ',' .. confirmed .. ',' .. (mac or ''), 'PXAT', exp)
    redis.call('ZADD', idx(kind), exp, k)
  else
    drop(kind, k)
  end
end

for _, op in ipairs(ops) do
  local o = op[1]
  if o == 'p' then
    local kind, tier, confirmed, exp = op[2], op[3], op[4], tonumber(op[5])
    local tbl, src = string.sub(kind, 1, 1), string.sub(kind, 2, 2)
    local macs = op[7] or {}
    for i, k in ipairs(op[6]) do
      if src == 'x' then
        drop(tbl .. 'a', k)
        set(kind, k, tier, confirmed, exp, macs[i])
      elseif redis.call('EXISTS', ekey(tbl .. 'x', k)) == 0 then
        set(kind, k, tier, confirmed, exp, macs[i])
      end
    end
  elseif o == 'r' then
    for _, k in ipairs(op[3]) do drop(op[2] .. 'x', k); drop(op[2] .. 'a', k) end
  elseif o == 'R' or o == 'E' then
    local tbl, confirmed = op[2], op[3]
    if o == 'R' then clear(tbl .. 'x') end
    for _, e in ipairs(op[4]) do
      drop(tbl .. 'a', e[1])
      set(tbl .. 'x', e[1], e[2], confirmed, tonumber(e[3]), e[4])
    end
  elseif o == 'P' then
    for _, kind in ipairs({'gx', 'ga', 'sx', 'sa'}) do clear(kind) end
  end
end

-- expired members (their keys are gone already), then caps: soonest expiry goes first
local evicted = {}
for _, kind in ipairs({'gx', 'ga', 'sx', 'sa'}) do
  redis.call('ZREMRANGEBYSCORE', idx(kind), '-inf', now)
  local over = redis.call('ZCARD', idx(kind)) - caps[kind]
  if over > 0 then
    local popped = redis.call('ZPOPMIN', idx(kind), over)
    local out = {}
    for i = 1, #popped, 2 do
      redis.call('DEL', ekey(kind, popped[i])); out[#out + 1] = popped[i]
    end
    evicted[#evicted + 1] = {kind, out}
  end
end

gen = gen + 1
redis.call('HSET', st, 'gen', gen)
local x = '[]'
if #evicted > 0 then x = cjson.encode(evicted) end
-- the log is for tailing replicas (every sync interval): it keeps `logmax` entries and
-- at most ARGV[10] ms of them, so a snapshot's chunks leave it soon after they are read
redis.call('XADD', log, 'MINID', '~', math.max(0, now - tonumber(ARGV[10])), '*',
  'gen', gen, 'm', mode, 'e', ARGV[2], 's', ARGV[3], 'ops', ARGV[5], 'x', x, 'o', ARGV[7],
  'mac', ARGV[8])
redis.call('XTRIM', log, 'MAXLEN', '~', tonumber(logmax))
redis.call('PEXPIRE', st, retention)
redis.call('PEXPIRE', log, retention)
for _, kind in ipairs({'gx', 'ga', 'sx', 'sa'}) do
  if redis.call('EXISTS', idx(kind)) == 1 then redis.call('PEXPIRE', idx(kind), retention) end
end
local ep = redis.call('HMGET', st, 'epoch', 'seq')
return {'ok', gen, tonumber(ep[1]) or -1, tonumber(ep[2]) or -1}
""",
)

TAIL = LuaScript(
    "ramjet_residency_tail",
    r"""
-- KEYS: st, log.  ARGV: after (stream id, or "" for none), count, max bytes (optional).
-- Returns {gen, epoch, seq, entries, last id, more}; gen = -1 when st is missing. With
-- after = "" no entries are read and `last id` is the log's newest id (a pull's start).
-- The entries stop before the one that would take the page's field values past max
-- bytes (the first entry always goes); more = 1 when they stopped so.
local cur = redis.call('HMGET', KEYS[1], 'gen', 'epoch', 'seq')
if cur[1] == false then return {-1, -1, -1, {}, '', 0} end
local entries, last, more = {}, '', 0
if ARGV[1] ~= '' then
  local read = redis.call('XRANGE', KEYS[2], '(' .. ARGV[1], '+', 'COUNT', tonumber(ARGV[2]))
  local budget = tonumber(ARGV[3] or '')
  if budget == nil then
    entries = read
  else
    local bytes = 0
    for _, e in ipairs(read) do
      local n = #e[1]
      for j = 1, #e[2] do n = n + #e[2][j] end
      if #entries > 0 and bytes + n > budget then more = 1; break end
      entries[#entries + 1] = e
      bytes = bytes + n
    end
  end
else
  local newest = redis.call('XREVRANGE', KEYS[2], '+', '-', 'COUNT', 1)
  if #newest > 0 then last = newest[1][1] end
end
return {tonumber(cur[1]), tonumber(cur[2]) or -1, tonumber(cur[3]) or -1, entries, last, more}
""",
)


PACKED_RECORD = 27
"""Bytes per entry in the packed encoding: key high 48 bits (6), tier (1), confirmed ms
(6), expiry ms (6), MAC (8). The key's low 16 bits name the bucket (hash field)."""

APPLY_PACKED = LuaScript(
    "ramjet_residency_apply_packed",
    r"""
-- The packed encoding (docs/redis.md, "Packed encoding"): per engine and kind one hash
-- `{P:E}:b:<kind>`; field = the key's last 4 hex digits (a bucket); value = the bucket's
-- entries, 27 bytes each: key high 48 bits, tier, confirmed ms, expiry ms (6 bytes each),
-- MAC (8 bytes). Same ARGV, statuses, log and ops as APPLY; entries of one bucket are
-- rewritten once per call. Counts per kind live in st (`n:<kind>`); each call sweeps a
-- few buckets (HSCAN cursor `sw:<kind>` in st) to drop expired entries and, over the cap,
-- evicts the soonest-expiring entries of the swept buckets.
local st, log = KEYS[1], KEYS[2]
local base = string.sub(st, 1, -4)
local mode, epoch, seq = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local retention = tonumber(ARGV[4])
local ops = cjson.decode(ARGV[5])
local gcap, scap, logmax = string.match(ARGV[6], "^(%d+),(%d+),(%d+)$")
local caps = {gx = tonumber(gcap), ga = tonumber(gcap), sx = tonumber(scap), sa = tonumber(scap)}
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local cur = redis.call('HMGET', st, 'epoch', 'seq', 'gen')
local cepoch, cseq, gen = tonumber(cur[1]), tonumber(cur[2]), tonumber(cur[3])
if cepoch ~= nil and cepoch > now + tonumber(ARGV[9]) then cepoch, cseq = nil, nil end
if gen == nil then
  if mode ~= 'seed' then return {'missing', 0, -1, -1} end
  gen = 0
elseif mode == 'seed' then
  return {'dup', gen, cepoch or -1, cseq or -1}
end
if mode == 'seq' and cepoch ~= nil then
  if epoch < cepoch then return {'stale', gen, cepoch, cseq} end
  if epoch == cepoch and seq <= cseq then return {'dup', gen, cepoch, cseq} end
end
redis.call('HSET', st, 'at', now)  -- deny-oom first write (see APPLY)
if mode == 'seq' or (mode == 'seed' and epoch >= 0) then
  redis.call('HSET', st, 'epoch', epoch, 'seq', seq)
end

local W = 27
local KINDS = {'gx', 'ga', 'sx', 'sa'}
local function hkey(kind) return base .. ':b:' .. kind end
local cnt = {}
do
  local c = redis.call('HMGET', st, 'n:gx', 'n:ga', 'n:sx', 'n:sa')
  for i, kind in ipairs(KINDS) do cnt[kind] = tonumber(c[i]) or 0 end
end
local cache = {gx = {}, ga = {}, sx = {}, sa = {}}
local cleared = {}
local dirty = {gx = {}, ga = {}, sx = {}, sa = {}}
-- entries new to a bucket in this call: appended once at the end (no quadratic copies)
local adds = {gx = {}, ga = {}, sx = {}, sa = {}}
local function bucket(kind, b)
  local v = cache[kind][b]
  if v == nil then
    if cleared[kind] then v = '' else v = redis.call('HGET', hkey(kind), b) or '' end
    cache[kind][b] = v
  end
  return v
end
-- bucket: the key's last 4 hex digits; the record holds the first 12
local function bkey(k) return string.sub(k, 13, 16) end
local function rkey(k)
  return struct.pack('>I2I4', tonumber(string.sub(k, 1, 4), 16), tonumber(string.sub(k, 5, 12), 16))
end
local function added(kind, b)
  local a = adds[kind][b]
  if a == nil then a = {map = {}, order = {}}; adds[kind][b] = a end
  return a
end
local ms6memo = {}
local function ms6(v)
  local m = ms6memo[v]
  if m == nil then
    m = struct.pack('>I2I4', math.floor(v / 4294967296), v % 4294967296)
    ms6memo[v] = m
  end
  return m
end
local TIERB = {[0] = struct.pack('>B', 0), [1] = struct.pack('>B', 1), [2] = struct.pack('>B', 2)}
-- read every bucket an op touches in one HMGET (not one HGET per entry)
local function prefetch(kind, ks, field)
  if cleared[kind] then return end
  local want, seen = {}, {}
  local c = cache[kind]
  for _, k in ipairs(ks) do
    if field then k = k[field] end
    local b = string.sub(k, 13, 16)
    if c[b] == nil and not seen[b] then seen[b] = true; want[#want + 1] = b end
  end
  for i = 1, #want, 1000 do
    local part = {}
    for j = i, math.min(i + 999, #want) do part[#part + 1] = want[j] end
    local vals = redis.call('HMGET', hkey(kind), unpack(part))
    for j = 1, #part do c[part[j]] = vals[j] or '' end
  end
end
local ZERO8 = string.rep('\0', 8)
local function mac8(m)
  if m == nil or m == '' then return ZERO8 end
  return struct.pack('>I4I4', tonumber(string.sub(m, 1, 8), 16), tonumber(string.sub(m, 9, 16), 16))
end
local function find(v, rk)
  local p = string.find(v, rk, 1, true)
  while p ~= nil and (p - 1) % W ~= 0 do p = string.find(v, rk, p + 1, true) end
  return p
end
local function exp_at(v, p)
  local hi, lo = struct.unpack('>I2I4', v, p + 13)
  return hi * 4294967296 + lo
end
local function drop(kind, k)
  if cnt[kind] <= 0 then return end  -- nothing of this kind (no lookups in a snapshot)
  local b = bkey(k)
  local rk = rkey(k)
  local a = adds[kind][b]
  if a ~= nil and a.map[rk] ~= nil then
    a.map[rk] = nil
    cnt[kind] = cnt[kind] - 1
    return
  end
  local v = bucket(kind, b)
  local p = find(v, rk)
  if p ~= nil then
    cache[kind][b] = string.sub(v, 1, p - 1) .. string.sub(v, p + W)
    dirty[kind][b] = true
    cnt[kind] = cnt[kind] - 1
  end
end
local function live(kind, k)
  if cnt[kind] <= 0 then return false end
  local b, rk = bkey(k), rkey(k)
  local a = adds[kind][b]
  if a ~= nil and a.map[rk] ~= nil then return exp_at(a.map[rk], 1) > now end
  local v = bucket(kind, b)
  local p = find(v, rk)
  return p ~= nil and exp_at(v, p) > now
end
local function set(kind, k, tier, confirmed, exp, mac)
  if exp <= now then drop(kind, k); return end
  local b = bkey(k)
  local rk = rkey(k)
  local rec = rk .. (TIERB[tier] or struct.pack('>B', tier)) .. ms6(confirmed) .. ms6(exp) .. mac8(mac)
  local a = added(kind, b)
  if a.map[rk] ~= nil then a.map[rk] = rec; return end
  local v = bucket(kind, b)
  local p = find(v, rk)
  if p ~= nil then
    cache[kind][b] = string.sub(v, 1, p - 1) .. rec .. string.sub(v, p + W)
    dirty[kind][b] = true
  else
    a.map[rk] = rec
    a.order[#a.order + 1] = rk
    cnt[kind] = cnt[kind] + 1
  end
end
local function clear(kind)
  redis.call('UNLINK', hkey(kind))
  cleared[kind] = true
  cache[kind], dirty[kind], adds[kind], cnt[kind] = {}, {}, {}, 0
end

for _, op in ipairs(ops) do
  local o = op[1]
  if o == 'p' then
    local kind, tier, confirmed, exp = op[2], op[3], op[4], tonumber(op[5])
    local tbl, src = string.sub(kind, 1, 1), string.sub(kind, 2, 2)
    local macs = op[7] or {}
    prefetch(kind, op[6])
    if cnt[tbl .. (src == 'x' and 'a' or 'x')] > 0 then prefetch(tbl .. (src == 'x' and 'a' or 'x'), op[6]) end
    for i, k in ipairs(op[6]) do
      if src == 'x' then
        drop(tbl .. 'a', k)
        set(kind, k, tier, confirmed, exp, macs[i])
      elseif not live(tbl .. 'x', k) then
        set(kind, k, tier, confirmed, exp, macs[i])
      end
    end
  elseif o == 'r' then
    for _, kind in ipairs({op[2] .. 'x', op[2] .. 'a'}) do
      if cnt[kind] > 0 then prefetch(kind, op[3]) end
    end
    for _, k in ipairs(op[3]) do drop(op[2] .. 'x', k); drop(op[2] .. 'a', k) end
  elseif o == 'R' or o == 'E' then
    local tbl, confirmed = op[2], op[3]
    if o == 'R' then clear(tbl .. 'x') end
    prefetch(tbl .. 'x', op[4], 1)
    if cnt[tbl .. 'a'] > 0 then prefetch(tbl .. 'a', op[4], 1) end
    for _, e in ipairs(op[4]) do
      drop(tbl .. 'a', e[1])
      set(tbl .. 'x', e[1], e[2], confirmed, tonumber(e[3]), e[4])
    end
  elseif o == 'P' then
    for _, kind in ipairs(KINDS) do clear(kind) end
  end
end

-- fold this call's new entries into their buckets
for _, kind in ipairs(KINDS) do
  for b, a in pairs(adds[kind]) do
    local parts = {bucket(kind, b)}
    for _, rk in ipairs(a.order) do
      local rec = a.map[rk]
      if rec ~= nil then parts[#parts + 1] = rec; a.map[rk] = nil end
    end
    cache[kind][b] = table.concat(parts)
    dirty[kind][b] = true
  end
  adds[kind] = {}
end

local function flush(kind)
  local hk = hkey(kind)
  local sets, dels = {}, {}
  for b, _ in pairs(dirty[kind]) do
    local v = cache[kind][b]
    if v == '' then dels[#dels + 1] = b else sets[#sets + 1] = b; sets[#sets + 1] = v end
    if #sets >= 1000 then redis.call('HSET', hk, unpack(sets)); sets = {} end
    if #dels >= 1000 then redis.call('HDEL', hk, unpack(dels)); dels = {} end
  end
  if #sets > 0 then redis.call('HSET', hk, unpack(sets)) end
  if #dels > 0 then redis.call('HDEL', hk, unpack(dels)) end
  dirty[kind] = {}
  if cnt[kind] < 0 then cnt[kind] = 0 end
end
-- written before the sweep, so the sweep (HSCAN) sees this call's new buckets too
for _, kind in ipairs(KINDS) do flush(kind) end

-- a bounded sweep per kind: expired entries go; over the cap, the soonest-expiring
-- entries of the swept buckets go (logged, so the mirrors drop them too)
local evicted = {}
local function sweep(kind, budget)
  local hk = hkey(kind)
  local cursor = redis.call('HGET', st, 'sw:' .. kind) or '0'
  local out = {}
  local seen = 0
  repeat
    local r = redis.call('HSCAN', hk, cursor, 'COUNT', 8)
    cursor = r[1]
    local fv = r[2]
    for i = 1, #fv, 2 do
      local b = fv[i]
      local v = bucket(kind, b)
      local keep, victims = {}, {}
      for p = 1, #v, W do
        local e = exp_at(v, p)
        if e > now then keep[#keep + 1] = {e, p} else cnt[kind] = cnt[kind] - 1 end
      end
      local over = cnt[kind] - caps[kind]
      if over > 0 then
        table.sort(keep, function(x, y) return x[1] < y[1] end)
        local n = math.min(over, #keep)
        for j = 1, n do
          local hi, lo = struct.unpack('>I2I4', v, keep[j][2])
          out[#out + 1] = string.format('%04x%08x', hi, lo) .. b
        end
        cnt[kind] = cnt[kind] - n
        local rest = {}
        for j = n + 1, #keep do rest[#rest + 1] = keep[j] end
        keep = rest
      end
      if #keep * W ~= #v then
        table.sort(keep, function(x, y) return x[2] < y[2] end)
        local parts = {}
        for j = 1, #keep do parts[j] = string.sub(v, keep[j][2], keep[j][2] + W - 1) end
        cache[kind][b] = table.concat(parts)
        dirty[kind][b] = true
      end
      seen = seen + 1
    end
  until cursor == '0' or (seen >= budget and cnt[kind] <= caps[kind]) or seen >= budget * 64
  redis.call('HSET', st, 'sw:' .. kind, cursor)
  if #out > 0 then evicted[#evicted + 1] = {kind, out} end
end
for _, kind in ipairs(KINDS) do
  if cnt[kind] > 0 then sweep(kind, 4) end
end

for _, kind in ipairs(KINDS) do flush(kind) end
redis.call('HSET', st, 'n:gx', cnt.gx, 'n:ga', cnt.ga, 'n:sx', cnt.sx, 'n:sa', cnt.sa)

gen = gen + 1
redis.call('HSET', st, 'gen', gen)
local x = '[]'
if #evicted > 0 then x = cjson.encode(evicted) end
-- the log is for tailing replicas (every sync interval): it keeps `logmax` entries and
-- at most ARGV[10] ms of them, so a snapshot's chunks leave it soon after they are read
redis.call('XADD', log, 'MINID', '~', math.max(0, now - tonumber(ARGV[10])), '*',
  'gen', gen, 'm', mode, 'e', ARGV[2], 's', ARGV[3], 'ops', ARGV[5], 'x', x, 'o', ARGV[7],
  'mac', ARGV[8])
redis.call('XTRIM', log, 'MAXLEN', '~', tonumber(logmax))
redis.call('PEXPIRE', st, retention)
redis.call('PEXPIRE', log, retention)
for _, kind in ipairs(KINDS) do
  if redis.call('EXISTS', hkey(kind)) == 1 then redis.call('PEXPIRE', hkey(kind), retention) end
end
local ep = redis.call('HMGET', st, 'epoch', 'seq')
return {'ok', gen, tonumber(ep[1]) or -1, tonumber(ep[2]) or -1}
""",
)
