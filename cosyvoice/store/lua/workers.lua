-- The control plane's prelude: live workers and their loads (runs after rules.lua).
-- These scripts take KEYS sessions, workers, worker_capacity, in that order. Liveness is
-- judged by Redis's own clock (TIME), so hosts whose clocks differ agree on it. A worker's
-- load is the number of announcements pending with it in the consumer group: it owns a
-- session exactly while it holds that session's announcement, so the count changes in the
-- same step as the ownership (XREADGROUP, XCLAIM, XACK) and is never stale.
--
-- The decisions themselves are pure Lua functions of their arguments (rules.lua, no
-- redis.call): tests/unit/test_rules.py runs them in Lua 5.1, the version Redis embeds, without
-- Redis. The scripts gather the inputs, call a rule, and carry out its answer. GROUP, the
-- consumer group's name, is set by the line cosyvoice/store/scripts.py puts before this file.
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function live_workers(now)
  local ids = redis.call('ZRANGEBYSCORE', KEYS[2], now, '+inf')
  local caps = {}
  if #ids > 0 then caps = redis.call('HMGET', KEYS[3], unpack(ids)) end
  for i = 1, #ids do caps[i] = tonumber(caps[i]) or 0 end
  return ids, caps
end
local function loads()
  local out = {}
  local p = redis.pcall('XPENDING', KEYS[1], GROUP)
  if type(p) == 'table' and not p.err and type(p[4]) == 'table' then
    for _, c in ipairs(p[4]) do out[c[1]] = tonumber(c[2]) end
  end
  return out
end
