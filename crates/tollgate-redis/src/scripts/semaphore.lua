-- Semaphore: KEYS[1] is a sorted set of leases, members "id:permits"
-- scored by their expiry; KEYS[2] counts lease ids. ARGV[2] is the
-- permits to acquire ('a'), or the lease ("id:permits") to release ('x')
-- or renew ('n'). Ids and permits are far below 10^14, so Lua's
-- concatenation (14 significant digits) writes members exactly.
local max = tonumber(ARGV[5])
local lease_ttl = tonumber(ARGV[6])
local key, ids = KEYS[1], KEYS[2]
-- Leases that lapsed are dropped, as the core drops them on every call.
redis.call('ZREMRANGEBYSCORE', key, '-inf', int(now))
if mode == 'x' then
  -- Lapsed leases are gone already: a score here is a live lease.
  if redis.call('ZREM', key, ARGV[2]) == 1 then return {1} end
  return {0}
end
if mode == 'n' then
  local score = redis.call('ZSCORE', key, ARGV[2])
  if not score then return {0} end
  -- A renewal never shortens a lease (as it would with the clock back).
  local expires = math.max(tonumber(score), now + lease_ttl)
  redis.call('ZADD', key, int(expires), ARGV[2])
  redis.call('PEXPIRE', key, ttl)
  redis.call('PEXPIRE', ids, ttl)
  return {1}
end
local permits = cost
-- Live leases by expiry, soonest first.
local raw = redis.call('ZRANGE', key, 0, -1, 'WITHSCORES')
local held, top_id, reset = 0, 0, 0
local leases = {}
for j = 1, #raw, 2 do
  local id, p = string.match(raw[j], '^(%d+):(%d+)$')
  local expires = tonumber(raw[j + 1])
  id, p = tonumber(id), tonumber(p)
  held = held + p
  top_id = math.max(top_id, id)
  reset = math.max(reset, expires - now)
  leases[#leases + 1] = {expires, p}
end
local remaining = math.max(0, max - held)
if permits == 0 then return {0, 0, max, remaining, reset, 0} end
if permits > max then return {2, 0, max, remaining, reset, 0} end
if held + permits > max then
  -- Upper bound: when enough leases would lapse if none is released.
  local excess = held + permits - max
  local freed, retry = 0, lease_ttl
  for _, l in ipairs(leases) do
    freed = freed + l[2]
    if freed >= excess then
      retry = l[1] - now
      break
    end
  end
  return {1, math.max(retry, 1), max, remaining, reset, 0}
end
local id = redis.call('INCR', ids)
-- Never reuse the id of a live lease, should the counter have expired.
if id <= top_id then
  id = top_id + 1
  redis.call('SET', ids, int(id))
end
redis.call('PEXPIRE', ids, ttl)
redis.call('ZADD', key, int(now + lease_ttl), id .. ':' .. permits)
redis.call('PEXPIRE', key, ttl)
return {0, 0, max, remaining - permits, math.max(reset, lease_ttl), id}
