-- Concurrency leases (quota._sql.statements' LEASE_* statements), one script for each step.
-- KEYS: the key's lease set (holder -> expiry), its details (holder -> 'slot slots acquired').
-- ARGV[1]: the step; ARGV[2]: now ('db': Redis's TIME); the rest as each step says.
-- A lease whose expiry has passed is a free slot: `acquire` drops those first.
local step, now = ARGV[1], clock(ARGV[2])
local function hold(expires)
  local ttl = math.ceil((expires - now + __GRACE__) * 1000)
  if ttl < 1 then ttl = 1 end
  for _, key in ipairs(KEYS) do
    if redis.call('PTTL', key) < ttl then redis.call('PEXPIRE', key, ttl) end
  end
end
local function live()
  return redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. fmt(now), '+inf', 'WITHSCORES')
end
if step == 'acquire' then
  -- ARGV: holder, slots, first, horizon. Returns the slot taken, or nil when all are held.
  local holder, slots, first = ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5])
  local dead = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', fmt(now))
  if #dead > 0 then
    redis.call('ZREM', KEYS[1], unpack(dead))
    redis.call('HDEL', KEYS[2], unpack(dead))
  end
  if redis.call('ZCARD', KEYS[1]) >= slots then return false end
  local used = {}
  for _, details in ipairs(redis.call('HVALS', KEYS[2])) do
    used[tonumber(string.match(details, '^(%d+)'))] = true
  end
  local slot = 0
  for n = 0, slots - 1 do
    slot = (n + first) % slots
    if not used[slot] then break end
  end
  local expires = now + tonumber(ARGV[6])
  redis.call('ZADD', KEYS[1], fmt(expires), holder)
  redis.call('HSET', KEYS[2], holder, slot .. ' ' .. slots .. ' ' .. fmt(now))
  hold(expires)
  return slot
elseif step == 'renew' then
  -- ARGV: holder, horizon. Returns 1, or nil when the lease is no longer the holder's.
  if not redis.call('ZSCORE', KEYS[1], ARGV[3]) then return false end
  local expires = now + tonumber(ARGV[4])
  redis.call('ZADD', KEYS[1], fmt(expires), ARGV[3])
  hold(expires)
  return 1
elseif step == 'release' then
  -- ARGV: holder. Returns the leases freed (0 or 1).
  redis.call('HDEL', KEYS[2], ARGV[3])
  return redis.call('ZREM', KEYS[1], ARGV[3])
elseif step == 'holders' then
  -- Returns slot, holder, slots, acquired, expiry of each live lease, flat.
  local rows = {}
  local held = live()
  for i = 1, #held, 2 do
    local details = redis.call('HGET', KEYS[2], held[i]) or '0 0 0'
    local slot, slots, acquired = string.match(details, '^(%S+) (%S+) (%S+)$')
    for _, value in ipairs({slot, held[i], slots, acquired, held[i + 1]}) do
      rows[#rows + 1] = value
    end
  end
  return rows
end
-- 'summary': live leases, the largest limit they were taken under, the next expiry.
local held, most, first = live(), 0, nil
for i = 1, #held, 2 do
  local details = redis.call('HGET', KEYS[2], held[i]) or '0 0 0'
  most = math.max(most, tonumber(string.match(details, '^%S+ (%S+)')))
  if first == nil then first = held[i + 1] end
end
return {#held / 2, most, first or '0'}
