-- Token bucket with discrete refills: the state is the debt,
-- capacity + tick × refill − tokens (absent = 0, a full bucket).
local capacity = tonumber(ARGV[5])
local refill = tonumber(ARGV[6])
local interval = tonumber(ARGV[7])
local debt = tonumber(redis.call('GET', KEYS[1]) or '0')
local tick = idiv(now, interval)
-- The debt at which the bucket is empty (tick × refill <= now).
local ceiling = capacity + tick * refill
local function tokens(d)
  return math.min(capacity, math.max(0, ceiling - d))
end
-- Nanoseconds until the tick at which debt d leaves at least want tokens.
local function wait_for(d, want)
  local need = math.max(0, want + d - capacity)
  return math.max(0, ceildiv(need, refill) * interval - now)
end
local have = tokens(debt)
if mode == 'refund' then
  local nxt = math.max(0, ceiling - math.min(capacity, have + cost))
  -- A refund never adds debt (the clock may have gone backwards).
  if nxt < debt then
    redis.call('SET', KEYS[1], int(nxt), 'PX', ttl)
  end
  return {3, 0, 0, 0, 0}
end
local reset = wait_for(debt, capacity)
if cost == 0 then return {0, 0, capacity, have, reset} end
if cost > capacity then return {2, 0, capacity, have, reset} end
if have < cost then
  return {1, wait_for(debt, cost), capacity, have, reset}
end
local left = have - cost
local nxt = ceiling - left
redis.call('SET', KEYS[1], int(nxt), 'PX', ttl)
return {0, 0, capacity, left, wait_for(nxt, capacity)}
