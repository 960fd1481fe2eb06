-- Token bucket with discrete refills at every multiple of the interval
-- (since the Unix epoch). The core keeps a debt, capacity + tick × refill
-- − tokens, whose tick count since the epoch a double cannot hold; here
-- the state is "T v": v tokens (0 to capacity) at the tick that starts at
-- T (decimal Unix ns), which decides alike — at a later tick the level is
-- v + ticks since × refill, then clamped to 0..capacity. Absent = full.
RATE.token_bucket = function(key, mode, cost, ttl, p)
  local capacity = tonumber(p[1])
  local refill = tonumber(p[2])
  local interval = tonumber(p[3])
  -- Now's tick started `phase` ns ago.
  local _, phase = divnow(interval)
  -- The level at now's tick before clamping: above capacity for an idle
  -- key, below 0 when the clock went back. A refill is at most one token
  -- per ns, so ticks × refill stays within 2^53 (or far past capacity).
  local level = FAR
  local raw = get(key)
  if raw then
    local t, v = string.match(raw, '^(%d+) (%d+)$')
    local at = since(t)
    v = count_of(v)
    if at and v then
      level = v + idiv(-phase - at, interval) * refill
    else
      redis.call('DEL', key)
    end
  end
  local have = math.min(capacity, math.max(0, level))
  -- Nanoseconds until the tick at which a level of lvl now holds want tokens.
  local function wait_for(lvl, want)
    if want <= lvl then return 0 end
    return ceildiv(want - lvl, refill) * interval - phase
  end
  local function store(v)
    redis.call('SET', key, stamp(-phase) .. ' ' .. v, 'PX', ttl)
  end
  if mode == 'refund' then
    local nxt = math.min(capacity, have + cost)
    -- A refund never lowers the level (the clock may have gone backwards).
    if nxt > level then store(nxt) end
    return {3, 0, 0, 0, 0}
  end
  local reset = wait_for(level, capacity)
  if cost == 0 then return {0, 0, capacity, have, reset} end
  if cost > capacity then return {2, 0, capacity, have, reset} end
  if have < cost then
    return {1, wait_for(level, cost), capacity, have, reset}
  end
  local left = have - cost
  write(function() store(left) end)
  return {0, 0, capacity, left, wait_for(left, capacity)}
end
