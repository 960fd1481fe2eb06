-- Shared by every tollgate script. Arguments: KEYS[1] the state key;
-- ARGV[1] the mode ('decide' or 'refund' for rate rules; the semaphore's
-- are in semaphore.lua), ARGV[2] the cost (or permits), ARGV[3] the time
-- in ns ('' = Redis's own TIME), ARGV[4] the key's TTL in ms, ARGV[5..]
-- the rule's parameters. Numbers are doubles, exact below 2^53 (about 104 days
-- of ns). Times are ns since 2023-11-14 (Unix 1,700,000,000); on Redis's
-- TIME they passed 2^53 in February 2024 and are about 1e17 now, where a
-- double resolves 16 ns (TIME itself resolves 1000 ns), which is why the
-- store refuses intervals under 1 us and windows under 1 ms. Times passed
-- by the client, as in the conformance suite, stay exact.
local function clock()
  if ARGV[3] ~= '' then return tonumber(ARGV[3]) end
  local t = redis.call('TIME')
  return (tonumber(t[1]) - 1700000000) * 1000000000 + tonumber(t[2]) * 1000
end
-- floor(a / b), exact for integers below 2^53.
local function idiv(a, b)
  local q = math.floor(a / b)
  if q * b > a then q = q - 1 elseif (q + 1) * b <= a then q = q + 1 end
  return q
end
local function ceildiv(a, b)
  local q = idiv(a, b)
  if q * b < a then q = q + 1 end
  return q
end
-- Integers as Redis stores them. Redis formats a number passed to
-- redis.call with 17 significant digits, which round-trips every double
-- exactly (string.format would cost ~0.9 us of Redis CPU per call).
local function int(x) return x end
local mode = ARGV[1]
local cost = tonumber(ARGV[2])
local ttl = ARGV[4]
local now = clock()
