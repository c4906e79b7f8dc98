-- quota._sql.statements.PAUSE_SET / PAUSE_LEFT: a key held back until a moment.
-- KEYS: the pause, the index. ARGV: 'set' or 'left', now|'db', seconds (set)
-- The pause is a string: the moment it ends. It only grows; it is kept (with its index
-- entry, so that reset finds it) until it ends, plus the grace.
local now = clock(ARGV[2])
local held = tonumber(redis.call('GET', KEYS[1]) or '0')
if ARGV[1] == 'set' then
  local ends = now + tonumber(ARGV[3])
  if ends > held then
    redis.call('SET', KEYS[1], fmt(ends))
    keep(KEYS[1], KEYS[2], ends, now)
    held = ends
  end
  return {fmt(held), fmt(now)}
end
if held > now then return fmt(held - now) end
return false
