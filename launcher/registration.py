"""The registrant connection: REGISTER once, read it for the launcher's whole life,
re-REGISTER after a drop.

Theory of operation
-------------------
The workload lives exactly as long as this connection, so the launcher keeps it open
while the child runs and closes it when the child is gone. It is registered with the
launcher's own pid and `tree=1`: every process the child spawns, at any depth, counts.

One task (`serve`) reads the connection's FAULT, WAITING and PARK lines: a FAULT may
arrive at any moment and must reach the supervisor at once. After REGISTER the only
request sent on it is the `PARKED` answer to a `PARK` (a boot turn uses a connection of
its own): a task of its own parks the workload and sends the answer, and the client's
session hands that task its reply, whichever of the two tasks read it.

When the connection drops (slicerd restarted, crashed, or closed us), `serve` reconnects
with exponential backoff (`backoff_min` .. `backoff_max`, each attempt bounded by
`request_timeout`) and REGISTERs the same name for the same pid: a restarted daemon
adopts the parked state it journalled for that process. It keeps trying forever; the
child is never killed for a lost daemon.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from gpu_slicer import proto
from gpu_slicer.launcher.config import LaunchConfig, log
from gpu_slicer.slicer.client import AsyncSlicer, ClientError, Faulted, Unreachable, socket_path

WHY_TIMEOUT_S = 2.0  # for the STATUS read that says why a park was asked
UNKNOWN_WHY = (
    "its turn has ended with it still on the GPU (slicerd's log and `slicerctl watch` "
    "park-asked say why)"
)


def park_reason(status: dict[str, Any], workload: str) -> str | None:
    """The ``park_reason`` of the GPU of ``workload`` in a STATUS answer (None: none)."""
    rows = status.get("workloads")
    gpus = status.get("gpus")
    if not isinstance(rows, list) or not isinstance(gpus, list):
        return None
    for w in rows:
        if isinstance(w, dict) and w.get("name") == workload:
            for g in gpus:
                if isinstance(g, dict) and g.get("index") == w.get("gpu"):
                    why = g.get("park_reason")
                    return why if isinstance(why, str) else None
    return None


def _why(e: BaseException) -> str:
    """A short reason (TooSlowError has no text)."""
    return str(e) or type(e).__name__


class Refused(Exception):
    """slicerd answered the first REGISTER with ERR, or the client refused to send it for
    the reason slicerd would give (a malformed name): `code` is the wire code, `text` its
    words."""

    def __init__(self, code: str, text: str) -> None:
        super().__init__(f"{code}: {text}" if text else code)
        self.code, self.text = code, text


class Registration:
    """The workload's registration, kept and re-made for the launcher's whole life."""

    def __init__(
        self,
        cfg: LaunchConfig,
        on_fault: Callable[[proto.Fault], None],
        on_park: Callable[[float], Awaitable[bool]] | None = None,
    ) -> None:
        self.cfg = cfg
        self.socket = os.path.abspath(socket_path(cfg.socket))
        self.on_fault = on_fault
        # Parks the workload when slicerd asks (PARK); None: this launcher cannot.
        self.on_park = on_park
        self.conn: AsyncSlicer | None = None
        self.registrations = 0  # how many REGISTERs succeeded (1 + reconnects)

    def _fields(self) -> dict[str, Any]:
        kw: dict[str, Any] = {
            "pid": os.getpid(),
            "tree": True,
            "park": self.cfg.park,
            "parked_max": self.cfg.parked_max,
            "fallback": self.cfg.park_fallback,
            "ask": self.on_park is not None and self.cfg.park == "cooperative",
        }
        if self.cfg.gpu is not None:
            kw["gpu"] = self.cfg.gpu
        if self.cfg.max_turn is not None:
            kw["max_turn"] = self.cfg.max_turn
        return kw

    async def _attempt(self) -> AsyncSlicer:
        """One bounded connect + REGISTER; the open connection on success."""
        with trio.fail_after(self.cfg.request_timeout):
            conn = await AsyncSlicer.connect(self.socket)
            try:
                reply = await conn.register(self.cfg.workload, **self._fields())
            except BaseException:
                await conn.aclose()
                raise
        self.registrations += 1
        log.info(
            "registered %s gpu=%s state=%s (pid %d, tree)",
            self.cfg.workload,
            reply.get("gpu"),
            reply.get("state"),
            os.getpid(),
        )
        return conn

    async def open(self) -> None:
        """The first REGISTER: retry an unreachable daemon up to `connect_timeout`.

        Raises Refused on ERR (or a name slicerd would refuse: it is never sent),
        Unreachable when the daemon stayed out of reach (its text says why).
        """
        try:
            proto.validate_name(self.cfg.workload)
        except proto.ProtocolError as e:
            raise Refused(e.code, f"REGISTER: {e.message}") from None
        delay = self.cfg.backoff_min
        deadline = trio.current_time() + self.cfg.connect_timeout
        while True:
            try:
                self.conn = await self._attempt()
                return
            except ClientError as e:
                if not isinstance(e, Unreachable):
                    raise Refused(e.code, e.text) from e
                why = e.text
            except trio.TooSlowError:
                why = f"no answer in {self.cfg.request_timeout:g} s"
            if trio.current_time() + delay > deadline:
                raise Unreachable(why)
            # One line says why the launcher waits; the retries themselves are debug.
            first = delay == self.cfg.backoff_min
            (log.warning if first else log.debug)(
                "waiting for slicerd at %s (up to %g s): %s",
                self.socket,
                self.cfg.connect_timeout,
                why,
            )
            await trio.sleep(delay)
            delay = min(delay * 2, self.cfg.backoff_max)

    async def _reconnect(self) -> AsyncSlicer:
        """Connect and re-REGISTER, with backoff, forever (each attempt bounded)."""
        delay = self.cfg.backoff_min
        while True:
            try:
                return await self._attempt()
            except (ClientError, proto.ProtocolError, trio.TooSlowError) as e:
                log.warning("re-register failed (%s); retrying in %.1f s", _why(e), delay)
            await trio.sleep(delay)
            delay = min(delay * 2, self.cfg.backoff_max)

    async def serve(self) -> None:
        """Read the registrant connection forever; FAULTs go to `on_fault`, PARKs to a
        task of their own (a FAULT is never read late behind a slow park); reconnect
        after a drop. Cancel it to stop (then `aclose`)."""
        async with trio.open_nursery() as parks:
            while True:
                if self.conn is None:
                    self.conn = await self._reconnect()
                try:
                    while True:
                        msg = await self.conn.next_message()
                        if isinstance(msg, proto.Fault):
                            log.error("FAULT turn=%d reason=%s %s", msg.turn, msg.reason, msg.text)
                            self.on_fault(msg)
                        elif isinstance(msg, proto.Waiting):
                            log.debug("WAITING turn=%d waiters=%d", msg.turn, msg.waiters)
                        elif isinstance(msg, proto.ParkAsk):
                            parks.start_soon(self._park, self.conn, msg)
                except (Unreachable, proto.ProtocolError) as e:
                    log.warning("lost slicerd (%s): reconnecting", e)
                conn, self.conn = self.conn, None
                await conn.aclose()

    async def _park(self, conn: AsyncSlicer, ask: proto.ParkAsk) -> None:
        """slicerd asks us to park the workload (nobody else can): do it, answer."""
        why = await self._why_asked(ask.workload)
        log.warning("slicerd asks to park %s (turn %d): %s", ask.workload, ask.turn,
                    why or UNKNOWN_WHY)  # fmt: skip
        ok = False
        # slicerd waits this long for our answer; past it, it goes on without us.
        window = ask.timeout_ms / 1000 if ask.timeout_ms is not None else 60.0
        if self.on_park is not None:
            try:
                with trio.move_on_after(window):
                    ok = await self.on_park(window)
            except Exception as e:  # whatever broke, slicerd must get an answer
                log.error("park failed: %s", _why(e))
        try:
            with trio.fail_after(self.cfg.request_timeout):
                await conn.parked(ask.workload, ask.turn, ok)
        except (Unreachable, proto.ProtocolError, trio.TooSlowError) as e:
            # A broken connection is `serve`'s to notice and re-make.
            log.warning("PARKED answer not sent: %s", _why(e))
        except Faulted as e:  # `serve` takes the FAULT line itself
            log.warning("PARKED answered while faulted: %s", e)
        except ClientError as e:
            # not-asked: slicerd's window passed and it went on.
            log.warning("PARKED answer refused: %s %s", e.code, e.text)

    async def _why_asked(self, workload: str) -> str | None:
        """Why slicerd asked: its STATUS ``park_reason`` for the GPU of ``workload``, read
        on a connection of its own (the PARK line has no room for it: its parser refuses
        unknown keys, older launchers' too). None when it cannot be read in
        `WHY_TIMEOUT_S`: the ask waits for our answer, so this goes first, bounded."""
        with trio.move_on_after(WHY_TIMEOUT_S):
            try:
                async with await AsyncSlicer.connect(self.socket, timeout=WHY_TIMEOUT_S) as c:
                    st = await c.status()
            except (ClientError, proto.ProtocolError) as e:
                log.debug("the park's reason is not known: %s", _why(e))
                return None
            return park_reason(st, workload)
        return None

    async def aclose(self) -> None:
        """Close the connection: the daemon ends the registration."""
        if self.conn is not None:
            conn, self.conn = self.conn, None
            with trio.CancelScope(shield=True):
                await conn.aclose()
