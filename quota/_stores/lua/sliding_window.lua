-- quota._algorithms.sliding_step
-- KEYS: the state, the index. ARGV: now|'db', window, limit, cost, ws, weight
-- The state's field i is the horizon it and its index entry are kept until: a call whose
-- expiry stays within it (every call but a window's first) writes the state alone.
local now = clock(ARGV[1])
local window, limit, cost = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local ws, weight = tonumber(ARGV[5]), tonumber(ARGV[6])
if ARGV[1] == 'db' then
  local second = math.floor(now)
  ws = second - second % window
  weight = (window - (now - ws)) / window
end
local row = redis.call('HMGET', KEYS[1], 'v', 'p', 's', 'i')
local value, prev, stamp, allowed = cost, 0.0, ws, true
if row[1] then
  local v, p, s = tonumber(row[1]), tonumber(row[2]), tonumber(row[3])
  local current, previous = 0.0, 0.0
  if s >= ws then
    current, previous = v, p
    -- a late call: as at the start of the row's window, the previous one in full
    if s > ws then weight = 1.0 end
  elseif s == ws - window then
    previous = v
  end
  allowed = previous * weight + current + cost <= limit
  value = current
  if allowed then value = current + cost end
  prev, stamp = previous, math.max(s, ws)
end
local expires = stamp + 2 * window
if row[4] and expires <= tonumber(row[4]) then
  redis.call('HSET', KEYS[1], 'v', fmt(value), 'p', fmt(prev), 's', fmt(stamp))
else
  redis.call('HSET', KEYS[1], 'v', fmt(value), 'p', fmt(prev), 's', fmt(stamp), 'i', fmt(expires))
  keep(KEYS[1], KEYS[2], expires, now)
end
return {fmt(value), fmt(prev), fmt(stamp), allowed and 1 or 0, fmt(now)}
