-- Resume: the session's keys stop expiring and the new connection becomes its owner.
-- KEYS: session, audio, text. ARGV: connection id. Returns the session hash, or {}.
if redis.call('EXISTS', KEYS[1]) == 0 then return {} end
for _, key in ipairs(KEYS) do redis.call('PERSIST', key) end
redis.call('HSET', KEYS[1], 'conn', ARGV[1])
return redis.call('HGETALL', KEYS[1])
