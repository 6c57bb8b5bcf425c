"""A stand-in for ``vllm serve`` 0.33 (no torch, no vllm): same routes, codes and bodies.

    FAKEGPU_DIR=/tmp/gpu VLLM_SERVER_DEV_MODE=1 \\
        python -m stubs.vllm_stub serve MODEL [--host 127.0.0.1] [--port 8000]
        [--enable-sleep-mode] [--gpu-memory-utilization 0.9] [--served-model-name NAME]
        [--max-model-len 4096] [--enforce-eager] [--dtype auto]
        [--weights-bytes 2GiB] [--context-bytes 512MiB] [--tokens-per-s 2000]
        [--boot-delay 0] [--reload-seconds 0.05] [--fake-workload LABEL]
        [--fail-reload] [--hang-requests]

The contract is ``VLLM_API.md``. Modules: ``cli`` (flags), ``server`` (boot, signals,
hypercorn's trio worker, shutdown), ``corelink`` / ``core`` (the engine-core child that
holds all fake GPU memory under its own pid), ``engine`` (sleep/pause/weights state and
generation), ``openai`` (completions and chat bodies), ``textgen`` (deterministic
fake tokens), ``app`` (starlette routes).

Stub-only additions
-------------------
- Flags ``--weights-bytes``, ``--context-bytes``, ``--tokens-per-s``, ``--boot-delay``,
  ``--reload-seconds``, ``--fake-workload``, ``--fail-reload``, ``--hang-requests``.
- ``POST /_stub/fault`` ``{"hang_requests": bool, "crash": bool, "fail_reload": bool}``
  (always registered): ``crash`` SIGKILLs the engine core; the server then answers 503
  on /health for ~0.5 s and exits 1.
- Generated text is a deterministic function of (prompt token ids, weights identity,
  weight_version label, seed, choice index): a word list picked by hash. The weights
  identity is ``revision.txt`` of the last reloaded checkpoint dir (else its basename);
  at boot that of MODEL (a dir) or the MODEL string itself.

Choices and deviations from VLLM_API.md / real vLLM (with reasons)
------------------------------------------------------------------
- ``/sleep`` and ``/wake_up`` without ``--enable-sleep-mode`` answer **400**
  (BadRequestError, "Sleep mode is not enabled. Start the server with
  --enable-sleep-mode."). Real vLLM 0.33 starts fine and fails inside the worker
  (an assertion that sleep mode is enabled), which surfaces as a generic 500; a 400
  with a clear message is what callers need to see that they misconfigured the server.
- ``/sleep?level=0`` only pauses scheduling (memory stays); while in it every
  ``vllm:engine_sleep_state`` sample is 0 (there is no label for it in the table).
- Level 1 frees the ``weights`` and ``kv`` ledger rows (the "host copy" is just the
  remembered size) rather than moving them to host, so the ledger shows exactly what a
  sleeping vLLM keeps on the device: its context.
- After a level-2 sleep the woken weights are "random": generated text changes until a
  ``reload_weights``; ``/weight_info`` is unchanged (the label is not the content, which
  is exactly the hazard real vLLM has).
- A wake that does not fit (CUDA OOM: 500, message contains "CUDA out of memory") is
  all-or-nothing: memory it allocated is freed again and the engine stays asleep with
  the same tags asleep. Real vLLM may leave the weights woken; all-or-nothing keeps the
  fake GPU's residency honest.
- ``reload_weights`` while the weights are asleep is a worker error (500) instead of
  undefined behaviour; wake ``tags=weights`` first. Generation pauses during a reload
  (it runs between engine steps, as a collective_rpc does in vLLM's busy loop).
- Only ``reload_weights`` is a known ``collective_rpc`` method; any other is a 500
  ("AttributeError: 'Worker' object has no attribute ..."). ``results`` is ``[null]``
  (one worker).
- A completion's default ``max_tokens`` is 16; a chat's is the rest of the context
  (``--max-model-len``, default 4096, minus the prompt) as in vLLM.
- ``logprobs`` are fake (-0.5 each); ``temperature``/``top_p`` are validated but do not
  change the text; an absent ``seed`` is 0 (deterministic, unlike vLLM).
- ``return_token_ids``: completions choices carry ``prompt_token_ids`` and
  ``token_ids``; chat responses carry top-level ``prompt_token_ids`` and per-choice
  ``token_ids`` (streamed chunks carry the ids of their delta).
- /metrics carries vLLM's ``engine`` and ``model_name`` labels on every sample (as
  real vLLM does), so parse by name and ``sleep_state``, not by the whole line.
  Requests held by a sleep (or a ``mode=keep`` pause) before their first token count
  as waiting.
- The engine core ignores SIGTERM/SIGINT for its whole life; it exits when the API
  server closes its stdin or dies (a parent-pid watchdog; PR_SET_PDEATHSIG is not
  usable because trio spawns from a worker thread). The API server ignores SIGTERM
  until it is listening, then exits 0 on SIGTERM/SIGINT after the core freed its memory.
- Unknown paths answer 404 ``{"detail": "Not Found"}`` (FastAPI's body), as do dev
  routes without ``VLLM_SERVER_DEV_MODE=1``.
"""

__all__: list[str] = []
