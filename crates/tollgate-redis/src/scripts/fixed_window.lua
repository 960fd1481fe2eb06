-- Fixed window: the state is "window:count", the window number (since the
-- Unix epoch) modulo 2^32 and its count (absent = 0:0), compared as the
-- core compares them. Both are below 2^32, so Lua's concatenation (14
-- significant digits) writes them exactly. Windows are at least 1 ms, so
-- the window number is exact.
RATE.fixed_window = function(key, mode, cost, ttl, p)
  local limit = tonumber(p[1])
  local window = tonumber(p[2])
  local WRAP = 4294967296
  local SLACK = 65536
  local stored, count = 0, 0
  local raw = get(key)
  if raw then
    local s, c = string.match(raw, '^(%d+):(%d+)$')
    s, c = tonumber(s), tonumber(c)
    if s and s < WRAP and c < WRAP then
      stored, count = s, c
    else
      redis.call('DEL', key)
      raw = nil
    end
  end
  local index, phase = divnow(window)
  -- The window a request counts in: now's own, or the stored one when the
  -- clock went back (within the slack) from a window that holds a count.
  local back = (stored - index % WRAP) % WRAP
  if count == 0 or back > SLACK then back = 0 end
  index = index + back
  local index32 = index % WRAP
  if mode == 'refund' then
    if raw and stored == index32 then
      redis.call('SET', key, stored .. ':' .. math.max(0, count - cost), 'PX', ttl)
    end
    return {3, 0, 0, 0, 0}
  end
  local ahead = (index32 - stored) % WRAP
  local used = 0
  if ahead == 0 or ahead > WRAP - 1 - SLACK then used = count end
  local remaining = math.max(0, limit - used)
  -- (Past 2^53 only when the clock went back by more than that.)
  local until_next = (back + 1) * window - phase
  local reset = 0
  if used ~= 0 then reset = until_next end
  if cost == 0 then return {0, 0, limit, remaining, reset} end
  if cost > limit then return {2, 0, limit, remaining, reset} end
  local nxt = used + cost
  if nxt > limit then return {1, until_next, limit, remaining, reset} end
  write(function() redis.call('SET', key, index32 .. ':' .. nxt, 'PX', ttl) end)
  return {0, 0, limit, limit - nxt, until_next}
end
