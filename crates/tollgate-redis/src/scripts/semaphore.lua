-- Semaphore: leases with expiry, as tollgate_core::Semaphore.
-- KEYS[1] a sorted set of the leases, members "id:permits" scored by their
-- expiry in ns after a base second — a double holds ns exactly for 104
-- days after it, not since 1970 — and the member "base:<Unix seconds>",
-- scored -inf, that holds the base; KEYS[2] a hash: 'held', the permits of
-- the leases in KEYS[1]. Both share KEYS[1]'s hash tag (one Cluster slot)
-- and its TTL. The base is set by the first lease and moved to now, every
-- score with it, once it is more than 2^51 ns (26 days) off, so that
-- scores stay exact.
-- ARGV[1] the mode: 'acquire' (ARGV[2] permits, ARGV[8] the ceiling,
-- already clamped to max, ARGV[9] the new lease's id, chosen by the
-- client, ARGV[10..] leases of this key the client released whose
-- releases may still be on their way: released first), 'release' or
-- 'renew' (ARGV[8..] leases of this key,
-- "id:permits"), 'held'. ARGV[5] max, ARGV[6] the lease TTL in ns,
-- ARGV[7] a denial's retry hint in ns.
-- Ids are the client's (random, up to 19 digits) and handled as strings
-- only: a double would round them. An acquire whose member is already in
-- the set takes nothing and answers kind 3, so that a lease is only ever
-- renewed and released by the holder that took it.
-- Cost in the number n of leases: acquire, held, release and renew of one
-- lease are O(log n), plus O(log n) for each lapsed lease they drop; a
-- lease is dropped once, so that is amortised O(log n) too. Permits are
-- far below 10^14, so Lua's concatenation (14 significant digits) writes
-- them exactly.
local max = tonumber(ARGV[5])
local lease_ttl = tonumber(ARGV[6])
local retry_after = tonumber(ARGV[7])
local key, meta = KEYS[1], KEYS[2]
-- 2^51 ns, in seconds.
local REBASE = 2251799

local function main()
  local first = redis.pcall('ZRANGE', key, 0, 0, 'WITHSCORES')
  if first.err then
    redis.call('DEL', key)
    first = {}
  end
  -- Unix seconds; nil until the first lease.
  local base
  if first[1] then
    base = first[2] == '-inf' and count_of(string.match(first[1], '^base:(%d+)$'))
    if not base then corrupt() end
  end
  local function set_base(s)
    if base then redis.call('ZREM', key, 'base:' .. base) end
    redis.call('ZADD', key, '-inf', 'base:' .. s)
    base = s
  end
  if base and math.abs(now_s - base) > REBASE then
    -- Inexact only far past 2^53, where the clamp decides alike.
    local shift = (now_s - base) * NS
    local leases = redis.call('ZRANGE', key, 1, -1, 'WITHSCORES')
    for i = 1, #leases, 2 do
      local score = math.max(-FAR, math.min(FAR, tonumber(leases[i + 1]) - shift))
      redis.call('ZADD', key, score, leases[i])
    end
    set_base(now_s)
  end
  -- Now as a score.
  local now = now_n
  if base then now = (now_s - base) * NS + now_n end

  local function permits_of(member)
    local p = count_of(string.match(member, '^%d+:(%d+)$'))
    if not p then corrupt() end
    return p
  end

  -- Writers keep both keys for another lease TTL (plus a margin), and at
  -- least a second past the latest lease held (a binding of the rule with
  -- a shorter TTL, in a rolling deploy, must not cut another's lease
  -- short). The latest lease is the last member: O(log n).
  local function touch()
    local keep = tonumber(ttl)
    local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
    local score = tonumber(last[2])
    if score and score > now then
      keep = math.max(keep, math.ceil((score - now) / 1000000) + 1000)
    end
    redis.call('PEXPIRE', key, keep)
    redis.call('PEXPIRE', meta, keep)
  end

  -- The permits held as the hash counts them, or nil if it does not (a
  -- hash that is not ours is deleted).
  local function counted()
    local h = redis.pcall('HGET', meta, 'held')
    if type(h) == 'table' then
      redis.call('DEL', meta)
      return nil
    end
    local held = count_of(h)
    if h and not held then
      redis.call('DEL', meta)
      return nil
    end
    return held
  end

  -- Drops the leases that lapsed at `now` (as the core drops them on every
  -- call) and returns the permits the live ones hold.
  local function live_held()
    local lapsed = redis.call('ZRANGEBYSCORE', key, '(-inf', now)
    local live = redis.call('ZCARD', key) - #lapsed
    if base then live = live - 1 end
    local held = counted()
    if #lapsed > 0 then
      redis.call('ZREMRANGEBYSCORE', key, '(-inf', now)
    end
    if live == 0 then
      if held and held ~= 0 then redis.call('HSET', meta, 'held', 0) end
      return 0
    end
    if not held then
      -- The hash is gone (evicted) while leases live: count them once.
      local sum = 0
      for _, m in ipairs(redis.call('ZRANGE', key, 1, -1)) do
        sum = sum + permits_of(m)
      end
      redis.call('HSET', meta, 'held', sum)
      touch()
      return sum
    end
    local freed = 0
    for _, m in ipairs(lapsed) do freed = freed + permits_of(m) end
    if freed > 0 then return redis.call('HINCRBY', meta, 'held', -freed) end
    return held
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
    local held = live_held()
    local expires, flags, renewed = now + lease_ttl, {}, false
    -- Whether this call found the key lost and set it up again.
    local lost = false
    for i = 8, #ARGV do
      local score = redis.call('ZSCORE', key, ARGV[i])
      if score then
        -- A renewal never shortens a lease (as it would with the clock back).
        if tonumber(score) < expires then
          redis.call('ZADD', key, expires, ARGV[i])
        end
        renewed = true
        flags[#flags + 1] = 1
      else
        -- A live holder renews a lease of a key Redis lost whole (a
        -- failover, a restart without persistence: no base either): counted
        -- again where it fits, so that new acquires do not take the permits
        -- its work still holds. (A key that is there and lacks the lease
        -- released it, or let it lapse: not counted again.)
        local p = permits_of(ARGV[i])
        if (lost or not base) and held + p <= max then
          if not base then
            lost = true
            set_base(now_s)
            now = now_n
            expires = now + lease_ttl
          end
          redis.call('ZADD', key, expires, ARGV[i])
          redis.call('HINCRBY', meta, 'held', p)
          held = held + p
          renewed = true
          flags[#flags + 1] = 1
        else
          flags[#flags + 1] = 0
        end
      end
    end
    if renewed then touch() end
    return flags
  end

  -- acquire
  local permits = cost
  local ceiling = tonumber(ARGV[8])
  local id = ARGV[9]
  if type(id) ~= 'string' or #id > 19 or not string.find(id, '^%d+$') then
    return redis.error_reply('tollgate: a lease id must be a decimal number')
  end
  local held = live_held()
  local freed = 0
  for i = 10, #ARGV do
    if redis.call('ZREM', key, ARGV[i]) == 1 then freed = freed + permits_of(ARGV[i]) end
  end
  if freed > 0 then
    held = redis.call('HINCRBY', meta, 'held', -freed)
    touch()
  end
  local remaining = math.max(0, ceiling - held)
  -- Until the budget is whole: until the latest lease lapses.
  local reset = 0
  local latest = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
  if latest[2] and latest[2] ~= '-inf' then reset = math.max(0, tonumber(latest[2]) - now) end
  if permits == 0 then return {0, 0, max, remaining, reset} end
  if permits > ceiling then return {2, 0, max, remaining, reset} end
  if held + permits > ceiling then
    return {1, retry_after, max, remaining, reset}
  end
  local member = id .. ':' .. ARGV[2]
  if redis.call('ZSCORE', key, member) then
    return {3, 0, max, remaining, reset}
  end
  if not base then
    set_base(now_s)
    now = now_n
  end
  redis.call('ZADD', key, now + lease_ttl, member)
  redis.call('HINCRBY', meta, 'held', permits)
  touch()
  return {0, 0, max, remaining - permits, math.max(reset, lease_ttl)}
end
return guarded(main)
