-- The fixed window (quota._sql.HIT, HIT_CAPPED and the database clock's form).
-- KEYS: the counter's key without its window start, the index.
-- ARGV: now|'db', window, cost, limit|'' (capped), window start
local now = clock(ARGV[1])
local window, cost = tonumber(ARGV[2]), tonumber(ARGV[3])
local start = tonumber(ARGV[5])
if ARGV[1] == 'db' then
  local second = math.floor(now)
  start = second - second % window
end
local suffix = string.format('%d', start)
local key = KEYS[1] .. suffix
if ARGV[4] ~= '' then
  local current = redis.call('GET', key)
  if current and tonumber(current) + cost > tonumber(ARGV[4]) then return false end
end
local count = redis.call('INCRBY', key, cost)
if count == cost then keep(key, KEYS[2], start + window, now, true) end
return {count, suffix, fmt(now)}
