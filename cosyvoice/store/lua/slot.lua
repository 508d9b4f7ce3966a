-- One client address's session slots: drops lapsed ones, sets (or, with lapse 0, removes)
-- this one's, refuses it past the limit (0 = no check), and lets the key expire with its
-- newest slot. KEYS: client key. ARGV: now ms, session id, lapse ms, limit.
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
local ok = 1
if ARGV[3] == '0' then
  redis.call('ZREM', KEYS[1], ARGV[2])
else
  redis.call('ZADD', KEYS[1], ARGV[3], ARGV[2])
  local limit = tonumber(ARGV[4])
  if limit > 0 and redis.call('ZCARD', KEYS[1]) > limit then
    redis.call('ZREM', KEYS[1], ARGV[2])
    ok = 0
  end
end
local newest = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
if newest[2] then redis.call('PEXPIREAT', KEYS[1], newest[2]) end
return ok
