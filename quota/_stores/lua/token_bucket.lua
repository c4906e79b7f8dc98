-- quota._algorithms.bucket_step
-- KEYS: the state, the index. ARGV: now|'db', capacity, rate, cost
-- The state's field i is the horizon it and its index entry are kept until: its expiry
-- plus a full refill when last kept. Calls whose expiry stays within it write the state alone.
local now = clock(ARGV[1])
local capacity, rate, cost = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local row = redis.call('HMGET', KEYS[1], 'v', 's', 'i')
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
if row[3] and expires <= tonumber(row[3]) then
  redis.call('HSET', KEYS[1], 'v', fmt(tokens), 's', fmt(stamp))
else
  local horizon = expires + capacity / rate
  redis.call('HSET', KEYS[1], 'v', fmt(tokens), 's', fmt(stamp), 'i', fmt(horizon))
  keep(KEYS[1], KEYS[2], horizon, now)
end
return {fmt(tokens), allowed and 1 or 0, fmt(now)}
