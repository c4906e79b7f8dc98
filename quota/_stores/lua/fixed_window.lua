-- The fixed window (quota._sql.HIT, HIT_CAPPED and their database-clock forms).
-- KEYS: the counter (with the database clock: the counter's key less its window start),
-- the index.
-- ARGV: cost, now|'db', limit (capped hits only).
-- Reply: the count, or nil for a capped hit denied (not counted); with the database
-- clock {count, window start, now}. Only a new counter touches the index.
local cost = tonumber(ARGV[1])
local key, now, start = KEYS[1], ARGV[2], nil
if now == 'db' then
  now = clock(now)
  local second = math.floor(now)
  start = second - second % tonumber(string.match(key, ':(%d+):$'))
  key = key .. string.format('%d', start)
end
if ARGV[3] then
  local current = redis.call('GET', key)
  if current and tonumber(current) + cost > tonumber(ARGV[3]) then return false end
end
local count = redis.call('INCRBY', key, cost)
if count == cost then
  local window, first = string.match(key, ':(%d+):(%d+)$')
  keep(key, KEYS[2], tonumber(first) + tonumber(window), tonumber(now))
end
if start then return {count, string.format('%d', start), fmt(now)} end
return count
