-- Prepended to every script by quota._stores.redis (__GRACE__ becomes its GRACE).
local function fmt(x) return string.format('%.17g', x) end
local function clock(arg)
  if arg == 'db' then
    local t = redis.call('TIME')
    return tonumber(t[1]) + tonumber(t[2]) / 1000000
  end
  return tonumber(arg)
end
-- Keep `key` until `expires` (+ GRACE), list it in the caller's index under its name past
-- the caller's prefix (`fw:60:1750003200`, `sw:60`), and drop the entries of rows long
-- gone. Not on every call: when a counter is created, and when a state's expiry passes
-- the horizon it was last kept until. The index never expires before a row it lists.
local function keep(key, index, expires, now)
  local grace = __GRACE__
  local ttl = math.ceil((expires - now + grace) * 1000)
  if ttl < 1 then ttl = 1 end
  redis.call('PEXPIRE', key, ttl)
  redis.call('ZADD', index, fmt(expires), string.match(key, '}:(%a+:[%d:]+)$'))
  redis.call('ZREMRANGEBYSCORE', index, '-inf', '(' .. fmt(now - grace))
  if redis.call('PTTL', index) < ttl then redis.call('PEXPIRE', index, ttl) end
end
