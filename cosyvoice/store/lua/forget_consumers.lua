-- Deletes the named consumers from the group, each only while it holds no announcement
-- (deleting one that does would drop those from the pending list, where nobody could take
-- them over). KEYS: sessions. ARGV: consumer names. Returns how many were deleted. GROUP,
-- the consumer group's name, is set by the line cosyvoice/store/scripts.py puts before this file.
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local ok, consumers = pcall(redis.call, 'XINFO', 'CONSUMERS', KEYS[1], GROUP)
if not ok then return 0 end
local named = {}
for i = 1, #ARGV do named[ARGV[i]] = true end
local n = 0
for _, c in ipairs(consumers) do
  local info = {}
  for i = 1, #c, 2 do info[c[i]] = c[i + 1] end
  if named[info['name']] and tonumber(info['pending']) == 0 then
    redis.call('XGROUP', 'DELCONSUMER', KEYS[1], GROUP, info['name'])
    n = n + 1
  end
end
return n
