-- Renews a lease its owner holds; 1 renewed, 2 renewed and the session's client is gone
-- (its keys expire: the grace period of lua/release_conn.lua, or its end), 0 not ours,
-- -1 the session is gone.
if redis.call('EXISTS', KEYS[2]) == 0 then
  if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
  return -1
end
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
if redis.call('PTTL', KEYS[2]) > 0 then return 2 end
return 1
