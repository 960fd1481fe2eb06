-- Shared by every tollgate script. Arguments: KEYS[1] the state key;
-- ARGV[1] the mode ('decide' or 'refund' for rate rules; the semaphore's
-- are in semaphore.lua), ARGV[2] the cost (or permits), ARGV[3] the time:
-- ns since the Unix epoch, in decimal ('' = Redis's own TIME), ARGV[4] the
-- key's TTL in ms, ARGV[5..] the rule's parameters. (A joint decision of
-- several rate rules, joint.lua, lays out its rules after ARGV[4].)
--
-- A rate algorithm is a function RATE.<name>(key, mode, cost, ttl, p), p
-- its parameters, that returns its reply; it makes the writes that admit
-- a request through write(), so that a joint decision can hold them until
-- every rule has decided (other writes, such as dropping expired entries
-- or state it does not recognise, leave the decision unchanged and are
-- made at once).
--
-- Exact arithmetic. Lua's numbers are doubles, exact for integers up to
-- 2^53; a Unix time in ns is about 1.8e18, where a double resolves 256 ns.
-- So no absolute time is ever held in one number: now is (now_s, now_n),
-- its seconds and nanoseconds, and the scripts compute with times relative
-- to now (ns after now, negative before). Rule spans (intervals, windows,
-- delays, lease TTLs) are at most 2^51 ns, about 26 days (the store
-- refuses longer ones), and relative times are clamped to +-2^52 (FAR),
-- so that a relative time plus a span or two is exact, and so is a state
-- a span ahead when the clock steps back by up to 26 days. Times are stored as
-- decimal Unix ns, as the core's u64: split into seconds and nanoseconds
-- when read, formed from now and a relative time when written.
--
-- State these scripts do not recognise — a key of another Redis type, a
-- value they did not write — is deleted when met and reads as absent: a
-- script never answers an error because of what it found at its keys.
local NS = 1000000000
local floor = math.floor
local FAR = 4503599627370496
-- floor(a / b), exact for integers |a| <= 2^53 and 1 <= b <= 2^53.
local function idiv(a, b)
  local q = floor(a / b)
  if q * b > a then q = q - 1 elseif (q + 1) * b <= a then q = q + 1 end
  return q
end
local function ceildiv(a, b)
  local q = idiv(a, b)
  if q * b < a then q = q + 1 end
  return q
end
-- A count as these scripts store it (decimal, below 2^53), or nil.
local function count_of(v)
  if type(v) ~= 'string' or #v > 15 or not string.find(v, '^%d+$') then return nil end
  return tonumber(v)
end
-- The seconds and nanoseconds of a decimal count of ns (a u64), or nil.
local function split(t)
  if type(t) ~= 'string' or #t > 20 or not string.find(t, '^%d+$') then return nil end
  if #t <= 9 then return 0, tonumber(t) end
  return tonumber(string.sub(t, 1, -10)), tonumber(string.sub(t, -9))
end
local now_s, now_n
if ARGV[3] == '' then
  local t = redis.call('TIME')
  now_s, now_n = tonumber(t[1]), tonumber(t[2]) * 1000
else
  now_s, now_n = split(ARGV[3])
end
-- The stored time t (decimal Unix ns) as ns after now, clamped to
-- +-FAR; nil if t is not a time.
local function since(t)
  local s, n = split(t)
  if not s then return nil end
  local ds = s - now_s
  if ds > 4503599 then return FAR elseif ds < -4503599 then return -FAR end
  return math.max(-FAR, math.min(FAR, ds * NS + (n - now_n)))
end
-- The stored form of the time d ns after now (|d| <= 2^53): decimal Unix
-- ns, never before the epoch.
local function stamp(d)
  local q = idiv(d, NS)
  local s, n = now_s + q, now_n + (d - q * NS)
  if n >= NS then s, n = s + 1, n - NS end
  if s < 0 then return '0' end
  if s == 0 then return tostring(n) end
  -- NS + n prints as '1' and n's nine digits.
  return s .. string.sub(NS + n, 2)
end
-- floor(now / w) and now mod w for 1 <= w <= 2^52: the remainder exact,
-- the quotient exact while below 2^53 (any w of 1 ms or more). Now is
-- now_s * 5^9 * 2^9 + now_n, and now_s * 5^9 < 2^53 until 2116. (Every
-- script runs this, most often on a window of a second, a minute or a
-- millisecond: those take the short paths.)
local function divnow(w)
  -- A window that divides a second, or a whole number of seconds: no
  -- long division. (Exact: now_s * (NS / w) < 2^53 for w >= 1 ms.)
  if NS % w == 0 then
    local q = idiv(now_n, w)
    return now_s * (NS / w) + q, now_n - q * w
  elseif w % NS == 0 then
    local ws = w / NS
    local q = idiv(now_s, ws)
    return q, (now_s - q * ws) * NS + now_n
  end
  local a = now_s * 1953125
  local q = idiv(a, w)
  local r = a - q * w
  for _ = 1, 9 do
    q, r = q + q, r + r
    if r >= w then q, r = q + 1, r - w end
  end
  local k = idiv(r + now_n, w)
  return q + k, r + now_n - k * w
end
-- The string at key, or nil; a key of another type is deleted.
local function get(key)
  local v = redis.pcall('GET', key)
  if type(v) == 'table' then
    redis.call('DEL', key)
    return nil
  end
  return v or nil
end
-- For state read piece by piece: corrupt() says it holds something these
-- scripts did not write; guarded(main, keys) then deletes `keys` (the
-- script's KEYS when nil) and runs main again, on absent state. Any other
-- error passes through.
local CORRUPT = {}
local function corrupt() error(CORRUPT) end
local function guarded(main, keys)
  local ok, reply = pcall(main)
  if ok then return reply end
  if reply ~= CORRUPT then error(reply, 0) end
  for _, k in ipairs(keys or KEYS) do redis.call('DEL', k) end
  return main()
end
-- A refund to a state kept as a time ns after now (GCRA's TAT, a leaky
-- bucket's tail): `back` ns earlier, never before now; none to a state
-- already in the past.
local function refund_tat(key, tat, back, ttl)
  if tat > 0 then
    redis.call('SET', key, stamp(math.max(0, tat - back)), 'PX', ttl)
  end
  return {3, 0, 0, 0, 0}
end
-- The rate algorithms, by name, and where their admitting writes go: made
-- at once, or into `held` while a joint decision runs.
local RATE = {}
local held = nil
local function write(f)
  if held then held[#held + 1] = f else f() end
end
local mode = ARGV[1]
local cost = tonumber(ARGV[2])
local ttl = ARGV[4]
