-- Checks the chunk's seq against the session's next_seq and appends it atomically.
-- Returns {status, next_seq}: 0 appended, 1 duplicate, -1 no session, -3 gap,
-- -4 the stream already ended.
local st = redis.call('HMGET', KEYS[1], 'next_seq', 'status')
if not st[1] then return {-1, 0} end
local nxt = tonumber(st[1])
local seq = tonumber(ARGV[1])
if seq < nxt then return {1, nxt} end
if st[2] ~= 'active' then return {-4, nxt} end
if seq > nxt then return {-3, nxt} end
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[3], '*', 'pb', ARGV[2])
redis.call('HSET', KEYS[1], 'next_seq', nxt + 1, 'rate', ARGV[4])
if ARGV[5] == '1' then redis.call('HSET', KEYS[1], 'status', 'ended') end
return {0, nxt + 1}
