-- quota._ops.reset: every row of one caller's key, of one kind (and window).
-- KEYS: the index, the caller's key prefix. ARGV: 'fw' (counters) or 'state', window or ''
local deleted = 0
for _, member in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  local kind, window = string.match(member, '^(%a+):(%d+)')
  if ((kind == 'fw') == (ARGV[1] == 'fw')) and (ARGV[2] == '' or window == ARGV[2]) then
    deleted = deleted + redis.call('DEL', KEYS[2] .. member)
    redis.call('ZREM', KEYS[1], member)
  end
end
return deleted
