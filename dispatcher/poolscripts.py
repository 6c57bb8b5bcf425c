"""The pool's layout in Redis and the Lua scripts that change it, each one atomic.

Layout (every key of pool P starts with ``slicer:pool:{P}:``; the braces are a hash tag,
so a pool would live in one slot, but the scripts name no keys: one Redis, not a
Cluster)::

    revs            hash   revision -> JSON {"path", "published_at", "seq"}
    revseq          string the publish counter (``seq``: newest is the largest)
    active          set    the revisions that have a stream
    q:REV           stream the pending requests of REV, consumer group ``dispatch``
    dl:REV          zset   entry id -> its deadline (Redis' clock, ms): the deadline scan
                           finds every due entry there, however many come before it
    unclaimed       hash   REV -> entries of q:REV never delivered to a dispatcher
    where           hash   sample id -> "REV ENTRY_ID" while the request is pending
    res:ID          string the result: b"d" REV "\\n" body, or b"f" REV "\\n" error (TTL)
    done            stream ids of results just stored (capped): wakes the long-polls
    ev              stream "new" / "ret" / "rev" (capped): wakes idle dispatchers
    stats           hash   committed, failed, duplicates, reclaimed, returned, aside
    bound:NAME      string consumer NAME's reclaim bound (ms), set by its CLAIM and TOUCH,
                           expiring after twice the bound: its claims are reclaimed only
                           once idle past it (and the taker's)
    unread          hash   "REV ENTRY_ID" -> times an entry was read and found unreadable
    aside           stream entries put aside unread (capped): ``rev``, ``eid``, ``why``
                           and the entry's own fields as ``f.NAME``, for an operator
    asking          hash   consumer -> "CAP EXPIRES_MS SINCE_MS GRANTED": who asks for a
                           turn (or holds one) to serve how much of the backlog
    served          hash   replica -> results it committed
    replicas        set    replica names that reported figures
    replica:NAME    string that replica's figures (JSON, expires)

A request is one stream entry (fields ``i`` id, ``k`` kind, ``a`` params JSON, ``d``
deadline seconds, ``t`` token ids as packed little-endian int32 or ``x`` UTF-8 text,
``m`` chat messages JSON): its entry id is its acceptance time (ms), and its deadline is
measured from it. An entry is *unclaimed* (never delivered), *claimed* by one consumer
(in the group's pending list, PEL), or *returned* (in the PEL of the pseudo-consumer
``__free__`` with an idle time set far in the past, so the next claim takes it at once).
An entry whose owner has been idle longer than the reclaim bound (the owner died: a live
one touches its entries) is claimed by whoever asks next and counted as *reclaimed*.

An entry this release cannot read (another release's, a hand edit) is handed back for a
replica that can, at most ``UNREADABLE_READS - 1`` times; the next reading puts it aside
(:data:`UNREADABLE`): failed under its id where it has one, kept in ``aside``.

The result rule: :data:`COMMIT` stores a result only while the request is pending as
that entry (``where``; ``SET NX`` besides), so the first valid result of a request wins
and a later one is dropped and counted (``duplicates``), also once the first one's TTL
has run out. Either way the entry is acknowledged and deleted, so the stream holds only
pending requests.

Every script validates what it needs before it writes anything (a script that fails
half way keeps its first writes: Redis scripts do not roll back).
"""

from __future__ import annotations

__all__ = [
    "CLAIM",
    "COMMIT",
    "ENQUEUE",
    "EXPIRE_SCAN",
    "FREE",
    "GROUP",
    "HOLD",
    "LOOKUP",
    "POLL",
    "PUBLISH",
    "RETURN",
    "STRAYS",
    "TOUCH",
    "UNREADABLE",
    "UNREADABLE_READS",
    "UNWANT",
    "WANT",
    "prefix",
]

GROUP = "dispatch"
FREE = "__free__"  # the pseudo-consumer that holds returned entries
DONE_MAXLEN = 10_000
EV_MAXLEN = 1_000


def prefix(pool: str) -> str:
    """The key prefix of pool ``pool`` (module docstring)."""
    return f"slicer:pool:{{{pool}}}:"


# The scripts that free memory or only move entries between owners run even when Redis
# is at its maxmemory (noeviction): a full Redis refuses new requests (ENQUEUE, PUBLISH:
# 507) but still drains. (A script with flags may touch keys it does not declare outside
# Redis Cluster; this client speaks to one Redis.)
_DRAINS = "#!lua flags=allow-oom\n"

# Shared Lua helpers: stream id order and the group's last delivered id.
_LIB = """
local function older(a, b)
  local am, as = string.match(a, '(%d+)-(%d+)')
  local bm, bs = string.match(b, '(%d+)-(%d+)')
  am, bm = tonumber(am), tonumber(bm)
  if am ~= bm then return am < bm end
  return tonumber(as) < tonumber(bs)
end
local function last_delivered(q)
  for _, g in ipairs(redis.call('XINFO', 'GROUPS', q)) do
    local name, ld = nil, nil
    for j = 1, #g, 2 do
      if g[j] == 'name' then name = g[j + 1] end
      if g[j] == 'last-delivered-id' then ld = g[j + 1] end
    end
    if name == 'dispatch' then return ld end
  end
  return '0-0'
end
local function owner(q, eid)
  if redis.call('EXISTS', q) == 0 then return nil end  -- dropped: nothing pending in it
  local e = redis.call('XPENDING', q, 'dispatch', eid, eid, 1)
  if #e == 0 then return nil end
  return e[1][2]
end
-- Up to `want` pending entries of q, oldest first, idle past `idle` ms and past their
-- owner's own bound (``bound:NAME``: a live owner touches its claims within it, so a
-- replica with a shorter one must not take them). Looks at `want` entries first, and
-- further (at most 10,000) only where owners' bounds held some back.
local bound_of = {}
local function reclaimable(p, q, idle, want)
  if want < 1 then return {} end
  local count, out = want, {}
  while true do
    local pend = redis.call('XPENDING', q, 'dispatch', 'IDLE', idle, '-', '+', count)
    out = {}
    for _, e in ipairs(pend) do
      local b = bound_of[e[2]]
      if b == nil then
        b = tonumber(redis.call('GET', p .. 'bound:' .. e[2]) or '0') or 0
        bound_of[e[2]] = b
      end
      if e[3] >= b then
        out[#out + 1] = e
        if #out >= want then return out end
      end
    end
    if #pend < count or count >= 10000 then return out end
    count = math.min(count * 10, 10000)
  end
end
local function free(q, eid)  -- to the pseudo-consumer, claimable at once
  redis.call('XCLAIM', q, 'dispatch', '__free__', 0, eid, 'IDLE', 100000000000, 'JUSTID')
end
local function drop(p, q, rev, eid)  -- acknowledged and deleted; an empty stream goes
  redis.call('ZREM', p .. 'dl:' .. rev, eid)
  redis.call('HDEL', p .. 'unread', rev .. ' ' .. eid)
  if redis.call('EXISTS', q) == 0 then return end
  redis.call('XACK', q, 'dispatch', eid)
  redis.call('XDEL', q, eid)
  -- Nothing pending any more: drop the stream (its group and consumers with it), so the
  -- cost of every scan stays with the revisions that have work. ENQUEUE makes it anew
  -- when the revision gets a request again.
  if redis.call('XLEN', q) == 0 and redis.call('XPENDING', q, 'dispatch')[1] == 0 then
    redis.call('DEL', q, p .. 'dl:' .. rev)
    redis.call('SREM', p .. 'active', rev)
    redis.call('HDEL', p .. 'unclaimed', rev)
  end
end
local function returned(p, n)
  if n > 0 then
    redis.call('HINCRBY', p .. 'stats', 'returned', n)
    redis.call('XADD', p .. 'ev', 'MAXLEN', '~', 1000, '*', 'e', 'ret')
  end
  return n
end
"""

#: ARGV: prefix, accept until (Redis' clock, ms; 0: no bound), n, then n times (id, rev,
#: kind, params, form, prompt, messages, dl); form is "t" (token ids), "x" (text) or ""
#: (chat). All revisions are checked first. Returns the entry ids, in order; errors
#: ``UNKNOWNREV rev`` and ``LATE`` (the caller gave up waiting: its client was told 503)
#: write nothing.
ENQUEUE = """
local p, n = ARGV[1], tonumber(ARGV[3])
local by = tonumber(ARGV[2])
if by > 0 then
  local t = redis.call('TIME')
  if tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) > by then
    return redis.error_reply('LATE')
  end
end
for k = 0, n - 1 do
  local rev = ARGV[4 + k * 8 + 1]
  if redis.call('HEXISTS', p .. 'revs', rev) == 0 then
    return redis.error_reply('UNKNOWNREV ' .. rev)
  end
end
local out = {}
for k = 0, n - 1 do
  local b = 4 + k * 8
  local id, rev, kind, params = ARGV[b], ARGV[b + 1], ARGV[b + 2], ARGV[b + 3]
  local form, prompt, msgs, dl = ARGV[b + 4], ARGV[b + 5], ARGV[b + 6], ARGV[b + 7]
  local q = p .. 'q:' .. rev
  if redis.call('EXISTS', q) == 0 then
    redis.call('XGROUP', 'CREATE', q, 'dispatch', '0', 'MKSTREAM')
  end
  redis.call('SADD', p .. 'active', rev)
  local fields = {'i', id, 'k', kind, 'a', params, 'd', dl}
  if form ~= '' then fields[#fields + 1] = form; fields[#fields + 1] = prompt end
  if msgs ~= '' then fields[#fields + 1] = 'm'; fields[#fields + 1] = msgs end
  local eid = redis.call('XADD', q, '*', unpack(fields))
  local due = tonumber(string.match(eid, '^(%d+)-')) + math.floor(tonumber(dl) * 1000)
  redis.call('ZADD', p .. 'dl:' .. rev, due, eid)
  redis.call('HSET', p .. 'where', id, rev .. ' ' .. eid)
  redis.call('HINCRBY', p .. 'unclaimed', rev, 1)
  out[#out + 1] = eid
end
redis.call('XADD', p .. 'ev', 'MAXLEN', '~', 1000, '*', 'e', 'new')
return out
"""

#: ARGV: prefix, consumer, preferred revision ("" none), max, reclaim idle ms, then the
#: revisions to skip (the caller's backed-off loads). Claims up to max entries of ONE
#: revision: the preferred one if it has claimable entries, else the one whose oldest
#: claimable entry is oldest. Returned and reclaimable
#: entries (idle past the bound) come first, then never-delivered ones.
#: Returns {rev or "", {{entry id, fields}, ...}, reclaimed, claimable left}.
CLAIM = (
    _DRAINS
    + _LIB
    + """
local p, me, pref = ARGV[1], ARGV[2], ARGV[3]
local max, idle = tonumber(ARGV[4]), tonumber(ARGV[5])
redis.call('SET', p .. 'bound:' .. me, idle, 'PX', 2 * idle)  -- its claims carry it
local function oldest(rev)
  local q = p .. 'q:' .. rev
  if redis.call('EXISTS', q) == 0 then return nil end
  local best = nil
  local pend = reclaimable(p, q, idle, 1)
  if #pend > 0 then best = pend[1][1] end
  if tonumber(redis.call('HGET', p .. 'unclaimed', rev) or '0') > 0 then
    local nx = redis.call('XRANGE', q, '(' .. last_delivered(q), '+', 'COUNT', 1)
    if #nx > 0 and (best == nil or older(nx[1][1], best)) then best = nx[1][1] end
  end
  return best
end
local skip = {}
for k = 6, #ARGV do skip[ARGV[k]] = true end
local revs = redis.call('SMEMBERS', p .. 'active')
local chosen, at = nil, nil
if pref ~= '' and not skip[pref] and redis.call('SISMEMBER', p .. 'active', pref) == 1
   and oldest(pref) then
  chosen = pref
else
  for _, rev in ipairs(revs) do
    local o = not skip[rev] and oldest(rev)
    if o and (at == nil or older(o, at)) then chosen, at = rev, o end
  end
end
local got, reclaimed = {}, 0
if chosen and max > 0 then
  local q = p .. 'q:' .. chosen
  for _, e in ipairs(reclaimable(p, q, idle, max)) do
    local r = redis.call('XCLAIM', q, 'dispatch', me, idle, e[1])
    if #r > 0 and r[1] then
      got[#got + 1] = r[1]
      if e[2] ~= '__free__' then reclaimed = reclaimed + 1 end
    end
  end
  if #got < max then
    local r = redis.call('XREADGROUP', 'GROUP', 'dispatch', me, 'COUNT', max - #got,
                         'STREAMS', q, '>')
    if r and r[1] then
      local n = 0
      for _, e in ipairs(r[1][2]) do got[#got + 1] = e; n = n + 1 end
      if n > 0 then redis.call('HINCRBY', p .. 'unclaimed', chosen, -n) end
    end
  end
  if reclaimed > 0 then redis.call('HINCRBY', p .. 'stats', 'reclaimed', reclaimed) end
end
local left = 0
for _, v in ipairs(redis.call('HVALS', p .. 'unclaimed')) do left = left + tonumber(v) end
for _, rev in ipairs(revs) do
  local q = p .. 'q:' .. rev
  if redis.call('EXISTS', q) == 1 then
    left = left + #reclaimable(p, q, idle, 1)
  end
end
return {chosen or '', got, reclaimed, left}
"""
)

#: ARGV: prefix, reclaim idle ms. Read only. Returns {{rev, unclaimed, reclaimable (at
#: most 1000 counted), claimed, oldest entry id or ""}, ...} and {{consumer, claimed}...}.
POLL = (
    _LIB
    + """
local p, idle = ARGV[1], tonumber(ARGV[2])
local out, owners = {}, {}
for _, rev in ipairs(redis.call('SMEMBERS', p .. 'active')) do
  local q = p .. 'q:' .. rev
  if redis.call('EXISTS', q) == 1 then
    local un = tonumber(redis.call('HGET', p .. 'unclaimed', rev) or '0')
    local rc = #reclaimable(p, q, idle, 1000)
    local s = redis.call('XPENDING', q, 'dispatch')
    local first = redis.call('XRANGE', q, '-', '+', 'COUNT', 1)
    local oldest = ''
    if #first > 0 then oldest = first[1][1] end
    out[#out + 1] = {rev, un, rc, s[1], oldest}
    if s[4] then
      for _, c in ipairs(s[4]) do owners[c[1]] = (owners[c[1]] or 0) + tonumber(c[2]) end
    end
  end
end
local flat = {}
for c, n in pairs(owners) do flat[#flat + 1] = {c, n} end
return {out, flat}
"""
)

#: ARGV: prefix, consumer, then pairs (rev, entry id). Hands the consumer's entries back
#: to the pool (owner ``__free__``, idle far in the past: claimable at once). Returns how
#: many it handed back (an entry another consumer took meanwhile is left alone).
RETURN = (
    _DRAINS
    + _LIB
    + """
local p, me, n = ARGV[1], ARGV[2], 0
for k = 3, #ARGV, 2 do
  local q = p .. 'q:' .. ARGV[k]
  if owner(q, ARGV[k + 1]) == me then
    free(q, ARGV[k + 1])
    n = n + 1
  end
end
return returned(p, n)
"""
)

#: ARGV: prefix, consumer, then pairs (rev, entry id) it holds. After a CLAIM whose
#: answer was lost (Redis ran it, the caller timed out): hands back (as RETURN does)
#: every entry of the consumer's that is not one it holds, across the active revisions,
#: so that none waits for the reclaim bound. Returns how many went back.
STRAYS = (
    _DRAINS
    + _LIB
    + """
local p, me, n = ARGV[1], ARGV[2], 0
local held = {}
for k = 3, #ARGV, 2 do held[ARGV[k] .. ' ' .. ARGV[k + 1]] = true end
for _, rev in ipairs(redis.call('SMEMBERS', p .. 'active')) do
  local q = p .. 'q:' .. rev
  if redis.call('EXISTS', q) == 1 then
    for _, e in ipairs(redis.call('XPENDING', q, 'dispatch', '-', '+', 100000, me)) do
      if not held[rev .. ' ' .. e[1]] then
        free(q, e[1])
        n = n + 1
      end
    end
  end
end
return returned(p, n)
"""
)

#: ARGV: prefix, consumer, then pairs (rev, entry id): resets the idle time of the
#: consumer's own entries (its heartbeat). Returns {still its own, owned by another}
#: (the rest have no owner: their result is stored).
TOUCH = (
    _DRAINS
    + _LIB
    + """
local p, me, n, other = ARGV[1], ARGV[2], 0, 0
local idle = tonumber(ARGV[3])
redis.call('SET', p .. 'bound:' .. me, idle, 'PX', 2 * idle)  -- alive: its bound holds
for k = 4, #ARGV, 2 do
  local q = p .. 'q:' .. ARGV[k]
  local o = owner(q, ARGV[k + 1])
  if o == me then
    redis.call('XCLAIM', q, 'dispatch', me, 0, ARGV[k + 1], 'JUSTID')
    n = n + 1
  elseif o and o ~= '__free__' then
    other = other + 1
  end
end
return {n, other}
"""
)

#: ARGV: prefix, replica name, result TTL s, then (id, rev, entry id, payload) groups;
#: payload starts with "d" (done) or "f" (failed). The first result of an id wins: it is
#: stored only while the request is still pending as that entry (``where``), so a late
#: result (a stale replica's, or one after the first result's TTL ran out) is never a
#: second one; either way its entry is acknowledged and deleted. Returns 1 (stored) or 0
#: (finished before: dropped, counted as a duplicate) per id.
COMMIT = (
    _DRAINS
    + _LIB
    + """
local p, who, ttl = ARGV[1], ARGV[2], ARGV[3]
local out = {}
for k = 4, #ARGV, 4 do
  local id, rev, eid, payload = ARGV[k], ARGV[k + 1], ARGV[k + 2], ARGV[k + 3]
  local q = p .. 'q:' .. rev
  local stored = false
  if redis.call('HGET', p .. 'where', id) == rev .. ' ' .. eid then
    stored = redis.call('SET', p .. 'res:' .. id, payload, 'NX', 'EX', ttl)
  end
  if stored then
    if redis.call('EXISTS', q) == 1 then
      local pend = redis.call('XPENDING', q, 'dispatch', eid, eid, 1)
      if #pend == 0 and #redis.call('XRANGE', q, eid, eid) > 0 then
        redis.call('HINCRBY', p .. 'unclaimed', rev, -1)  -- failed before any claim
      end
    end
    redis.call('HDEL', p .. 'where', id)
    redis.call('XADD', p .. 'done', 'MAXLEN', '~', 10000, '*', 'i', id)
    if string.sub(payload, 1, 1) == 'd' then
      redis.call('HINCRBY', p .. 'stats', 'committed', 1)
      redis.call('HINCRBY', p .. 'served', who, 1)
    else
      redis.call('HINCRBY', p .. 'stats', 'failed', 1)
    end
    out[#out + 1] = 1
  else
    redis.call('HINCRBY', p .. 'stats', 'duplicates', 1)
    out[#out + 1] = 0
  end
  drop(p, q, rev, eid)
end
return out
"""
)

#: How many readings of an unreadable entry there are at most: the last puts it aside.
UNREADABLE_READS = 3

#: ARGV: prefix, consumer, reads, result TTL s, then (rev, entry id, id or "", error)
#: groups: entries the consumer claimed and could not read. Each reading is counted
#: (``unread``); below ``reads`` the entry is handed back, claimable again once idle past
#: the reclaim bound (a replica that can read it may come first, and none reads it again
#: at once); at ``reads`` it is put aside: copied to ``aside`` with ``error`` (each field
#: cut to 4 KiB), failed under its id (the entry's own ``i``) with that error where it
#: is still pending as this entry, counted (``aside``), acknowledged and deleted. Returns
#: {handed back, put aside}.
UNREADABLE = (
    _DRAINS
    + _LIB
    + """
local p, me, reads, ttl = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4]
local back, aside = 0, 0
for k = 5, #ARGV, 4 do
  local rev, eid, id, why = ARGV[k], ARGV[k + 1], ARGV[k + 2], ARGV[k + 3]
  local q, key = p .. 'q:' .. rev, rev .. ' ' .. eid
  if owner(q, eid) == me then
    if redis.call('HINCRBY', p .. 'unread', key, 1) < reads then
      -- Back to the pool, idle from now: claimable once past the reclaim bound, by
      -- whichever replica (perhaps of a release that reads it) asks first then.
      redis.call('XCLAIM', q, 'dispatch', '__free__', 0, eid, 'JUSTID')
      back = back + 1
    else
      local copy = {'rev', rev, 'eid', eid, 'why', why}
      for _, e in ipairs(redis.call('XRANGE', q, eid, eid)) do
        for j = 1, #e[2], 2 do
          if e[2][j] == 'i' then id = e[2][j + 1] end  -- as Redis has it, whatever it is
          copy[#copy + 1] = 'f.' .. e[2][j]
          copy[#copy + 1] = string.sub(e[2][j + 1], 1, 4096)  -- a sample, not a copy
        end
      end
      redis.call('XADD', p .. 'aside', 'MAXLEN', '~', 1000, '*', unpack(copy))
      if id ~= '' and redis.call('HGET', p .. 'where', id) == key then
        if redis.call('SET', p .. 'res:' .. id, 'f' .. rev .. '\\n' .. why, 'NX', 'EX', ttl) then
          redis.call('XADD', p .. 'done', 'MAXLEN', '~', 10000, '*', 'i', id)
          redis.call('HINCRBY', p .. 'stats', 'failed', 1)
        end
        redis.call('HDEL', p .. 'where', id)
      end
      redis.call('HINCRBY', p .. 'stats', 'aside', 1)
      drop(p, q, rev, eid)
      aside = aside + 1
    end
  end
end
returned(p, back)
return {back, aside}
"""
)

#: ARGV: prefix, ids. Returns, per id, {"r", the result's payload}, {"p", rev, entry id}
#: while pending, or {"n"} (no such request in the pool, or its result expired).
LOOKUP = """
local p, out = ARGV[1], {}
for k = 2, #ARGV do
  local id = ARGV[k]
  local r = redis.call('GET', p .. 'res:' .. id)
  if r then
    out[#out + 1] = {'r', r}
  else
    local w = redis.call('HGET', p .. 'where', id)
    if w then
      local rev, eid = string.match(w, '^(%S+) (%S+)$')
      out[#out + 1] = {'p', rev, eid}
    else
      out[#out + 1] = {'n'}
    end
  end
end
return out
"""

#: ARGV: prefix, max entries per revision. Returns {now ms (Redis' clock: the
#: caller learns its offset from it), {{id, rev, entry id, deadline field}, ...}}: the
#: entries past their deadline, up to max of each revision from its deadline index
#: (``dl:REV``, every entry ENQUEUE wrote, however many come before it) and among its
#: oldest max entries (those another release wrote with no index entry); and among those
#: oldest, at once, the ones whose deadline field is unreadable (not a finite number >= 0,
#: or missing: the field as it is, or "").
EXPIRE_SCAN = (
    _DRAINS
    + """
local p, scan = ARGV[1], tonumber(ARGV[2])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local due, seen = {}, {}
local function look(rev, e)
  if seen[e[1]] then return end
  seen[e[1]] = true
  local ms = tonumber(string.match(e[1], '^(%d+)-'))
  local id, raw = nil, ''
  for j = 1, #e[2], 2 do
    if e[2][j] == 'i' then id = e[2][j + 1] end
    if e[2][j] == 'd' then raw = e[2][j + 1] end
  end
  local dl = tonumber(raw)
  if dl and (dl ~= dl or dl < 0 or dl == math.huge) then dl = nil end  -- nan, inf
  if id and (not dl or ms + dl * 1000 <= now) then due[#due + 1] = {id, rev, e[1], raw} end
end
for _, rev in ipairs(redis.call('SMEMBERS', p .. 'active')) do
  local q = p .. 'q:' .. rev
  for _, eid in ipairs(redis.call('ZRANGEBYSCORE', p .. 'dl:' .. rev, '-inf', now,
                                  'LIMIT', 0, scan)) do
    local e = redis.call('XRANGE', q, eid, eid)
    if #e == 0 then
      redis.call('ZREM', p .. 'dl:' .. rev, eid)  -- deleted by a release with no index
    else
      look(rev, e[1])
    end
  end
  for _, e in ipairs(redis.call('XRANGE', q, '-', '+', 'COUNT', scan)) do look(rev, e) end
end
return {now, due}
"""
)

#: ARGV: prefix, name, path, published_at[, first]. Returns {1, json} when newly
#: published, or {0, json} of the revision already published under that name; with
#: first = '1', {2, ''} (nothing written) when any other revision is published: the
#: check and the write in one step, so a base never becomes the newest over one
#: published meanwhile.
PUBLISH = """
local p, name, path, at, first = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local old = redis.call('HGET', p .. 'revs', name)
if old then return {0, old} end
if first == '1' and redis.call('HLEN', p .. 'revs') > 0 then return {2, ''} end
local seq = redis.call('INCR', p .. 'revseq')
local v = cjson.encode({path = path, published_at = tonumber(at), seq = seq})
redis.call('HSET', p .. 'revs', name, v)
redis.call('XADD', p .. 'ev', 'MAXLEN', '~', 1000, '*', 'e', 'rev')
return {1, v}
"""

#: Turn coordination (waking a replica parks its trainer: one pending request must wake
#: one replica, not every node's). ARGV: prefix, consumer, capacity, ttl ms, patience
#: ms, reclaim idle ms, then the revisions this replica cannot serve now (not counted).
#: Backlog B = never-delivered entries + reclaimable ones; covered C = the capacity of
#: every other consumer holding a turn, or asking for one since less than ``patience``
#: (a replica whose trainer keeps its GPU long stops covering) and, for one that already
#: asks, since before it. The caller may ask its slicerd for a turn when B > C: it is
#: then recorded as asking (until it holds, lets go, or its ttl passes without a HOLD).
#: Returns {0|1, B, C}.
WANT = (
    _DRAINS
    + _LIB
    + """
local p, me, cap = ARGV[1], ARGV[2], tonumber(ARGV[3])
local ttl, patience, idle = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local skip = {}
for k = 7, #ARGV do skip[ARGV[k]] = true end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local backlog = 0
for _, rev in ipairs(redis.call('SMEMBERS', p .. 'active')) do
  local q = p .. 'q:' .. rev
  if not skip[rev] and redis.call('EXISTS', q) == 1 then
    backlog = backlog + tonumber(redis.call('HGET', p .. 'unclaimed', rev) or '0')
    backlog = backlog + #reclaimable(p, q, idle, 1000)
  end
end
local all = redis.call('HGETALL', p .. 'asking')
local mine = nil
for j = 1, #all, 2 do
  if all[j] == me then mine = string.match(all[j + 1], '^%d+ %d+ (%d+) %d$') end
end
-- Covered: replicas holding a turn, and those asking for less than `patience`. One that
-- already asks counts only those that began before it: a younger one, asking since this
-- one's patience ran out, adds to it and does not replace it.
local covered = 0
for j = 1, #all, 2 do
  local c, v = all[j], all[j + 1]
  local ccap, exp, since, granted = string.match(v, '^(%d+) (%d+) (%d+) (%d)$')
  if not ccap or tonumber(exp) < now then
    redis.call('HDEL', p .. 'asking', c)
  elseif c ~= me and (granted == '1' or (now - tonumber(since) < patience
      and (mine == nil or tonumber(since) < tonumber(mine)))) then
    covered = covered + tonumber(ccap)
  end
end
if backlog > covered then
  redis.call('HSET', p .. 'asking', me,
             string.format('%d %d %s 0', cap, now + ttl, mine or tostring(now)))
  return {1, backlog, covered}
end
if mine then redis.call('HDEL', p .. 'asking', me) end
return {0, backlog, covered}
"""
)

#: ARGV: prefix, consumer, capacity, ttl ms, granted (0|1): refresh this consumer's
#: record (asking, or holding a turn once granted). Returns 1.
HOLD = (
    _DRAINS
    + """
local p, me, cap, ttl, granted = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4]), ARGV[5]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local v = redis.call('HGET', p .. 'asking', me)
local since = tostring(now)
if v then since = string.match(v, '^%d+ %d+ (%d+) %d$') or since end
redis.call('HSET', p .. 'asking', me, string.format('%s %d %s %s', cap, now + ttl, since, granted))
return 1
"""
)

#: ARGV: prefix, consumer: no longer asking nor holding. Returns 1 if it was recorded.
UNWANT = (
    _DRAINS
    + _LIB
    + """
return redis.call('HDEL', ARGV[1] .. 'asking', ARGV[2])
"""
)
