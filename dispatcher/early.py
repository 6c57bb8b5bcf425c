"""Early starts: wake and load the weights while slicerd still parks the workload before us.

A switch from the trainer to this replica used to be serial: slicerd moved the trainer's
working set to host memory, granted the turn, and only then did the dispatcher wake vLLM
and load the new weights (a checkpoint read, seconds at 8B). With ``ACQUIRE <w> early=N``
(:mod:`slicer.early` on slicerd's side) the two overlap: once slicerd has locked the
trainer and finds N bytes free beside it, it sends ``EARLY <w> bytes=N``, and the
dispatcher, still waiting for its grant (phase ``PREPARING``), wakes the weights
(``/wake_up?tags=weights``) and loads the revision its turn will serve first, while the
trainer is checkpointed. The KV cache, which needs the rest of the GPU, is woken only
after the grant (``/wake_up?tags=kv_cache``, ``/reset_prefix_cache``), so vLLM still wakes
in its level-2 order and nothing is sent before the grant.

How many bytes (``slicer-dispatch --early-start auto|off|SIZE``, :meth:`EarlyStart.asked`):
``auto`` asks for the size of the weight files of the revision the turn would load first
(or of the loaded one, for a level-1 wake that only brings the weights back; `weight_bytes`:
its ``*.safetensors``, else its ``*.bin``, ``*.pt`` and ``*.pth`` but a trainer's own
state): what vLLM's weights take on the GPU when it serves the checkpoint's dtype; a
replica that serves another dtype (a quantised one) needs SIZE.
Nothing is asked when nothing would be loaded or woken (no revision known) or when the
sizes cannot be read (pool mode before a claim, ``--no-check-revision-paths``).
slicerd sends EARLY only when it is safe (the ``slicer.early`` docstring); otherwise the
turn goes as without.

What the early stage does (:meth:`EarlyStart.prepare`; every step bounded as in a turn):
the replica is recovered when a turn would recover it first (first sight, after a broken
load, another label at ``/weight_info``: one bare ``finish_weight_update``); a replica we
left awake but slicerd reports slept (it asked the launcher to sleep it) is read as in a
turn (``/metrics``' sleep state); then ``wake_weights`` and, when the wanted
revision is not the one loaded, a whole load (:meth:`Serving.load_whole
<dispatcher.serve.Serving.load_whole>`, backoff and counters included). Then it waits
for the grant; the turn starts with the KV cache's wake (:mod:`dispatcher.turns`).

Failures: a wake or load that fails early is logged, counted (``early_failed``) and left
to the turn: it recovers the replica and loads again after the grant (the requests stay
pending). An ACQUIRE that ends without a grant after an early start (slicerd gone; its
``wait=`` runs on at least slicerd's ``early_hold`` once told EARLY) leaves vLLM with its
weights on the GPU and its KV cache asleep (a ``/sleep`` then is a no-op in vLLM):
slicerd parks it by cuda-checkpoint before it grants anyone else. An early stage still
running then is cut off (:meth:`EarlyStart.interrupted`: what vLLM holds is unknown), so
the loop never waits on a wake or load that a lock may hold up; the next turn recovers
the replica and wakes it in the level-2 order with a whole load. One that had ended
finishes its wake from where it stands (``kv_asleep``).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import trio

from gpu_slicer import proto
from gpu_slicer.dispatcher.errors import DispatchError, ReplicaError
from gpu_slicer.dispatcher.events import EventStream
from gpu_slicer.dispatcher.model import Counters, Phase, TurnConfig
from gpu_slicer.dispatcher.recovery import Recovery
from gpu_slicer.dispatcher.serve import Serving
from gpu_slicer.dispatcher.store import Store
from gpu_slicer.dispatcher.vllm import CONTROL_TIMEOUT_S, Replica
from gpu_slicer.proto import ClientError, ErrorCode

__all__ = ["WEIGHT_SUFFIXES", "EarlyStart", "weight_bytes"]

log = logging.getLogger("dispatcher.turns")

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
# What a trainer saves beside its weights (Hugging Face's Trainer and friends): never the
# served model's bytes.
NOT_WEIGHTS = ("optimizer", "scheduler", "rng_state", "training_args", "trainer_state")
MAX_ENTRIES = 10_000  # a checkpoint directory holds tens of files; never list forever
SIZE_TIMEOUT_S = 5.0  # listing a revision's directory (a slow network file system)


def weight_bytes(path: str) -> int:
    """The bytes of the model's weight files directly in directory `path`: its
    ``*.safetensors`` where there are any (vLLM loads those first), else its ``*.bin``,
    ``*.pt`` and ``*.pth`` but a trainer's own state (`NOT_WEIGHTS`); 0 when there are
    none or the directory cannot be read."""
    sizes: dict[str, int] = {}
    try:
        with os.scandir(path) as entries:
            for i, entry in enumerate(entries):
                if i >= MAX_ENTRIES:
                    break
                name = entry.name
                weights = name.endswith(WEIGHT_SUFFIXES) and not name.startswith(NOT_WEIGHTS)
                if weights and entry.is_file():
                    sizes[name] = entry.stat().st_size
    except OSError:
        return 0
    safe = [n for n in sizes if n.endswith(".safetensors")]
    return sum(sizes[n] for n in (safe or sizes))


def _since(t0: float) -> float:
    return round(time.monotonic() - t0, 6)


class EarlyStart:
    """The early stage of one replica's turns (module docstring)."""

    def __init__(
        self,
        cfg: TurnConfig,
        store: Store,
        replica: Replica,
        serving: Serving,
        recovery: Recovery,
        *,
        counters: Counters,
        events: EventStream,
        enter: Callable[[Phase], None],
        off: bool = False,
    ) -> None:
        self.cfg, self.store, self.replica = cfg, store, replica
        self.serving, self.recovery = serving, recovery
        self.counters, self.events, self._enter = counters, events, enter
        # Pool mode (claims only inside a held turn; ACQUIREs ask again every few
        # seconds), or a slicerd that refused early= (older than early starts).
        self.off = off
        self._sizes: dict[str, int] = {}  # revision -> weight bytes (auto), read once

    def refused(self, e: ClientError) -> None:
        """An ACQUIRE with ``early=`` failed with `e`: a slicerd that does not know the
        key (``bad-argument`` naming it) gets no more early starts from this loop."""
        if e.code == ErrorCode.BAD_ARGUMENT and "early" in str(e) and not self.off:
            log.warning("slicerd refused ACQUIRE early= (%s): no early starts", e)
            self.off = True

    async def asked(self) -> int:
        """The bytes to ask for with ``ACQUIRE ... early=`` now (0: no early start)."""
        if self.off or self.cfg.early_start == 0:
            return 0
        if self.cfg.early_start is not None:
            return self.cfg.early_start
        try:
            want = self.serving.choose(trio.current_time()) or self.replica.known_version
            if want is None:
                return 0
            if want not in self._sizes:
                path = self.store.revision(want).path
                with trio.move_on_after(SIZE_TIMEOUT_S):  # the listing runs off the loop
                    n = await trio.to_thread.run_sync(weight_bytes, path, abandon_on_cancel=True)
                    if n > 0:  # a directory that could not be read is asked again later
                        self._sizes[want] = n
        except DispatchError:
            return 0  # the store cannot say (it is broken, or the revision is gone)
        n = self._sizes.get(want, 0)
        if n > proto.EARLY_LIMIT:  # no GPU holds that: a mistake in the directory
            log.warning("revision %s: weight files of %d bytes, more than any GPU holds; no "
                        "early start", want, n)  # fmt: skip
            return 0
        return n

    def interrupted(self) -> None:
        """The ACQUIRE ended without its grant while the early stage ran, and the stage
        was cut off: what vLLM holds is unknown (a wake or load may go on inside it). The
        next turn recovers it and wakes it in the level-2 order with a whole load."""
        self.recovery.needed = True
        self.replica.forget()
        self.replica.awake, self.replica.kv_asleep, self.replica.dropped = False, False, True
        # Read back first; the stage may have woken the weights alone: a turn's end wakes
        # it whole before its sleep.
        self.replica.unknown = self.replica.half_woken = True

    async def prepare(self, nbytes: int) -> None:
        """slicerd said ``EARLY`` (`nbytes` may be used): wake the weights and load the
        revision the turn will serve first, before the grant. A failure is logged and
        left to the turn (module docstring); it never raises but for cancellation."""
        self._enter(Phase.PREPARING)
        self.counters.early_starts += 1
        t0 = time.monotonic()
        log.info("early start: %d bytes free beside the workload being parked", nbytes)
        self.events.publish("early", bytes=nbytes)
        try:
            await self._prepare()
        except (ReplicaError, DispatchError) as e:
            self.counters.early_failed += 1
            self.recovery.needed = True  # what a broken wake or load left is unknown
            log.warning("early start failed (the turn wakes and loads again): %s", e)
            self.events.publish("early_failed", error=str(e), duration_s=_since(t0))

    async def _prepare(self) -> None:
        r = self.replica
        if r.unknown:  # a control call failed before: what it holds is read back first
            found = await r.settle(min(self.cfg.wake_timeout, CONTROL_TIMEOUT_S))
            log.info("early start: read the replica back after a failed call: %s", found)
            self.events.publish("settled", turn=None, early=True, found=found)
        await self.recovery.check(0)  # a restarted replica: recovered now, as in a turn
        if self.recovery.needed:
            t0 = time.monotonic()
            await r.recover()
            self.recovery.needed = False
            log.info("early start: recovered the replica in %.3f s", time.monotonic() - t0)
            self.events.publish("recovered", turn=None, early=True, duration_s=_since(t0))
        if r.awake:
            # We left it awake; slicerd sends EARLY only for a slept one: someone else
            # (its launcher, asked by slicerd) slept it meanwhile.
            r.slept_by_other(await r.sleep_state(min(self.cfg.wake_timeout, CONTROL_TIMEOUT_S)))
        copies = not r.dropped  # a level-1 sleep kept them in host memory: they come back
        t1 = time.monotonic()
        await r.wake_weights(self.cfg.wake_timeout)
        log.info("early start: woke the weights in %.3f s", time.monotonic() - t1)
        self.events.publish("woke", turn=None, early=True, duration_s=_since(t1),
                            tags=["weights"], copies=copies)  # fmt: skip
        want = self.serving.choose(trio.current_time())
        if want is not None and want != r.known_version:
            await self.serving.load_whole(None, want)
