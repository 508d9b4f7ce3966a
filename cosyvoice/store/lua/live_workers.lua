-- The live workers: {id, capacity, load} flattened.
-- (runs after rules.lua and workers.lua: scripts.py puts them before it)
local ids, caps = live_workers(now_ms())
local load = loads()
local out = {}
for i, id in ipairs(ids) do
  out[#out + 1] = id; out[#out + 1] = caps[i]; out[#out + 1] = load[id] or 0
end
return out
