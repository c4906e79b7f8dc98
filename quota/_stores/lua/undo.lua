-- Give a hit back (quota._sql.UNDO_*): where it was counted; a key gone meanwhile stays
-- gone, and no TTL or index entry changes.
-- KEYS: the counter or the state.
-- ARGV: 'fw', cost | 'sw', cost, the window start it was counted in, window |
-- 'tb', cost, capacity | 'gcra', increment.
-- Reply: the count or value left, or nil when there is no key.
local kind = ARGV[1]
if kind == 'fw' then
  if redis.call('EXISTS', KEYS[1]) == 0 then return false end
  local count = redis.call('DECRBY', KEYS[1], tonumber(ARGV[2]))
  if count < 0 then count = redis.call('INCRBY', KEYS[1], -count) end
  return count
end
local row = redis.call('HMGET', KEYS[1], 'v', 'p', 's')
if not row[1] then return false end
local value = tonumber(row[1])
if kind == 'sw' then
  local cost, stamp, window = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
  local s = tonumber(row[3])
  if s == stamp then
    value = math.max(value - cost, 0.0)
    redis.call('HSET', KEYS[1], 'v', fmt(value))
  elseif s == stamp + window then
    redis.call('HSET', KEYS[1], 'p', fmt(math.max(tonumber(row[2]) - cost, 0.0)))
  end
elseif kind == 'tb' then
  value = math.min(value + tonumber(ARGV[2]), tonumber(ARGV[3]))
  redis.call('HSET', KEYS[1], 'v', fmt(value))
else
  value = value - tonumber(ARGV[2])
  redis.call('HSET', KEYS[1], 'v', fmt(value))
end
return fmt(value)
