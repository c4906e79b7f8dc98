-- quota._algorithms.gcra_step
-- KEYS: the state, the index. ARGV: now|'db', increment, tolerance
local now = clock(ARGV[1])
local increment, tolerance = tonumber(ARGV[2]), tonumber(ARGV[3])
local stored = redis.call('HGET', KEYS[1], 'v')
local tat, allowed = now + increment, true
if stored then
  tat = tonumber(stored)
  local arrival = math.max(tat, now) + increment
  allowed = math.max(tat - now, 0.0) + increment <= tolerance
  if allowed then tat = arrival end
end
redis.call('HSET', KEYS[1], 'v', fmt(tat))
keep(KEYS[1], KEYS[2], tat, now, not stored)
return {fmt(tat), allowed and 1 or 0, fmt(now)}
