"""``slicer-dispatch``: holds pending sampling requests and serves them in GPU turns.

errors   the one exception hierarchy (HTTP codes are mapped by the front, not here)
store    the durable pending queue and results (SQLite, WAL)
core     pure rules: request validation, the body sent to vLLM, the commit rule,
         which revision next, when a turn ends
vllm     the bounded async client of one vLLM replica
checkpoint  what a publishable checkpoint directory is (checked at publish)
owner    one dispatcher per state dir (an exclusive lock holding the owner's pid)
"""
