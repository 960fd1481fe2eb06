-- Calendar quota, as tollgate_core::Quota and tollgate_core::calendar.
-- KEYS[1] a hash, one field per period the rule counts ('minute', 'hour',
-- 'day', 'week', 'month', 'year'), each "start used bonus end": the start
-- of the period counted, in Unix seconds (period bounds are whole seconds),
-- the units used in it, the units granted on top of its budget, and its
-- end (so a window counted at another offset is still read as counted;
-- fields written before ends were stored have none: their end is their
-- start's period's at the rule's offset).
-- ARGV[1] the mode: 'consume' (ARGV[2] the cost; 0 reads), 'refund'
-- (ARGV[2] the units to give back), 'reset', 'grant' (ARGV[5] the units,
-- at most 2^52). ARGV[4] the TTL's margin in ms; ARGV[6] the offset from
-- UTC in seconds east; ARGV[7..] pairs of a period's name and its budget
-- (1 to 2^52), in the rule's order.
-- The key lives until the end of the latest period it counts, plus the
-- margin: set on every write, relative to now, so idle keys vanish and
-- a restarted instance finds what was spent.
-- Reply: {kind (0 allow, 1 deny, 2 never), now's nanoseconds, the seconds
-- from now's second to when every full period has ended (a denial's
-- retry), then per period: budget, remaining, the seconds from now's
-- second to its end, its length in seconds}. Times in whole seconds plus
-- now's nanoseconds: a year in ns is past 2^53, not in seconds.
-- Counts stay below 2^53 (budgets and grants at most 2^52 each), so they
-- are exact in doubles; they are written with '%.0f', as Lua's own
-- number formatting keeps only 14 digits.
local DAY = 86400
-- 2^52: the largest budget and the largest grant.
local MAX_LIMIT = 4503599627370496
-- The last second a u64 of Unix ns reaches.
local MAX_START = 18446744073
-- 'zone' in ARGV[6]: an IANA time zone, whose period bounds the client
-- computed (ARGV[7..] groups of name, budget, start and end of the period
-- holding now, in Unix seconds; now is the client's, ARGV[3]).
local zoned = ARGV[6] == 'zone'
local offset = zoned and 0 or tonumber(ARGV[6])
local key = KEYS[1]
local names, limits, given = {}, {}, {}
local step = zoned and 4 or 2
for i = 7, #ARGV - step + 1, step do
  names[#names + 1] = ARGV[i]
  limits[#limits + 1] = tonumber(ARGV[i + 1])
  if zoned then given[#names] = {count_of(ARGV[i + 2]) or now_s, count_of(ARGV[i + 3]) or now_s + 1} end
end
local charge, give_back, grant = 0, 0, 0
if mode == 'consume' then charge = cost
elseif mode == 'refund' then give_back = cost
elseif mode == 'grant' then grant = tonumber(ARGV[5]) end

-- A count as this script stores it (up to 2^53), or nil.
local function big_of(v)
  if type(v) ~= 'string' or #v > 16 or not string.find(v, '^%d+$') then return nil end
  local n = tonumber(v)
  if n > 2 * MAX_LIMIT then return nil end
  return n
end
local function fmt(n) return string.format('%.0f', n) end

-- Hinnant's days_from_civil and civil_from_days, on whole days.
local function days_from_civil(y, m, d)
  if m <= 2 then y = y - 1 end
  local era = idiv(y, 400)
  local yoe = y - era * 400
  local mp = m + 9
  if m > 2 then mp = m - 3 end
  local doy = idiv(153 * mp + 2, 5) + d - 1
  local doe = yoe * 365 + idiv(yoe, 4) - idiv(yoe, 100) + doy
  return era * 146097 + doe - 719468
end
local function civil_from_days(days)
  local z = days + 719468
  local era = idiv(z, 146097)
  local doe = z - era * 146097
  local yoe = idiv(doe - idiv(doe, 1460) + idiv(doe, 36524) - idiv(doe, 146096), 365)
  local doy = doe - (365 * yoe + idiv(yoe, 4) - idiv(yoe, 100))
  local mp = idiv(5 * doy + 2, 153)
  local m = mp - 9
  if mp < 10 then m = mp + 3 end
  local y = yoe + era * 400
  if m <= 2 then y = y + 1 end
  return y, m
end

-- The period containing Unix second s: its start and end in Unix
-- seconds, as Period::bounds computes them.
local function bounds(period, s)
  local l = s + offset
  local a, b
  if period == 'minute' then
    a = idiv(l, 60) * 60
    b = a + 60
  elseif period == 'hour' then
    a = idiv(l, 3600) * 3600
    b = a + 3600
  else
    local days = idiv(l, DAY)
    if period == 'day' then
      a, b = days, days + 1
    elseif period == 'week' then
      -- 1970-01-01 was a Thursday: Monday is 3 days before.
      a = days - (days + 3) % 7
      b = a + 7
    else
      local y, m = civil_from_days(days)
      if period == 'month' then
        local ny, nm = y, m + 1
        if m == 12 then ny, nm = y + 1, 1 end
        a, b = days_from_civil(y, m, 1), days_from_civil(ny, nm, 1)
      else
        a, b = days_from_civil(y, 1, 1), days_from_civil(y + 1, 1, 1)
      end
    end
    a, b = a * DAY, b * DAY
  end
  return math.max(0, a - offset), math.max(0, b - offset)
end

local function main()
  -- The stored windows, by position in the rule; absent if none.
  local stored = {}
  if mode == 'reset' then
    redis.call('DEL', key)
  elseif #names > 0 then
    local raw = redis.pcall('HMGET', key, unpack(names))
    if raw.err then
      redis.call('DEL', key)
      raw = {}
    end
    for i = 1, #names do
      if raw[i] then
        local s, u, b, e = string.match(raw[i], '^(%d+) (%d+) (%d+) ?(%d*)$')
        s, u, b = count_of(s), big_of(u), big_of(b)
        if not (s and u and b) or s > MAX_START or b > MAX_LIMIT then corrupt() end
        if e == '' and zoned then
          -- Written without its end: its period's if it is now's, else past.
          if s == given[i][1] then e = given[i][2] else e = s + 1 end
        elseif e == '' then
          e = select(2, bounds(names[i], s))
        else
          e = count_of(e)
          if not e or e <= s or e > MAX_START + 366 * DAY then corrupt() end
        end
        stored[i] = {s, u, b, e}
      end
    end
  end

  -- Each period's current window, as Quota::current finds it: the stored
  -- one if it holds now or is a later one (the clock went back); now's
  -- period with the stored counts if the stored window is that period
  -- counted at another offset (its middle falls in now's period); else
  -- fresh.
  local windows = {}
  local never, wait, latest = false, nil, now_s
  for i = 1, #names do
    local period, w = names[i], stored[i]
    local start, finish
    if zoned then start, finish = given[i][1], given[i][2] else start, finish = bounds(period, now_s) end
    local cur = {start = start, finish = finish, used = 0, bonus = 0, same = false}
    if w then
      local ws, we = w[1], w[4]
      local middle = ws + idiv(we - ws, 2)
      local kept = true
      if ws <= now_s and now_s < we then
        cur.start, cur.finish = ws, we
      elseif ws > now_s then
        cur.start, cur.finish = ws, we
      elseif not (start <= middle and middle < finish) then
        kept = false
      end
      if kept then
        cur.used, cur.bonus = w[2], w[3]
        -- Refunds go to a stored window that is current.
        cur.same = cur.start == ws
      end
    end
    cur.bonus = math.min(cur.bonus + grant, MAX_LIMIT)
    if cur.same and give_back > 0 then cur.used = math.max(0, cur.used - give_back) end
    local budget = limits[i] + cur.bonus
    cur.budget = budget
    cur.remaining = math.max(0, budget - cur.used)
    if charge > budget then
      never = true
    elseif charge > cur.remaining then
      wait = math.max(wait or 0, cur.finish - now_s)
    end
    latest = math.max(latest, cur.finish)
    windows[i] = cur
  end
  local kind = 0
  if never then kind = 2 elseif wait then kind = 1 end

  -- Charged to every period or none; a grant to every period; a refund
  -- to the stored windows that are current. Peeks and denials write
  -- nothing.
  local fields = {}
  for i, cur in ipairs(windows) do
    local write = grant > 0
    if kind == 0 and charge > 0 then
      cur.used = cur.used + charge
      cur.remaining = cur.remaining - charge
      write = true
    end
    if cur.same and give_back > 0 then write = true end
    if write then
      fields[#fields + 1] = names[i]
      fields[#fields + 1] = fmt(cur.start) .. ' ' .. fmt(cur.used) .. ' ' .. fmt(cur.bonus)
        .. ' ' .. fmt(cur.finish)
    end
  end
  if #fields > 0 then
    redis.call('HSET', key, unpack(fields))
    local expire = (latest - now_s) * 1000 - idiv(now_n, 1000000) + tonumber(ttl)
    redis.call('PEXPIRE', key, fmt(expire))
  end

  local reply = {kind, now_n, (wait or 0)}
  for _, cur in ipairs(windows) do
    reply[#reply + 1] = cur.budget
    reply[#reply + 1] = cur.remaining
    reply[#reply + 1] = cur.finish - now_s
    reply[#reply + 1] = cur.finish - cur.start
  end
  return reply
end
return guarded(main)
