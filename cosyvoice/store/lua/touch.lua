-- A session's client is there though it sends no audio (a keepalive): the sweeper
-- counts the time as activity. Only a session that still exists is touched, so a late
-- keepalive never brings a deleted session's hash back.
-- KEYS[1] session:{SID}    ARGV[1] now (ms)
-- Returns 1 when the session exists, 0 otherwise.
if redis.call('EXISTS', KEYS[1]) == 0 then
  return 0
end
redis.call('HSET', KEYS[1], 'alive_ms', ARGV[1])
return 1
