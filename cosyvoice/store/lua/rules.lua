-- The control plane's decisions: pure functions of their arguments (no Redis calls), which
-- tests/unit/test_rules.py runs in Lua 5.1 (the version Redis embeds) without Redis.
-- Admission: the session may open while the open sessions are fewer than the live
-- workers' capacity. Returns admitted, capacity.
local function admits(open, caps)
  local capacity = 0
  for _, c in ipairs(caps) do capacity = capacity + c end
  return open < capacity, capacity
end
-- The least loaded other live worker with room (load / capacity): its load and capacity,
-- or nil when there is none.
local function least_loaded_other(me, ids, caps, load)
  local best_l, best_c
  for i, id in ipairs(ids) do
    local c, l = caps[i], load[id] or 0
    if id ~= me and c > 0 and l < c and (best_l == nil or l * best_c < best_l * c) then
      best_l, best_c = l, c
    end
  end
  return best_l, best_c
end
-- Whether a worker with `mine` of `mycap` sessions is the least loaded (ties take).
local function is_least(mine, mycap, best_l, best_c)
  return best_l == nil or mine * best_c <= best_l * mycap
end
-- Nothing can be placed: no orphan check asked for and nothing undelivered (age < 0).
local function nothing_to_place(orphan_ms, age)
  return orphan_ms == 0 and age < 0
end
-- How long a dead owner's session must have been idle before this worker claims it:
-- one lease past its owner's death, and `defer_ms` more unless this worker is the least
-- loaded.
local function orphan_idle_ms(orphan_ms, defer_ms, least)
  return orphan_ms + (least and 0 or defer_ms)
end
-- Whether this worker reads a new announcement: it is the least loaded, or the oldest
-- undelivered one has waited `defer_ms` (`age` is a function: only then is it asked).
local function takes_new(least, age, defer_ms)
  return least or (age() or -1) >= defer_ms
end
