-- Fixed window: the state is "window:count", the window number modulo
-- 2^32 and its count (absent = 0:0), compared as the core compares them.
-- Both are below 2^32, so Lua's concatenation (14 significant digits)
-- writes them exactly.
local limit = tonumber(ARGV[5])
local window = tonumber(ARGV[6])
local WRAP = 4294967296
local SLACK = 65536
local stored, count = 0, 0
local raw = redis.call('GET', KEYS[1])
if raw then
  local s, c = string.match(raw, '^(%d+):(%d+)$')
  stored, count = tonumber(s), tonumber(c)
end
local index = idiv(now, window)
-- The window a request counts in: now's own, or the stored one when the
-- clock went back (within the slack) from a window that holds a count.
local back = (stored - index % WRAP) % WRAP
if count ~= 0 and back ~= 0 and back <= SLACK then index = index + back end
local index32 = index % WRAP
if mode == 'refund' then
  if raw and stored == index32 then
    redis.call('SET', KEYS[1], stored .. ':' .. math.max(0, count - cost), 'PX', ttl)
  end
  return {3, 0, 0, 0, 0}
end
local ahead = (index32 - stored) % WRAP
local used = 0
if ahead == 0 or ahead > WRAP - 1 - SLACK then used = count end
local remaining = math.max(0, limit - used)
local until_next = (index + 1) * window - now
local reset = 0
if used ~= 0 then reset = until_next end
if cost == 0 then return {0, 0, limit, remaining, reset} end
if cost > limit then return {2, 0, limit, remaining, reset} end
local nxt = used + cost
if nxt > limit then return {1, until_next, limit, remaining, reset} end
redis.call('SET', KEYS[1], index32 .. ':' .. nxt, 'PX', ttl)
return {0, 0, limit, limit - nxt, until_next}
