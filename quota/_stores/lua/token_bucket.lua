-- quota._algorithms.bucket_step
-- KEYS: the state, the index. ARGV: now|'db', capacity, rate, cost
local now = clock(ARGV[1])
local capacity, rate, cost = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local row = redis.call('HMGET', KEYS[1], 'v', 's')
local tokens, stamp, allowed, expires = capacity - cost, now, true, now + cost / rate
if row[1] then
  local t, s = tonumber(row[1]), tonumber(row[2])
  local refill = math.min(capacity, t + math.max(0.0, now - s) * rate)
  allowed = refill >= cost
  tokens = refill
  if allowed then tokens = refill - cost end
  stamp = math.max(s, now)
  expires = stamp + (capacity - refill + cost) / rate
end
redis.call('HSET', KEYS[1], 'v', fmt(tokens), 's', fmt(stamp))
keep(KEYS[1], KEYS[2], expires, now, not row[1])
return {fmt(tokens), allowed and 1 or 0, fmt(now)}
