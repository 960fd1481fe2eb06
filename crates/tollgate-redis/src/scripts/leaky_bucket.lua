-- Leaky bucket as a pacer: the state is the tail of the queue (absent = 0).
local interval = tonumber(ARGV[5])
local max_delay = tonumber(ARGV[6])
local limit = idiv(max_delay, interval) + 1
local tat = tonumber(redis.call('GET', KEYS[1]) or '0')
local start = math.max(tat, now)
local reset = start - now
-- Unit requests that could be admitted now with a queue ending at t >= now.
local function remaining(t)
  local queued = t - now
  if queued > max_delay then return 0 end
  return idiv(max_delay - queued, interval) + 1
end
if mode == 'refund' then
  if tat > now then
    redis.call('SET', KEYS[1], int(math.max(now, tat - interval * cost)), 'PX', ttl)
  end
  return {3, 0, 0, 0, 0}
end
if cost == 0 then return {0, 0, limit, remaining(start), reset} end
-- The wait of the request's own units (past 2^53 it is still > max_delay).
local own = interval * (cost - 1)
if own > max_delay then return {2, 0, limit, remaining(start), reset} end
local delay = reset + own
if delay > max_delay then
  return {1, delay - max_delay, limit, remaining(start), reset}
end
local nxt = start + interval * cost
redis.call('SET', KEYS[1], int(nxt), 'PX', ttl)
return {0, delay, limit, remaining(nxt), nxt - now}
