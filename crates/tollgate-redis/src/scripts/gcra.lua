-- GCRA: the state is the theoretical arrival time (absent = fresh).
local interval = tonumber(ARGV[5])
local burst = tonumber(ARGV[6])
local tau = interval * burst
local tat = tonumber(redis.call('GET', KEYS[1]) or '0')
local start = math.max(tat, now)
local function remaining(t)
  local used = t - now
  if used >= tau then return 0 end
  return idiv(tau - used, interval)
end
if mode == 'refund' then
  if tat > now then
    redis.call('SET', KEYS[1], int(math.max(now, tat - interval * cost)), 'PX', ttl)
  end
  return {3, 0, 0, 0, 0}
end
if cost == 0 then return {0, 0, burst, remaining(start), start - now} end
if cost > burst then return {2, 0, burst, remaining(start), start - now} end
local nxt = start + interval * cost
if nxt - now > tau then
  return {1, nxt - now - tau, burst, remaining(start), start - now}
end
redis.call('SET', KEYS[1], int(nxt), 'PX', ttl)
return {0, 0, burst, remaining(nxt), nxt - now}
