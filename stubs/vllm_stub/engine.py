"""The stub engine: sleep / pause / weights state and paced, deterministic generation.

Theory of operation
-------------------
All state lives in one ``Engine`` object on the API server's trio loop; the memory
itself lives in the engine-core child (``CoreLink``). Generation requests are
``GenRequest``s stepped token by token at ``tokens_per_s``. Before every step a request
waits at the *gate*, which is open only when the engine is fully awake, not paused
with ``mode=keep``, not busy in a ``collective_rpc`` (a weight reload runs between
steps, as in vLLM's busy loop) and not in the middle of a sleep. That is how a request
sent to a sleeping server is held until a full wake. A request blocked at the gate
before its first token is *held*: as in vLLM 0.32 it has not reached the scheduler, so
it counts as neither ``vllm:num_requests_waiting`` nor ``vllm:num_requests_running``
(the stub has no batch limit, so nothing ever queues as *waiting*).

A ``reload_weights`` that fails leaves the weights broken (vLLM has already begun
reloading in place): the next generation step kills the engine core, exactly like the
``crash`` fault, until a successful reload repairs them.

Every state change calls ``_notify``, which wakes every waiter to re-check its
predicate (a broadcast condition). Aborting a request cancels the scope of its current
step; the request then ends with ``finish_reason="abort"`` and its partial text.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from stubs.vllm_stub.corelink import CoreDead, CoreError, CoreLink
from stubs.vllm_stub.errors import DEAD_MESSAGE, EngineError, Paused, rpc_failed
from stubs.vllm_stub.textgen import next_token, prompt_key

__all__ = [
    "RANDOM_WEIGHTS",
    "Engine",
    "EngineError",
    "GenRequest",
    "Paused",
    "Seq",
    "log",
]

SLEEP_TAGS = ("weights", "kv_cache")
# The xarg that vllm_tier.hold.HoldScheduler reads (the stub's --scheduler-cls).
HOLD_XARG = "tier_hold_after"
HOLD_SCHEDULER = "vllm_tier.hold.HoldScheduler"
RANDOM_WEIGHTS = "<discarded: random weights>"
# vLLM's GPUModelRunner.reload_weights(weights_iterator, weights_path, is_checkpoint_format)
RELOAD_KWARGS = ("weights_iterator", "weights_path", "is_checkpoint_format")


def log(message: str) -> None:
    """One line to stderr, the stub's log (the launcher's tests read it)."""
    print(f"stub: {message}", file=sys.stderr, flush=True)


@dataclass
class Seq:
    """One choice being generated."""

    index: int
    prompt_ids: list[int]
    max_tokens: int
    stop: list[str]
    seed: int
    key: int = 0
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: str | None = None
    versions: list[dict[str, Any]] = field(default_factory=list)
    sent_chars: int = 0
    sent_tokens: int = 0
    final_sent: bool = False

    def __post_init__(self) -> None:
        self.key = prompt_key(self.prompt_ids)

    def visible(self) -> int:
        """How many chars of ``text`` may be streamed now (hold back a stop prefix)."""
        if self.finish_reason is not None or not self.stop:
            return len(self.text)
        return max(self.sent_chars, len(self.text) - max(len(s) for s in self.stop) + 1)


@dataclass(eq=False)
class GenRequest:
    """One HTTP generation request (all its choices step together)."""

    seqs: list[Seq]
    hold_after: int | None = None  # vllm_xargs tier_hold_after (see Engine.hold_scheduler)
    held: bool = True  # blocked before the engine (sleep, pause) before its first token
    aborted: bool = False
    error: Exception | None = None
    scope: trio.CancelScope | None = None

    def abort(self, error: Exception | None = None) -> None:
        self.aborted = True
        self.error = self.error or error
        if self.scope is not None:
            self.scope.cancel()


class Engine:
    """The engine state behind every route."""

    def __init__(
        self,
        core: CoreLink,
        *,
        identity: str,
        tokens_per_s: float,
        reload_seconds: float,
        sleep_mode: bool,
        hang_requests: bool = False,
        fail_reload: bool = False,
        model_path: str = "",
        hold_scheduler: bool = False,
    ) -> None:
        self.core = core
        # --scheduler-cls vllm_tier.hold.HoldScheduler: a request with the xarg
        # tier_hold_after=K stops stepping once every choice has K tokens, and stays
        # running until an abort ends it (what that scheduler does in real vLLM).
        self.hold_scheduler = hold_scheduler
        self.identity = identity
        self.model_path = model_path  # MODEL, what it booted with
        # What reload_weights without a weights_path reloads: the weights last loaded, not
        # MODEL (vLLM 0.32 keeps serving the last reloaded ones; vllm_tier's contract).
        self.loaded_path = model_path
        self.tokens_per_s = tokens_per_s
        self.reload_seconds = reload_seconds
        self.sleep_mode = sleep_mode
        self.hang_requests = hang_requests
        self.fail_reload = fail_reload
        # Stub faults: hold /sleep and /wake_up before they act (a call in flight that a
        # dying caller leaves behind), until cleared.
        self.hang_sleep = False
        self.hang_wake = False
        self.sleep_seconds = 0.0  # stub fault: each /sleep takes this much longer
        self.fail_sleep = 0  # stub fault: the next N /sleep calls fail (500), doing nothing
        # stub fault: the next N /wake_up calls act, then fail (500): the answer is lost
        self.fail_wake = 0
        self.weight_version = "default"
        self.update_open = False
        self.sleep_level: int | None = None  # None: awake
        self.asleep_tags: set[str] = set()
        self.discarded = False
        self.weights_broken = False  # a reload_weights failed part-way
        self.paused: str | None = None  # /pause mode
        self.sleeping_in_progress = False
        self.busy = 0
        self.dead = False
        self.requests: set[GenRequest] = set()
        self.generated_tokens = 0
        self.prompt_tokens = 0
        self._changed = trio.Event()
        self._lock = trio.Lock()  # sleep / wake / pause / rpc, one at a time

    # -- state ---------------------------------------------------------------------

    @property
    def sleeping(self) -> bool:
        return self.sleep_level is not None

    @property
    def gate_open(self) -> bool:
        return not (
            self.sleeping or self.sleeping_in_progress or self.busy or self.paused == "keep"
        )

    @property
    def sleep_state(self) -> str:
        """The ``vllm:engine_sleep_state`` label of the current state."""
        if self.sleep_level is None:
            return "awake"
        return {1: "weights_offloaded", 2: "discard_all"}.get(self.sleep_level, "paused")

    def running(self) -> int:
        """``vllm:num_requests_running``: requests past the gate (or frozen mid-way)."""
        return sum(1 for r in self.requests if not r.held)

    def waiting(self) -> int:
        """``vllm:num_requests_waiting``: always 0 (no batch limit, so no queue; a held
        request has not reached the scheduler, which vLLM counts as neither)."""
        return 0

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def _until(self, predicate: Callable[[], bool]) -> None:
        while not predicate():
            await self._changed.wait()

    def on_dead(self) -> None:
        """The engine core died: fail every request, now and later."""
        self.dead = True
        for req in list(self.requests):
            req.abort(CoreDead(DEAD_MESSAGE))
        self._notify()

    def admit(self) -> None:
        """Raise if a new generation request must be refused right now."""
        if self.dead:
            raise EngineError(DEAD_MESSAGE)
        if self.paused in ("abort", "wait") and not self.sleeping:
            raise Paused

    # -- pause, sleep, wake --------------------------------------------------------

    async def _quiesce(self, mode: str) -> None:
        if mode == "abort":
            for req in list(self.requests):
                req.abort()
            n = len(self.requests)
            await self._until(lambda: not self.requests)
            if n:
                log(f"aborted {n} request(s)")
        elif mode == "wait":
            await self._until(lambda: all(r.held for r in self.requests))

    async def pause(self, mode: str) -> None:
        async with self._lock:
            prev, self.paused = self.paused, ("wait" if mode == "wait" else self.paused)
            try:
                await self._quiesce(mode)
            except BaseException:
                self.paused = prev
                raise
            self.paused = mode
            self._notify()
            log(f"paused mode={mode}")

    async def resume(self) -> None:
        self.paused = None
        if self.sleep_level == 0:  # a level-0 sleep is only a pause of the scheduler
            self.sleep_level = None
        self._notify()
        log("resumed")

    async def sleep(self, level: int, mode: str) -> None:
        if not self.sleep_mode:
            raise EngineError(
                "Sleep mode is not enabled. Start the server with --enable-sleep-mode.", 400
            )
        async with self._lock:
            if self.hang_sleep:
                log("sleep held (hang_sleep fault)")
            await self._until(lambda: not self.hang_sleep)
            if self.fail_sleep > 0:
                self.fail_sleep -= 1
                log(f"sleep failed (fail_sleep fault; {self.fail_sleep} more)")
                raise EngineError("EngineCore encountered an issue (fail_sleep fault)", 500)
            if self.sleeping:
                log(f"already sleeping (level={self.sleep_level}): no-op")
                return
            t0 = time.monotonic()
            prev = self.paused
            if mode == "wait":
                self.paused = "wait"
            if mode == "keep":
                self.sleeping_in_progress = True
            self._notify()
            try:
                await self._quiesce(mode)
                self.sleeping_in_progress = True
                if level > 0:
                    await self._core("sleep", level=level)
                if self.sleep_seconds:
                    await trio.sleep(self.sleep_seconds)  # a slow offload (fault)
            finally:
                self.sleeping_in_progress = False
                self.paused = prev
            self.sleep_level = level
            self.asleep_tags = set(SLEEP_TAGS) if level > 0 else set()
            self.discarded = self.discarded or level == 2
            self._notify()
            log(f"slept level={level} mode={mode} in {time.monotonic() - t0:.3f}s")

    async def wake(self, tags: list[str] | None) -> bool:
        """vLLM's ``wake_up``: wake ``tags`` (None: all), then resume scheduling if
        nothing is asleep any more (this also ends a pause). True when fully awake.

        As in vLLM's executor, a tag that is not asleep (unknown, or already awake)
        makes the whole memory wake a logged no-op; ``scheduling`` only resumes."""
        if not self.sleep_mode:
            raise EngineError(
                "Sleep mode is not enabled. Start the server with --enable-sleep-mode.", 400
            )
        async with self._lock:
            if self.hang_wake:
                log("wake_up held (hang_wake fault)")
            await self._until(lambda: not self.hang_wake)
            t0 = time.monotonic()
            if tags is not None:
                tags = [t for t in dict.fromkeys(tags) if t != "scheduling"]
            if tags is None or tags:
                await self._wake_memory(tags)
            if not self.asleep_tags:
                if self.sleeping or self.paused is not None:
                    log(f"woke in {time.monotonic() - t0:.3f}s")
                self.sleep_level = None
                self.paused = None
            self._notify()
            if self.fail_wake > 0:
                self.fail_wake -= 1
                log(f"wake failed after it acted (fail_wake fault; {self.fail_wake} more)")
                raise EngineError("EngineCore encountered an issue (fail_wake fault)", 500)
            return not self.asleep_tags

    async def _wake_memory(self, tags: list[str] | None) -> None:
        if not self.asleep_tags:
            log("wake: not sleeping")
            return
        if tags and any(t not in self.asleep_tags for t in tags):
            log(f"wake: tags {tags} are not all asleep ({sorted(self.asleep_tags)}): no-op")
            return
        want = [t for t in SLEEP_TAGS if t in (tags or self.asleep_tags)]
        core_tags = ["weights" if t == "weights" else "kv" for t in want]
        try:
            await self._core("wake", tags=core_tags)
        except EngineError:
            log(f"wake failed (tags={want}); still sleeping")
            raise
        self.asleep_tags -= set(want)
        if "weights" in want and self.discarded:
            self.identity, self.discarded = RANDOM_WEIGHTS, False
        if self.asleep_tags:
            log(f"woke tags={want}; still sleeping tags={sorted(self.asleep_tags)}")

    # -- weights -------------------------------------------------------------------

    async def _core(self, op: str, **fields: Any) -> dict[str, Any]:
        try:
            return await self.core.call(op, **fields)
        except CoreError as e:
            raise EngineError(str(e)) from e
        except CoreDead as e:
            raise EngineError(DEAD_MESSAGE) from e

    async def collective_rpc(
        self, method: str, args: list[Any], kwargs: dict[str, Any]
    ) -> list[Any]:
        """Only ``reload_weights`` exists; its failures are worker errors (500)."""
        if method != "reload_weights":
            raise rpc_failed(f"'Worker' object has no attribute '{method}'")
        unknown = [k for k in kwargs if k not in RELOAD_KWARGS]
        if unknown:
            raise rpc_failed(
                f"GPUModelRunner.reload_weights() got an unexpected keyword argument '{unknown[0]}'"
            )
        path = kwargs.get("weights_path")
        async with self._lock:
            if "weights" in self.asleep_tags:  # refused before touching the weights
                raise rpc_failed(
                    "cannot load weights while they are offloaded (sleeping); "
                    "call /wake_up?tags=weights first"
                )
            self.busy += 1
            self._notify()
            try:
                if args or kwargs.get("weights_iterator") is not None:
                    # vLLM iterates the first positional arg (weights_iterator), a string
                    raise CoreError("not enough values to unpack (expected 2, got 1)")
                if path is not None and not isinstance(path, str):
                    raise CoreError(
                        f"expected str, bytes or os.PathLike object, not {type(path).__name__}"
                    )
                reply = await self.core.call(
                    "reload",
                    weights_path=path,
                    model=self.loaded_path,
                    seconds=self.reload_seconds,
                    fail=self.fail_reload,
                )
            except CoreError as e:
                self.weights_broken = True
                log(f"reload from {path} failed, weights broken until a reload works: {e}")
                raise rpc_failed(str(e)) from e
            except CoreDead as e:
                raise EngineError(DEAD_MESSAGE) from e
            finally:
                self.busy -= 1
                self._notify()
            self.identity = str(reply["identity"])
            self.discarded = False
            self.weights_broken = False
            self.loaded_path = path or self.loaded_path
            log(f"reloaded weights from {self.loaded_path} (identity={self.identity})")
        return [None]

    def set_weight_version(self, version: str) -> None:
        self.weight_version = version
        log(f"weight version={version}")

    def start_weight_update(self) -> None:
        if self.update_open:
            raise EngineError("A weight update is already in progress.")
        self.update_open = True
        log("weight update started")

    def finish_weight_update(self, version: str | None) -> None:
        if not self.update_open:
            raise EngineError("No weight update is in progress.")
        self.update_open = False
        if version is not None:
            self.weight_version = version
        log(f"weight update finished (version={self.weight_version})")

    # -- generation ----------------------------------------------------------------

    def _emit(self, seq: Seq) -> None:
        # The label is not the content: only the weights decide the text (as in vLLM).
        tok = next_token(seq.key, self.identity, seq.seed, seq.index, len(seq.token_ids))
        n = len(seq.token_ids)
        seq.token_ids.append(tok.id)
        self.generated_tokens += 1
        if seq.versions and seq.versions[-1]["version"] == self.weight_version:
            seq.versions[-1]["end"] = n + 1
        else:
            seq.versions.append({"version": self.weight_version, "start": n, "end": n + 1})
        start = max(0, len(seq.text) - max((len(s) for s in seq.stop), default=0))
        seq.text += tok.text
        hits = [(seq.text.find(s, start), s) for s in seq.stop if s]
        hits = [(i, s) for i, s in hits if i >= 0]
        if hits:
            i, s = min(hits)
            seq.text = seq.text[:i]
            seq.finish_reason, seq.stop_reason = "stop", s
        elif len(seq.token_ids) >= seq.max_tokens:
            seq.finish_reason = "length"

    async def generate(self, req: GenRequest) -> AsyncGenerator[None, None]:
        """Step ``req`` until every choice finished; yields after each step."""
        self.requests.add(req)
        self.prompt_tokens += sum(len(s.prompt_ids) for s in req.seqs)
        self._notify()
        try:
            while any(s.finish_reason is None for s in req.seqs):
                with trio.CancelScope() as scope:
                    req.scope = scope
                    if req.aborted:
                        scope.cancel()
                    if not self.gate_open:
                        req.held = not any(s.token_ids for s in req.seqs)
                        if req.held:
                            log("request held at the gate (asleep, paused or reloading)")
                        self._notify()
                        await self._until(lambda: self.gate_open)
                    if req.held:
                        req.held = False
                        self._notify()
                    await self._until(lambda: not self.hang_requests)
                    if self._holds(req):
                        await trio.sleep_forever()  # until an abort cancels the scope
                    if self.weights_broken:
                        self._crash("a forward pass on broken weights (failed reload)")
                        raise EngineError(DEAD_MESSAGE)
                    await trio.sleep(1.0 / self.tokens_per_s)
                req.scope = None
                if req.error is not None:
                    raise req.error
                if req.aborted:
                    for s in req.seqs:
                        if s.finish_reason is None:
                            s.finish_reason = "abort"
                    yield
                    return
                if not self.gate_open:  # the step ended inside a freeze: redo it
                    continue
                for s in req.seqs:
                    if s.finish_reason is None:
                        self._emit(s)
                yield
        finally:
            self.requests.discard(req)
            self._notify()

    def _holds(self, req: GenRequest) -> bool:
        k = req.hold_after
        if not self.hold_scheduler or k is None:
            return False
        return all(len(s.token_ids) >= k for s in req.seqs if s.finish_reason is None)

    def _crash(self, why: str) -> None:
        """Kill the engine core as a real one dies (the server then exits 1)."""
        log(f"engine core crashes: {why}")
        self.core.kill()

    @contextlib.asynccontextmanager
    async def steps(self, req: GenRequest) -> AsyncIterator[AsyncIterator[None]]:
        """``generate`` as a context manager that always closes the generator."""
        gen = self.generate(req)
        try:
            yield gen
        finally:
            await gen.aclose()
