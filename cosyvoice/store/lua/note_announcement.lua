-- Records a session's announcement in its hash, but only while the session exists: a
-- session deleted meanwhile (stopped, expired) must not come back as a hash holding
-- nothing else. KEYS: session. ARGV: announcement id. Returns 1, or 0 when the session
-- is gone.
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'announcement', ARGV[1])
return 1
