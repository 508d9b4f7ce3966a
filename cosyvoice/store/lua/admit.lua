-- Admission: announce the session only while the open sessions (announced and not ended)
-- are fewer than the live workers' capacity, in one atomic step, so concurrent connects
-- on any number of gateways never exceed it. ARGV: session id, stream maxlen.
-- Returns {1, announcement id, capacity} or {0, open sessions, capacity}.
-- (runs after rules.lua and workers.lua: scripts.py puts them before it)
local _, caps = live_workers(now_ms())
local open = redis.call('XLEN', KEYS[1])
local admitted, capacity = admits(open, caps)
if not admitted then return {0, open, capacity} end
local id = redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[2], '*', 'sid', ARGV[1])
return {1, id, capacity}
