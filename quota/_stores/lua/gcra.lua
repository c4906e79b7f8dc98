-- quota._algorithms.gcra_step
-- KEYS: the state, the index. ARGV: now|'db', increment, tolerance
-- The state's field i is the horizon it and its index entry are kept until: its theoretical
-- arrival time plus the tolerance when last kept. Calls within it write the state alone.
local now = clock(ARGV[1])
local increment, tolerance = tonumber(ARGV[2]), tonumber(ARGV[3])
local row = redis.call('HMGET', KEYS[1], 'v', 'i')
local tat, allowed = now + increment, true
if row[1] then
  tat = tonumber(row[1])
  local arrival = math.max(tat, now) + increment
  allowed = math.max(tat - now, 0.0) + increment <= tolerance
  if allowed then tat = arrival end
end
if row[2] and tat <= tonumber(row[2]) then
  redis.call('HSET', KEYS[1], 'v', fmt(tat))
else
  local horizon = tat + tolerance
  redis.call('HSET', KEYS[1], 'v', fmt(tat), 'i', fmt(horizon))
  keep(KEYS[1], KEYS[2], horizon, now)
end
return {fmt(tat), allowed and 1 or 0, fmt(now)}
