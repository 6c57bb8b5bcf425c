"""A stand-in for ``vllm serve`` 0.33 (no torch, no vllm): same routes, codes and bodies.

    FAKEGPU_DIR=/tmp/gpu VLLM_SERVER_DEV_MODE=1 \\
        python -m stubs.vllm_stub serve MODEL [--host 127.0.0.1] [--port 8000]
        [--enable-sleep-mode] [--gpu-memory-utilization 0.9]
        [--served-model-name NAME [NAME ...]] [--max-model-len 4096] [--enforce-eager]
        [--dtype auto] [--weights-bytes 2GiB] [--context-bytes 512MiB]
        [--tokens-per-s 2000] [--boot-delay 0] [--reload-seconds 0.05]
        [--fake-workload LABEL] [--fail-reload] [--hang-requests]
        [--http-server hypercorn|lean]

The contract is ``VLLM_API.md`` (read from the vllm 0.33.0 wheel); bodies, error
``type``/``param`` values and edge cases were checked against a real vLLM 0.32.0 server
(CPU build, ``VLLM_SERVER_DEV_MODE=1``) and the 0.32.0 wheel's route code. Modules:
``cli`` (flags), ``config``
(what ``serve`` was told), ``server`` (boot, signals, hypercorn's trio worker, shutdown),
``corelink`` / ``core`` (the engine-core child that holds all fake GPU memory under its
own pid), ``engine`` (sleep/pause/weights state and generation), ``openai``
(completions and chat bodies), ``errors`` (vLLM's error bodies), ``textgen``
(deterministic fake tokens), ``app`` (starlette routes).

Stub-only additions
-------------------
- Flags ``--weights-bytes``, ``--context-bytes``, ``--tokens-per-s``, ``--boot-delay``,
  ``--reload-seconds``, ``--fake-workload``, ``--fail-reload``, ``--hang-requests``,
  ``--http-server``.
- ``--scheduler-cls vllm_tier.hold.HoldScheduler`` (a real vLLM flag; the only class the
  stub takes): a request whose ``vllm_xargs`` has ``tier_hold_after: K`` stops stepping
  once each choice has K tokens and stays running until an abort ends it, as that
  scheduler does in real vLLM (the real-vLLM tier's way to have a sleep land on a request
  that is certainly still running).
- Fast mode, for a replica that must not be the ceiling (the dispatcher's sustained-rate
  and burst benches): ``--tokens-per-s inf`` generates each token at once (one scheduler
  checkpoint, no sleep), and ``--http-server lean`` serves the same app with the
  dispatcher's lean HTTP/1.1 server (``gpu_slicer.dispatcher.httpserver.serve_asgi``)
  instead of hypercorn (default), about a tenth of its CPU per request. Routes, bodies
  and failure modes are the same in both.
- ``POST /_stub/fault`` ``{"hang_requests": bool, "crash": bool, "fail_reload": bool,
  "hang_sleep": bool, "hang_wake": bool, "sleep_seconds": float, "fail_sleep": int,
  "fail_wake": int}``
  (always registered):
  ``crash`` SIGKILLs the engine core; the server then answers 503 on /health for ~0.5 s
  and exits 0 (as vLLM 0.32 does when its engine dies). ``hang_sleep``/``hang_wake``
  hold every /sleep or /wake_up before it acts until cleared (a call left in flight by a
  dying caller). ``sleep_seconds`` makes every later /sleep take that much longer (a
  slow offload; 0 ends it). ``fail_sleep: N`` fails the next N /sleep calls with a 500
  before they act (an engine error mid-call: nothing was slept). ``fail_wake: N`` fails
  the next N /wake_up calls with a 500 after they acted (whatever tags they woke stay
  woken): what a caller whose wake timed out while vLLM went on sees.
- Generated text is a deterministic function of (prompt token ids, weights identity,
  seed, choice index): a word list picked by hash. The weight_version label is not the
  content and does not change it (as in vLLM). The weights
  identity is ``revision.txt`` of the last reloaded checkpoint dir (else its basename);
  at boot that of MODEL (a dir) or the MODEL string itself.

Behaviour kept as real vLLM 0.32 shows it (so callers meet the same traps)
----------------------------------------------------------------------------
- A ``reload_weights`` that fails (``--fail-reload``, the ``fail_reload`` fault, a
  missing directory, positional ``args``) answers 500 "Call to collective_rpc method
  failed: Worker failed with error '...', please check the stack trace above for the
  root cause" and leaves the weights broken: the next generation step kills the engine
  (500 "EngineCore encountered an issue. See stack trace (above) for the root cause.",
  then the server exits 0, as after the ``crash`` fault). A successful reload before
  that repairs them.
- A request sent while asleep (any level) or paused with ``mode=keep`` is held until
  scheduling resumes; held before its first token it counts as neither
  ``vllm:num_requests_waiting`` nor ``..._running``.
- ``/wake_up``: unknown tags are not an error; if any given tag is not asleep (unknown
  or already awake) the memory wake is a no-op; ``tags`` echoes the query (null when
  none); a full wake also ends a ``/pause``.
- A prompt plus ``max_tokens`` past ``--max-model-len`` is clamped to the context;
  ``max_tokens`` alone past it, or a prompt longer than it, is a 400.

Choices and deviations from VLLM_API.md / real vLLM (with reasons)
------------------------------------------------------------------
Version differences (the stub follows the 0.33 contract, VLLM_API.md; 0.32 differs):

- ``return_weight_versions`` adds ``weight_versions`` to each choice (streaming: to its
  last chunk): a 0.33 feature the dispatcher needs. 0.32 ignores the field.
- While paused with ``mode=abort`` or ``mode=wait`` (and while a ``/sleep?mode=wait``
  drains) a new generation request is a 503 "Generation is paused. Please retry after it
  resumes." as VLLM_API.md documents for 0.33; 0.32 holds it until ``/resume``.
- ``/start_weight_update`` opens an update (200; 500 if one is open) and a bare
  ``/finish_weight_update`` with none open is a 500, as VLLM_API.md documents. Real
  servers started without ``--weight-transfer-config`` answer both with 500 "Call to
  collective_rpc method failed: Worker failed with error 'Weight transfer not
  configured. Please set weight_transfer_config to enable weight transfer.', ...".
- ``/version`` says ``0.33.0`` and ``system_fingerprint`` is ``vllm-0.33.0-stub``
  (real: ``vllm-<version>-<config hash>``).

Choices:

- A 500 from an unhandled error (a worker error of ``collective_rpc``, a bare
  ``finish_weight_update``) leaves the connection open. Real vLLM (uvicorn) resets the
  TCP connection after it, so a client that reuses the pooled connection gets
  "Connection reset by peer" on its next call (seen on 0.32, most of the time); hypercorn
  cannot reproduce that. The dispatcher therefore sends every control call with
  ``Connection: close`` (tests/test_dispatcher_vllm.py checks the header).
- ``/sleep`` and ``/wake_up`` without ``--enable-sleep-mode`` answer **400**
  (BadRequestError, "Sleep mode is not enabled. Start the server with
  --enable-sleep-mode."). Real vLLM 0.33 on CUDA starts fine and fails inside the worker
  (an assertion that sleep mode is enabled), which surfaces as a generic 500; the 0.32
  CPU build answers 200 to both and keeps its memory (the CPU worker logs "sleep mode is
  not supported on CPU, ignore it"). A 400 with a clear message is what callers need
  to see that they misconfigured the server.
- ``/sleep?level=0`` only pauses scheduling (memory stays); while in it every
  ``vllm:engine_sleep_state`` sample is 0 (as on 0.32). ``/resume`` ends it (it is a
  pause). After a level-1/2 sleep ``/resume`` does not resume generation: requests stay
  held and ``/is_paused`` stays true until a full wake (real vLLM would resume the
  scheduler on offloaded weights, which is undefined behaviour).
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
- ``reload_weights`` while the weights are asleep is a worker error (500) that leaves
  the weights intact, instead of undefined behaviour; wake ``tags=weights`` first.
  Generation pauses during a reload (it runs between engine steps, as a collective_rpc
  does in vLLM's busy loop).
- Only ``reload_weights`` is a known ``collective_rpc`` method; any other is a 500
  ("...Worker failed with error ''Worker' object has no attribute 'NAME''..."; real:
  the worker class, e.g. ``'CPUWorker'``). ``results`` is ``[null]`` (one worker);
  ``timeout`` is ignored. ``reload_weights`` without ``weights_path`` reloads the
  weights loaded last (MODEL until a reload), as vLLM 0.32 does: it is no way back to
  the boot weights, which are reloaded from MODEL's directory (``/v1/models`` ``root``).
  A missing directory's worker error is ``[Errno 2] No such file or directory: '...'``
  (real: whatever the weight loader raises).
- ``logprobs`` are fake (-0.5 each); ``temperature``/``top_p`` are validated but do not
  change the text; an absent ``seed`` is 0 (deterministic, unlike vLLM). Known request
  fields the stub does not implement (``echo``, penalties, ``top_k``, ``min_tokens``,
  ``return_prompt_text``, ``continuous_usage_stats``, ...) are accepted and ignored;
  ``routed_experts``, ``prompt_logprobs``, ``prompt_text`` are always null.
- Tokens are words: a prompt's ids are its whitespace-separated words hashed (no BOS),
  and a chat's prompt is a fake template, so ``prompt_tokens`` differ from a real
  tokenizer's counts.
- Request validation reports only the first failing field ("1 validation error") with
  pydantic-like texts; status, ``type`` and ``param`` follow vLLM (``param`` of a bad
  ``prompt`` is ``body.prompt``, pydantic's per-branch union errors are not listed).
- /metrics has only ``vllm:num_requests_running``, ``vllm:num_requests_waiting``
  (always 0: no batch limit, so nothing queues), ``vllm:engine_sleep_state`` and the
  token counters, with vLLM's ``engine`` and ``model_name`` labels on every sample
  (parse by name and ``sleep_state``, not by the whole line).
- The engine core ignores SIGTERM/SIGINT for its whole life; it exits when the API
  server closes its stdin or dies (a parent-pid watchdog; PR_SET_PDEATHSIG is not
  usable because trio spawns from a worker thread). The API server ignores SIGTERM
  until it is listening, then exits 0 on SIGTERM/SIGINT after the core freed its memory.
- Unknown paths answer 404 ``{"detail": "Not Found"}`` (FastAPI's body), as do dev
  routes without ``VLLM_SERVER_DEV_MODE=1``.
"""

__all__: list[str] = []
