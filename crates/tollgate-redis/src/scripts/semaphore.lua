-- Semaphore: leases with expiry, as tollgate_core::Semaphore.
-- KEYS[1] a sorted set of the leases, members "id:permits" scored by their
-- expiry (ns); KEYS[2] a hash: 'held', the permits of the leases in
-- KEYS[1], and 'next', the last lease id given. Both share KEYS[1]'s hash
-- tag (one Cluster slot) and its TTL.
-- ARGV[1] the mode: 'acquire' (ARGV[2] permits, ARGV[8] the ceiling,
-- already clamped to max), 'release' or 'renew' (ARGV[8..] leases of this
-- key, "id:permits"), 'held'. ARGV[5] max, ARGV[6] the lease TTL in ns,
-- ARGV[7] a denial's retry hint in ns.
-- Cost in the number n of leases: acquire, held, release and renew of one
-- lease are O(log n), plus O(log n) for each lapsed lease they drop; a
-- lease is dropped once, so that is amortised O(log n) too. Ids and
-- permits are far below 10^14, so Lua's concatenation (14 significant
-- digits) writes members exactly.
local max = tonumber(ARGV[5])
local lease_ttl = tonumber(ARGV[6])
local retry_after = tonumber(ARGV[7])
local key, meta = KEYS[1], KEYS[2]

local function permits_of(member)
  return tonumber(string.match(member, ':(%d+)$')) or 0
end

-- Writers keep both keys for another lease TTL (plus a margin).
local function touch()
  redis.call('PEXPIRE', key, ttl)
  redis.call('PEXPIRE', meta, ttl)
end

-- Drops the leases that lapsed at `now` (as the core drops them on every
-- call) and returns the permits the live ones hold.
local function live_held()
  local lapsed = redis.call('ZRANGEBYSCORE', key, '-inf', int(now))
  local live = redis.call('ZCARD', key) - #lapsed
  local held = redis.call('HGET', meta, 'held')
  if #lapsed > 0 then
    redis.call('ZREMRANGEBYSCORE', key, '-inf', int(now))
  end
  if live == 0 then
    if held and held ~= '0' then redis.call('HSET', meta, 'held', 0) end
    return 0
  end
  if not held then
    -- The hash is gone (evicted) while leases live: count them once, and
    -- never give a live lease's id again.
    local sum, top = 0, tonumber(redis.call('HGET', meta, 'next') or '0')
    for _, m in ipairs(redis.call('ZRANGE', key, 0, -1)) do
      sum = sum + permits_of(m)
      top = math.max(top, tonumber(string.match(m, '^(%d+):')) or 0)
    end
    redis.call('HSET', meta, 'held', int(sum), 'next', int(top))
    touch()
    return sum
  end
  local freed = 0
  for _, m in ipairs(lapsed) do freed = freed + permits_of(m) end
  if freed > 0 then return redis.call('HINCRBY', meta, 'held', -freed) end
  return tonumber(held)
end

if mode == 'held' then return {live_held()} end

if mode == 'release' then
  live_held()
  local freed, flags = 0, {}
  for i = 8, #ARGV do
    -- Lapsed leases are gone already: a member here is a live lease.
    local removed = redis.call('ZREM', key, ARGV[i])
    if removed == 1 then freed = freed + permits_of(ARGV[i]) end
    flags[#flags + 1] = removed
  end
  if freed > 0 then
    redis.call('HINCRBY', meta, 'held', -freed)
    touch()
  end
  return flags
end

if mode == 'renew' then
  live_held()
  local expires, flags, renewed = now + lease_ttl, {}, false
  for i = 8, #ARGV do
    local score = redis.call('ZSCORE', key, ARGV[i])
    if score then
      -- A renewal never shortens a lease (as it would with the clock back).
      if tonumber(score) < expires then
        redis.call('ZADD', key, int(expires), ARGV[i])
      end
      renewed = true
      flags[#flags + 1] = 1
    else
      flags[#flags + 1] = 0
    end
  end
  if renewed then touch() end
  return flags
end

-- acquire
local permits = cost
local ceiling = tonumber(ARGV[8])
local held = live_held()
local remaining = math.max(0, ceiling - held)
-- Until the budget is whole: until the latest lease lapses.
local reset = 0
local latest = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
if latest[2] then reset = math.max(0, tonumber(latest[2]) - now) end
if permits == 0 then return {0, 0, max, remaining, reset, 0} end
if permits > ceiling then return {2, 0, max, remaining, reset, 0} end
if held + permits > ceiling then
  return {1, retry_after, max, remaining, reset, 0}
end
local id = redis.call('HINCRBY', meta, 'next', 1)
redis.call('ZADD', key, int(now + lease_ttl), id .. ':' .. permits)
redis.call('HINCRBY', meta, 'held', permits)
touch()
return {0, 0, max, remaining - permits, math.max(reset, lease_ttl), id}
