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


def key16(key: int) -> str:
    return f"{key:016x}"


APPLY = LuaScript(
    "ramjet_residency_apply",
    r"""
-- KEYS: st, log.  ARGV: mode, epoch, seq, retention_ms, ops json, caps "gcap,scap,logmax",
-- origin, batch mac, max clock skew ms.  Returns {status, gen, epoch, seq}.
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
redis.call('XADD', log, 'MAXLEN', '~', tonumber(logmax), '*',
  'gen', gen, 'm', mode, 'e', ARGV[2], 's', ARGV[3], 'ops', ARGV[5], 'x', x, 'o', ARGV[7],
  'mac', ARGV[8])
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
-- KEYS: st, log.  ARGV: after (stream id, or "" for none), count.
-- Returns {gen, epoch, seq, entries, last id}; gen = -1 when st is missing. With
-- after = "" no entries are read and `last id` is the log's newest id (a pull's start).
local cur = redis.call('HMGET', KEYS[1], 'gen', 'epoch', 'seq')
if cur[1] == false then return {-1, -1, -1, {}, ''} end
local entries, last = {}, ''
if ARGV[1] ~= '' then
  entries = redis.call('XRANGE', KEYS[2], '(' .. ARGV[1], '+', 'COUNT', tonumber(ARGV[2]))
else
  local newest = redis.call('XREVRANGE', KEYS[2], '+', '-', 'COUNT', 1)
  if #newest > 0 then last = newest[1][1] end
end
return {tonumber(cur[1]), tonumber(cur[2]) or -1, tonumber(cur[3]) or -1, entries, last}
""",
)
