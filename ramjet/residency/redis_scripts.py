"""Key layout and the Lua script that applies one change batch to one engine's tables.

Key layout (`P` is the configured key prefix, `E` the engine id; `{P:E}` is the Redis
Cluster hash tag, so every key of one engine lives in one slot and one script touches
them all atomically):

| key | type | holds | TTL |
|---|---|---|---|
| `{P:E}:st` | hash | `epoch`, `seq` (last report applied), `gen` (change counter) | retention |
| `{P:E}:g:<key16>` | string | `"<tier>,<confirmed_ms>"` of one global-KV entry | its expiry (PXAT) |
| `{P:E}:gi` | zset | global index: key16 → expiry ms (resync, caps, purge) | retention |
| `{P:E}:s:<key16>` | string | `"<confirmed_ms>"` of one SWA entry | its expiry (PXAT) |
| `{P:E}:si` | zset | SWA index: key16 → expiry ms | retention |
| `{P:E}:log` | stream | one entry per applied batch, for the other replicas | retention |

`key16` is the 64-bit prefix key as 16 lower-case hex digits. Retention is the longest
entry TTL plus a slack (a day by default), refreshed on every write, so no key lives
forever and an engine that goes silent leaves nothing behind.

`apply` (below) is atomic and idempotent by (engine, epoch, sequence):
- mode `delta` / `snapshot`: refused as `stale` when `epoch` < the stored epoch, and as
  `dup` when `epoch` equals it and `seq` <= the stored seq, changing nothing. A newer
  epoch purges the engine's entries first (the engine lost its volatile state); a
  snapshot replaces them. Two replicas applying the same report in any order therefore
  leave one result. A replica re-seeding Redis from its local copy sends a snapshot at its
  own (epoch, seq), so it only wins where Redis is behind.
- mode `route`: approximate entries from the router's own routing; unsequenced, always
  applied (puts are idempotent), never touch (epoch, seq).
Then the indexes drop expired members, and caps evict the members that expire soonest
(ZPOPMIN), deleting their keys. The batch, plus any cap evictions and the purge flag, is
appended to the engine's log (XADD MAXLEN ~) with the new `gen`, which replicas tail.

Payload (ARGV[6], JSON): `{"g": [[key16, tier, confirmed_ms, expiry_ms], ...],
"gx": [key16, ...], "s": [[key16, confirmed_ms, expiry_ms], ...], "sx": [key16, ...]}`.
Entries whose expiry is already past are not written. Scripts reach the per-entry keys by
name (built from KEYS[1]'s prefix): legal on Cluster because they share KEYS[1]'s slot.
"""

from __future__ import annotations

import re

from ramjet.redis_link import LuaScript
from ramjet.types import EngineId

_ENGINE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def engine_tag(prefix: str, engine: EngineId) -> str:
    """`{prefix:engine}`: the hash tag shared by all of one engine's keys."""
    if not _ENGINE.match(engine):
        raise ValueError(f"engine id {engine!r} cannot be used in a Redis key")
    return "{" + f"{prefix}:{engine}" + "}"


class EngineKeys:
    """Names of one engine's keys."""

    __slots__ = ("base", "gi", "log", "si", "st", "vc")

    def __init__(self, prefix: str, engine: EngineId) -> None:
        self.base = engine_tag(prefix, engine)
        self.st = f"{self.base}:st"
        self.gi = f"{self.base}:gi"
        self.si = f"{self.base}:si"
        self.log = f"{self.base}:log"
        self.vc = f"{self.base}:vc"
        """The report verifier's shared cursor (see ramjet.reports.redis_cursors)."""

    def g(self, key16: str) -> str:
        return f"{self.base}:g:{key16}"

    def s(self, key16: str) -> str:
        return f"{self.base}:s:{key16}"


def key16(key: int) -> str:
    return f"{key:016x}"


APPLY = LuaScript(
    "ramjet_residency_apply",
    r"""
-- KEYS: st, gi, si, log.  ARGV: mode, epoch, seq, retention_ms, caps "gcap,scap,logmax",
-- payload json.  Returns {status, gen, epoch, seq}.
local st, gi, si, log = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local base = string.sub(st, 1, -4)
local mode = ARGV[1]
local epoch = tonumber(ARGV[2])
local seq = tonumber(ARGV[3])
local retention = tonumber(ARGV[4])
local gcap, scap, logmax = string.match(ARGV[5], "^(%d+),(%d+),(%d+)$")
gcap, scap, logmax = tonumber(gcap), tonumber(scap), tonumber(logmax)
local p = cjson.decode(ARGV[6])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local cur = redis.call('HMGET', st, 'epoch', 'seq', 'gen')
local cepoch, cseq, gen = tonumber(cur[1]), tonumber(cur[2]), tonumber(cur[3]) or 0

local function purge(idx, kind)
  local members = redis.call('ZRANGE', idx, 0, -1)
  for i = 1, #members, 500 do
    local batch = {}
    for j = i, math.min(i + 499, #members) do
      batch[#batch + 1] = base .. ':' .. kind .. ':' .. members[j]
    end
    redis.call('DEL', unpack(batch))
  end
  redis.call('DEL', idx)
end

local purged = 0
if mode ~= 'route' then
  if cepoch ~= nil then
    if epoch < cepoch then return {'stale', gen, cepoch, cseq} end
    if epoch == cepoch and seq <= cseq then return {'dup', gen, cepoch, cseq} end
  end
  if mode == 'snapshot' or (cepoch ~= nil and epoch > cepoch) then
    purge(gi, 'g'); purge(si, 's'); purged = 1
  end
  redis.call('HSET', st, 'epoch', epoch, 'seq', seq)
end

local gx_extra, sx_extra = {}, {}
for _, e in ipairs(p.g or {}) do
  local k, exp = e[1], tonumber(e[4])
  if exp > now then
    redis.call('SET', base .. ':g:' .. k, e[2] .. ',' .. e[3], 'PXAT', exp)
    redis.call('ZADD', gi, exp, k)
  else
    redis.call('DEL', base .. ':g:' .. k); redis.call('ZREM', gi, k)
  end
end
for _, k in ipairs(p.gx or {}) do
  redis.call('DEL', base .. ':g:' .. k); redis.call('ZREM', gi, k)
end
for _, e in ipairs(p.s or {}) do
  local k, exp = e[1], tonumber(e[3])
  if exp > now then
    redis.call('SET', base .. ':s:' .. k, e[2], 'PXAT', exp)
    redis.call('ZADD', si, exp, k)
  else
    redis.call('DEL', base .. ':s:' .. k); redis.call('ZREM', si, k)
  end
end
for _, k in ipairs(p.sx or {}) do
  redis.call('DEL', base .. ':s:' .. k); redis.call('ZREM', si, k)
end

-- expired members (their keys are gone already), then caps: soonest expiry goes first
redis.call('ZREMRANGEBYSCORE', gi, '-inf', now)
redis.call('ZREMRANGEBYSCORE', si, '-inf', now)
local function cap(idx, kind, limit, out)
  local over = redis.call('ZCARD', idx) - limit
  if over > 0 then
    local popped = redis.call('ZPOPMIN', idx, over)
    for i = 1, #popped, 2 do
      redis.call('DEL', base .. ':' .. kind .. ':' .. popped[i])
      out[#out + 1] = popped[i]
    end
  end
end
cap(gi, 'g', gcap, gx_extra)
cap(si, 's', scap, sx_extra)

gen = gen + 1
redis.call('HSET', st, 'gen', gen)
local extra = cjson.encode({gx = gx_extra, sx = sx_extra})
redis.call('XADD', log, 'MAXLEN', '~', logmax, '*',
  'gen', gen, 'm', mode, 'e', epoch, 'q', seq, 'purge', purged, 'p', ARGV[6], 'x', extra)
for _, k in ipairs({st, gi, si, log}) do
  if redis.call('EXISTS', k) == 1 then redis.call('PEXPIRE', k, retention) end
end
local ep = redis.call('HMGET', st, 'epoch', 'seq')
return {'ok', gen, tonumber(ep[1]) or -1, tonumber(ep[2]) or -1}
""",
)
