-- Disconnect: start the grace period, unless another connection has resumed the session
-- since (possibly on another gateway). KEYS: session, audio, text. ARGV: conn, ms.
if redis.call('HGET', KEYS[1], 'conn') ~= ARGV[1] then return 0 end
for _, key in ipairs(KEYS) do redis.call('PEXPIRE', key, ARGV[2]) end
return 1
