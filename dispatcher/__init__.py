"""``slicer-dispatch``: holds pending sampling requests and serves them in GPU turns.

errors   the one exception hierarchy (HTTP codes are mapped by the front, not here)
model    the records (requests, revisions, the turn, config, counters) and the turn
         loop's phases with their transition table
store    the durable pending queue and results (SQLite, WAL)
core     pure rules: request validation, the body sent to vLLM, the commit rule,
         which revision next, when a turn ends
serve    the requests' side of a turn: load whole, send, commit, deadlines
turns    the turn loop (owns a Serving): acquire, wake, serve, sleep, release
events   the declared event stream (GET /v1/events) and its reader
http     the OpenAI-compatible HTTP front
oai      the OpenAI shapes of its answers (errors, models, chunks, prompt lists)
vllm     the bounded async client of one vLLM replica
checkpoint  what a publishable checkpoint directory is (checked at publish)
owner    one dispatcher per state dir (an exclusive lock holding the owner's pid)
poolscripts  pool mode: the pool's keys in Redis and the Lua scripts that change them
poolconn     pool mode: the bounded Redis link (errors are PoolUnavailable: 503)
poolurl      pool mode: which Redis URLs --queue takes (no client loaded)
poolstore    pool mode: this replica's claims, behind the store's calls
poolsummary  pool mode: the pool's figures as one read sees them
poollink     pool mode: the writer, the watcher, the ticker and the turn hooks
poolcli      ``slicer-pool``: a pool's status read from Redis
"""
