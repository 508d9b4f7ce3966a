-- Appends results to the replay stream and publishes each, but only while the session
-- exists (a stopped session must not be recreated). KEYS: session, text, audio.
-- ARGV: maxlen, ttl, checkpoint or '', done flag, results... The replay stream lives as
-- long as a disconnected session, else ttl; a finished session's keys get ttl too, so a
-- client that never disconnects leaves nothing behind. The published message is
-- "<stream id> <json>", so clients can resume after an id.
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local ttl = redis.call('PTTL', KEYS[1])
for i = 5, #ARGV do
  local id = redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[1], '*', 'r', ARGV[i])
  redis.call('PUBLISH', KEYS[2], id .. ' ' .. ARGV[i])
end
if ttl > 0 then redis.call('PEXPIRE', KEYS[2], ttl) else redis.call('EXPIRE', KEYS[2], ARGV[2]) end
if ARGV[3] ~= '' then redis.call('HSET', KEYS[1], 'checkpoint', ARGV[3]) end
if ARGV[4] == '1' and ttl < 0 then
  for _, key in ipairs(KEYS) do redis.call('EXPIRE', key, ARGV[2]) end
end
return 1
