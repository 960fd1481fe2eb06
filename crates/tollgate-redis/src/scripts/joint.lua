-- A joint decision: several rate rules decide one request together, each
-- on its own key (all in this script's slot), and either every admitting
-- write is made or none is. ARGV[1..4] as in the prelude (the time at
-- ARGV[3]; the others unused); then seven per rule, in KEYS' order: the
-- algorithm's name, the cost, the key's TTL in ms, '1' if the rule's
-- denial denies the request ('0': it only watches), and three parameters
-- ('' where the algorithm takes fewer). Every rule decides on the state
-- as it was before the request; if an enforced rule denies (or can never
-- admit), nothing is written and every rule's reply is what it would
-- have answered, so a rule that admitted shows its budget as if
-- consumed. The reply: 1 if the writes were made, else 0, then each
-- rule's five numbers.
held = {}
-- A key given twice would be read twice before either write: refused
-- (the store never sends one).
local seen = {}
for _, key in ipairs(KEYS) do
  if seen[key] then return redis.error_reply('tollgate: a key given twice') end
  seen[key] = true
end
local replies, deny = {}, false
for i, key in ipairs(KEYS) do
  local at = 5 + (i - 1) * 7
  local decide = RATE[ARGV[at]]
  local c = tonumber(ARGV[at + 1])
  if not decide or not c then
    return redis.error_reply('tollgate: malformed joint decision')
  end
  local r = decide(key, 'decide', c, ARGV[at + 2], {ARGV[at + 4], ARGV[at + 5], ARGV[at + 6]})
  if ARGV[at + 3] == '1' and (r[1] == 1 or r[1] == 2) then deny = true end
  replies[i] = r
end
local applied = 0
if not deny then
  for _, f in ipairs(held) do f() end
  applied = 1
end
local out = {applied}
for _, r in ipairs(replies) do
  for j = 1, 5 do out[#out + 1] = r[j] end
end
return out
