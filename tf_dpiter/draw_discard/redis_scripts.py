"""The Lua scripts of the Redis store (redis_store.py); each runs atomically in Redis.

REPLACE returns {new sequence number, write id of the replaced value} and enforces the
submitter's influence rate across all servers (S1 <= max_steps on the Redis clock; -5: over,
nothing written). Redis does not undo a script's writes when a later command fails, so
REPLACE checks, before its first write, every key a later command needs of a given type
(-6: a key of the model has another type, nothing written). Every script first checks the generation (-1 missing, -2 another) and the
caller's sequence high-water mark `hw` (-4: rolled back; -6: the sequence number is not an
integer): the prologue `_checked`.
"""


def _checked(seq_key, hw_arg, table=False, seq="seq"):
  """The Lua prologue (lines ending with a newline) of a script that reads or writes the
  model (the module docstring): the sequence number, KEYS[seq_key], is read into the Lua
  local `seq` (KEYS[1] is the generation), the high-water mark is ARGV[hw_arg] (ARGV[1] the
  generation), and the codes are returned in a table ({-1}) when `table`, else alone (-1)."""
  code = (lambda c: "{%d}" % c) if table else str
  return (f"\nlocal g = redis.call('GET', KEYS[1])\nif not g then return {code(-1)} end\n"
          f"if g ~= ARGV[1] then return {code(-2)} end\n"
          f"local {seq} = tonumber(redis.call('GET', KEYS[{seq_key}]) or '-1')\n"
          f"if not {seq} or {seq} ~= math.floor({seq}) then return {code(-6)} end\n"
          f"if {seq} < tonumber(ARGV[{hw_arg}]) then return {code(-4)} end\n")


_NOW = """local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""   # the Redis clock, in ms

TOUCH = _checked(2, 3) + """if tonumber(ARGV[2]) > 0 then redis.call('HINCRBY', KEYS[3], 'draws', ARGV[2]) end
return seq
"""

REPLACE = _checked(4, 7) + """local old = redis.call('GET', KEYS[2])
if not old then return -1 end
local function kind(key) return redis.call('TYPE', key)['ok'] end
local kh, kc, kr = kind(KEYS[3]), kind(KEYS[5]), kind(KEYS[7])
if (kh ~= 'none' and kh ~= 'list') or (kc ~= 'none' and kc ~= 'hash')
   or (kr ~= 'none' and kr ~= 'hash') then return -6 end
local rate = nil
if ARGV[9] ~= '' then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local v = redis.call('HMGET', KEYS[7], 's', 't')
  local s1 = tonumber(v[1]) or 0
  local last = tonumber(v[2]) or now
  s1 = s1 * 2 ^ (-math.max(0, now - last) / tonumber(ARGV[8])) + 1
  if s1 > tonumber(ARGV[9]) + 1e-9 then return -5 end
  rate = {s1, now}
end
if ARGV[4] ~= '' then
  if not redis.call('SET', KEYS[6], '1', 'NX', 'PX', ARGV[5]) then return -3 end
end
redis.call('SET', KEYS[2], ARGV[2])
local h = tonumber(ARGV[3])
if h > 0 then
  redis.call('LPUSH', KEYS[3], old)
  redis.call('LTRIM', KEYS[3], 0, h - 1)
end
if tonumber(ARGV[6]) > 0 then redis.call('HINCRBY', KEYS[5], 'draws', ARGV[6]) end
redis.call('HINCRBY', KEYS[5], 'submits', 1)
redis.call('HINCRBY', KEYS[5], 'accepted', 1)
if rate then
  redis.call('HSET', KEYS[7], 's', tostring(rate[1]), 't', rate[2])
  redis.call('PEXPIRE', KEYS[7], math.ceil(tonumber(ARGV[8]) * 20))
end
return {redis.call('INCR', KEYS[4]), string.sub(old, -24, -17)}
"""

SNAPSHOT = _checked(2, 4, table=True) + """local prev, h = tonumber(ARGV[2]), tonumber(ARGV[3])
local n = seq - prev
local full = 0
if prev < 0 or n < 0 or n > h then n = h; full = 1 end
local hist = {}
if n > 0 then hist = redis.call('LRANGE', KEYS[3], 0, n - 1) end
local slots = redis.call('MGET', unpack(KEYS, 4))
return {seq, full, slots, hist}
"""

QUOTA = "\n" + _NOW + """local rate, burst = tonumber(ARGV[1]), tonumber(ARGV[2])
local v = redis.call('HMGET', KEYS[1], 'l', 't')
local level = tonumber(v[1]) or burst
local last = tonumber(v[2]) or now
level = math.min(burst, level + math.max(0, now - last) * rate / 1000)
local wait = 0
if level >= 1 then level = level - 1 else wait = math.ceil((1 - level) / rate * 1000) end
redis.call('HSET', KEYS[1], 'l', tostring(level), 't', now)
redis.call('PEXPIRE', KEYS[1], math.ceil(burst / rate * 1000) + 1000)
return wait
"""

INCR = """
local g = redis.call('GET', KEYS[1])
if g ~= ARGV[1] then return -1 end
redis.call('HINCRBY', KEYS[2], ARGV[2], ARGV[3])
return 0
"""

# The released model (model_release.py): KEYS gen, released-hash, seq; ARGV gen, seq of the
# caller's average (or of its peek), sealed payload ('' to peek), min_updates,
# min_interval_ms, hw. Returns {-1|-2} (generation), {-4} only when the store's OWN sequence
# number is below this process's high-water mark `hw` or below the current release's (the
# store went back: a rollback), {-5} (none yet and peeking), or {seq, payload, due}. A caller
# whose seq is below the current release's (another request released a newer average while
# it read its snapshot: a benign race) gets the current release, unchanged.
RELEASE = _checked(3, 6, table=True, seq="store_seq") + _NOW + """local cur = redis.call('HMGET', KEYS[2], 'seq', 't', 'w')
local cs, ct = tonumber(cur[1]), tonumber(cur[2])
if cs and store_seq < cs then return {-4} end
local seq = tonumber(ARGV[2])
if cs and seq < cs then return {cs, cur[3], 0} end
local due = (not cs) or (seq >= cs + tonumber(ARGV[4]) and now - ct >= tonumber(ARGV[5]))
if due and ARGV[3] ~= '' then
  redis.call('HSET', KEYS[2], 'seq', ARGV[2], 't', now, 'w', ARGV[3])
  return {seq, ARGV[3], 0}
end
if not cs then return {-5} end
return {cs, cur[3], due and 1 or 0}
"""

# Epochs (anchor.py): KEYS gen, seq, epochs-list, an anchor's mark; ARGV gen, hw, a new epoch
# id ('' to only read), the sequence number the anchor is about to record ('' for none).
# Raises the mark to that number (never lowers it), appends "<id>:<seq>" when given; returns
# {-1|-2|-4} or {seq, list length, last entry}.
EPOCH = _checked(2, 2, table=True) + """if ARGV[4] ~= '' then
  local m = tonumber(redis.call('GET', KEYS[4]) or '-1')
  if not m or tonumber(ARGV[4]) > m then redis.call('SET', KEYS[4], ARGV[4]) end
end
if ARGV[3] ~= '' then redis.call('RPUSH', KEYS[3], ARGV[3] .. ':' .. seq) end
local n = redis.call('LLEN', KEYS[3])
local last = ''
if n > 0 then last = redis.call('LINDEX', KEYS[3], -1) end
return {seq, n, last}
"""
