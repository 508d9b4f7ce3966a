-- Placement: a worker takes sessions only while no other live worker with room is less
-- loaded (load / capacity; ties take), one announcement at a time, so sessions spread
-- evenly whether they come one by one or in a burst, from any number of gateways.
-- Sessions whose owner died (pending, idle past ARGV[4] ms; 0 skips the check) come
-- before new ones. A worker that is not the least loaded still takes an announcement
-- that has waited ARGV[5] ms (or an orphan idle that much longer): the least loaded one
-- may be busy with a long final, or dead with its heartbeat not yet lapsed.
-- ARGV: worker id, its capacity, most sessions to take, orphan idle ms, defer ms.
-- Returns {newest announcement id, {id, sid}, ...}.
-- (runs after rules.lua and workers.lua: scripts.py puts them before it)
local me, mycap = ARGV[1], tonumber(ARGV[2])
local free, orphan_ms, defer_ms = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local now = now_ms()
local function newest()
  local e = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
  return e[1] and e[1][1] or '0-0'
end
-- Age of the oldest announcement no worker has taken; -1: none; nil: no group.
local function undelivered_age()
  local groups = redis.pcall('XINFO', 'GROUPS', KEYS[1])
  if groups.err then return nil end
  for _, g in ipairs(groups) do
    local info = {}
    for i = 1, #g, 2 do info[g[i]] = g[i + 1] end
    if info['name'] == GROUP then
      local e = redis.call('XRANGE', KEYS[1], '(' .. info['last-delivered-id'], '+', 'COUNT', 1)
      if #e == 0 then return -1 end
      return now - tonumber(string.match(e[1][1], '^(%d+)'))
    end
  end
  return nil
end
local age = undelivered_age()
if age == nil then return redis.error_reply('NOGROUP the workers group is gone') end
-- Most rounds find nothing to place: answer those without reading every worker's load.
if nothing_to_place(orphan_ms, age) then return {newest()} end
local ids, caps = live_workers(now)
local load = loads()
local mine = load[me] or 0
local best_l, best_c = least_loaded_other(me, ids, caps, load)
local out = {}
while #out < free and mine < mycap do
  local first = is_least(mine, mycap, best_l, best_c)
  local got = {}
  if orphan_ms > 0 then
    local idle = orphan_idle_ms(orphan_ms, defer_ms, first)
    for _, p in ipairs(redis.call('XPENDING', KEYS[1], GROUP, 'IDLE', idle, '-', '+', 10)) do
      if p[2] ~= me then
        got = redis.call('XCLAIM', KEYS[1], GROUP, me, idle, p[1])
        break
      end
    end
  end
  if #got == 0 and takes_new(first, undelivered_age, defer_ms) then
    local r = redis.call('XREADGROUP', 'GROUP', GROUP, me, 'COUNT', 1, 'STREAMS', KEYS[1], '>')
    if r then got = r[1][2] end
  end
  if #got == 0 then break end
  local e = got[1]
  if e[2] then
    out[#out + 1] = {e[1], e[2][2]}
    mine = mine + 1
  else
    redis.call('XACK', KEYS[1], GROUP, e[1])  -- trimmed from the stream: nothing to own
  end
end
table.insert(out, 1, newest())
return out
