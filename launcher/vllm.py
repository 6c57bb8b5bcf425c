"""The vLLM profile: boot `vllm serve` inside a turn, sleep it, give the GPU back.

Theory of operation
-------------------
vLLM takes most of the GPU the moment it starts, so it may only boot while it holds a
turn. Before the child starts, `before_start` checks that nothing listens on the server's
HOST:PORT yet (a TCP connect that succeeds: another process, such as a vLLM left over
from an earlier launch, would answer the probes below in the replica's place; the launch
fails at once, exit 1, before any boot turn), then ACQUIREs a *boot turn* for the
workload on a connection of its own (bounded by `--boot-timeout` through `wait=`); the
registrant connection stays owned by its reader. Then `after_start`:

1. polls `GET /health` every 0.25 s (each probe bounded) until 200, within
   `--health-timeout`; a child that exits ends the wait at once (the supervisor
   cancels the flow);
2. `POST /sleep?level=N` and checks `GET /is_sleeping` is true;
3. RELEASEs the boot turn with `park=now`, so slicerd verifies, through the GPU backend,
   that the slept replica holds no more than `parked_max` (or checkpoints it, with
   `--park checkpoint`) before the replica is declared ready;
4. writes the ready marker atomically and sends READY=1 to systemd.

The ready marker exists exactly while the replica can serve: a stale one is removed at
start, and it is removed on every stop, FAULT first of all. A failed boot leaves
nothing behind: the supervisor stops the child by the grace rule and closing the boot
connection ends the turn even if RELEASE never went out.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import httpx
import trio

from gpu_slicer.launcher.child import Child
from gpu_slicer.launcher.config import Exit, VllmConfig, log
from gpu_slicer.launcher.supervise import BootFailed, Profile, Supervisor
from gpu_slicer.proto.vllm_metrics import parse_sleep_state
from gpu_slicer.slicer.client import AsyncSlicer, ClientError, Turn, Unreachable
from gpu_slicer.slicer.notify import sd_notify

SLEEP_FLAG = "--enable-sleep-mode"
PROBE_TIMEOUT = 2.0  # one /health probe
CALL_TIMEOUT = 30.0  # /is_sleeping and RELEASE


def _flag(argv: Sequence[str], name: str) -> str | None:
    """The value of `--name X` or `--name=X` in argv (the last one wins), else None."""
    value = None
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


def server_address(argv: Sequence[str]) -> tuple[str, int]:
    """(HOST, PORT) the server `argv` starts listens on, as a client reaches it (a
    wildcard host reads as loopback)."""
    host = _flag(argv, "--host") or "127.0.0.1"
    port = _flag(argv, "--port") or "8000"
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return host, int(port)


def server_url(argv: Sequence[str]) -> str:
    """http://HOST:PORT of the server `argv` starts (a wildcard host reads as loopback)."""
    host, port = server_address(argv)
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


async def listening(host: str, port: int, timeout: float = PROBE_TIMEOUT) -> bool:
    """Whether something accepts TCP connections on HOST:PORT now (refused, unreachable
    or no answer within `timeout`: nothing does)."""
    with trio.move_on_after(timeout):
        try:
            stream = await trio.open_tcp_stream(host, port)
        except OSError:
            return False
        await stream.aclose()
        return True
    return False


def write_marker(path: Path, text: str) -> None:
    """Write `path` atomically (a temporary file renamed over it)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class VllmProfile(Profile):
    """Boot turn, health, sleep, release, ready marker."""

    boots = True
    parks = True

    def __init__(self, cfg: VllmConfig, workload: str) -> None:
        self.cfg = cfg
        self.workload = workload
        self.url = "http://127.0.0.1:8000"
        self._boot: AsyncSlicer | None = None
        self._turn: Turn | None = None
        self._t0 = self._launched = time.monotonic()

    def command(self, argv: Sequence[str]) -> list[str]:
        """argv plus --enable-sleep-mode (unless present or turned off)."""
        out = list(argv)
        if self.cfg.sleep_mode_flag and SLEEP_FLAG not in out:
            out.append(SLEEP_FLAG)
        self.url = server_url(out)
        return out

    def env(self, base: Mapping[str, str]) -> dict[str, str]:
        """The dev routes (/sleep, /is_sleeping) need VLLM_SERVER_DEV_MODE=1."""
        return {**base, "VLLM_SERVER_DEV_MODE": "1"}

    def not_ready(self) -> None:
        """Remove the ready marker (idempotent)."""
        self.ready = False
        if self.cfg.ready_file is not None:
            try:
                self.cfg.ready_file.unlink()
                log.info("removed ready marker %s", self.cfg.ready_file)
            except FileNotFoundError:
                pass

    async def before_start(self, sup: Supervisor) -> None:
        """Check the server's port is free, then ACQUIRE the boot turn on a connection of
        its own, within --boot-timeout."""
        host, port = server_address(self.command(sup.argv))
        if await listening(host, port):
            raise BootFailed(
                Exit.FAILED,
                f"{host}:{port} is taken: another process listens there, and would answer "
                "for the replica",
                "stop it (a vLLM left from an earlier launch?), or give the server another --port",
            )
        timeout = self.cfg.boot_timeout
        log.info("waiting for a boot turn (at most %.0f s)", timeout)
        with trio.move_on_after(timeout + 5) as scope:
            try:
                with trio.fail_after(sup.cfg.request_timeout):
                    self._boot = await AsyncSlicer.connect(sup.reg.socket)
                self._turn = await self._boot.acquire(self.workload, wait=timeout)
            except (Unreachable, trio.TooSlowError) as e:
                raise BootFailed(
                    Exit.FAILED, f"slicerd lost while waiting for a turn: {e!r}"
                ) from e
            except ClientError as e:
                if e.code == "timeout":
                    msg = f"boot turn not granted in {timeout:.0f} s"
                    raise BootFailed(Exit.TIMEOUT, msg) from e
                raise BootFailed(Exit.FAILED, f"boot turn refused: {e}") from e
        if scope.cancelled_caught:
            raise BootFailed(Exit.TIMEOUT, f"boot turn not granted in {timeout:.0f} s")
        assert self._turn is not None
        log.info("boot turn %d granted (waited %d ms)", self._turn.turn, self._turn.waited_ms)
        self._t0 = time.monotonic()

    async def after_start(self, sup: Supervisor, child: Child) -> None:
        """Health, sleep, release, marker, READY=1."""
        async with httpx.AsyncClient(base_url=self.url, timeout=PROBE_TIMEOUT) as http:
            await self._wait_healthy(http)
            healthy = time.monotonic() - self._t0
            await self._sleep(http)
        slept = time.monotonic() - self._t0
        await self._release()
        if self.cfg.ready_file is not None:
            try:
                write_marker(self.cfg.ready_file, f"{self.workload} {child.pid} {self.url}\n")
            except OSError as e:
                raise BootFailed(Exit.FAILED, f"cannot write the ready marker: {e}") from e
        self.ready = self.ready_seen = True
        sd_notify("READY=1")
        log.info(
            "ready %.2f s after the boot turn (healthy at %.2f s, slept at %.2f s; "
            "%.2f s since launch)",
            time.monotonic() - self._t0,
            healthy,
            slept,
            time.monotonic() - self._launched,
        )

    async def _wait_healthy(self, http: httpx.AsyncClient) -> None:
        log.info("waiting for %s/health (at most %.0f s)", self.url, self.cfg.health_timeout)
        with trio.move_on_after(self.cfg.health_timeout):
            while True:
                try:
                    r = await http.get("/health")
                    if r.status_code == 200:
                        log.info("healthy")
                        return
                    log.debug("/health: %d", r.status_code)
                except httpx.HTTPError as e:
                    log.debug("/health: %s", e)
                await trio.sleep(self.cfg.health_poll)
        raise BootFailed(Exit.TIMEOUT, f"not healthy in {self.cfg.health_timeout:.0f} s")

    async def _sleep(self, http: httpx.AsyncClient) -> None:
        level = self.cfg.sleep_level
        try:
            r = await http.post(f"/sleep?level={level}", timeout=self.cfg.sleep_timeout)
            if r.status_code != 200:
                raise BootFailed(Exit.FAILED, f"POST /sleep: {r.status_code} {r.text[:300]}")
            r = await http.get("/is_sleeping", timeout=CALL_TIMEOUT)
            if r.status_code != 200 or r.json().get("is_sleeping") is not True:
                raise BootFailed(Exit.FAILED, f"not asleep after /sleep: {r.status_code} {r.text}")
        except httpx.TimeoutException as e:
            raise BootFailed(Exit.TIMEOUT, f"sleep timed out: {e!r}") from e
        except (httpx.HTTPError, ValueError) as e:
            raise BootFailed(Exit.FAILED, f"sleep failed: {e!r}") from e
        log.info("slept (level %d)", level)

    async def park(self, timeout: float) -> bool:
        """slicerd asks to park the replica (its dispatcher died mid-turn, or a lazy
        release that another workload waits behind): sleep it (`mode=abort`: whatever
        the dead dispatcher left running is cut off) and check it is asleep. A replica
        that already says it sleeps is woken whole first (it may be half-woken) and is
        never slept deeper than it was. slicerd then verifies, through the GPU backend,
        on its own."""
        level = self.cfg.sleep_level
        # One deadline for every call of the park (slicerd stops waiting at it): a wake
        # gets at most half of what is left, so that the sleep after it still has time.
        end = trio.current_time() + timeout

        def left(share: float = 1.0) -> float:
            return max(0.0, end - trio.current_time()) * share

        try:
            async with httpx.AsyncClient(base_url=self.url, timeout=CALL_TIMEOUT) as http:
                found = await self._sleep_state(http, min(5.0, timeout / 4))
                was_asleep = await self._whole(http, left)
                if was_asleep is None:
                    return False
                if was_asleep and found != "discard_all" and level > 1:
                    # Its dispatcher may have slept it at level 1 and still believe the
                    # weights are in host memory: a level 2 here would discard them
                    # behind its back. An unreadable state (no metric) is no proof.
                    log.info("park: found asleep (sleep state %s): sleeping it at level 1 "
                             "again, not deeper", found)  # fmt: skip
                    level = 1
                r = await http.post(
                    f"/sleep?level={level}&mode=abort",
                    timeout=min(self.cfg.sleep_timeout, left()),
                )
                if r.status_code != 200:
                    log.error("park: POST /sleep: %d %s", r.status_code, r.text[:300])
                    return False
                r = await http.get("/is_sleeping", timeout=min(CALL_TIMEOUT, left()))
                asleep = r.status_code == 200 and r.json().get("is_sleeping") is True
        except (httpx.HTTPError, ValueError) as e:
            log.error("park: sleep failed: %r", e)
            return False
        if not asleep:
            log.error("park: not asleep after /sleep")
            return False
        log.info("parked on slicerd's request: slept (level %d)", level)
        return True

    async def _sleep_state(self, http: httpx.AsyncClient, timeout: float) -> str | None:
        """What ``GET /metrics`` says of vLLM's sleep (``awake``, ``weights_offloaded``,
        ``discard_all``, ``paused``), or None when it cannot be read within ``timeout``
        (a read only: any failure is None)."""
        try:
            r = await http.get("/metrics", timeout=timeout)
        except httpx.HTTPError as e:
            log.debug("park: GET /metrics: %r", e)
            return None
        return parse_sleep_state(r.text) if r.status_code == 200 else None

    async def _whole(self, http: httpx.AsyncClient, left: Callable[[float], float]) -> bool | None:
        """Before a park's /sleep: whether the replica said it was sleeping, having woken
        it whole if so; None when that wake failed.

        A half-woken replica (weights woken, KV cache not: its holder died between the two
        wakes) says it is sleeping, so a /sleep would do nothing and leave the weights on
        the GPU, perhaps under `parked_max`. slicerd holds the GPU for this park (nobody
        else runs), so a whole wake is safe, and the sleep after it frees everything.
        ``left(share)`` is that share of the park's time left."""
        r = await http.get("/is_sleeping", timeout=min(CALL_TIMEOUT, left(1.0)))
        if r.status_code != 200 or r.json().get("is_sleeping") is not True:
            return False  # awake: the sleep frees what is there
        log.warning("park: the replica says it is sleeping, which a half-woken one (weights "
                    "without KV cache) also says: waking it fully, then sleeping it")  # fmt: skip
        r = await http.post("/wake_up", timeout=min(self.cfg.sleep_timeout, left(0.5)))
        if r.status_code != 200:
            log.error("park: POST /wake_up: %d %s", r.status_code, r.text[:300])
            return None
        return True

    async def _release(self) -> None:
        assert self._boot is not None and self._turn is not None
        try:
            with trio.fail_after(self.cfg.sleep_timeout):
                out = await self._boot.release(self._turn, park="now")
        except Unreachable as e:
            log.warning("lost slicerd before RELEASE (%s): the turn ended with it", e)
        except ClientError as e:
            raise BootFailed(Exit.FAILED, f"RELEASE of the boot turn failed: {e}") from e
        except trio.TooSlowError as e:
            raise BootFailed(Exit.TIMEOUT, "RELEASE of the boot turn timed out") from e
        else:
            log.info("boot turn %d released (parked=%s)", self._turn.turn, out.get("parked"))
        await self.aclose()

    async def aclose(self) -> None:
        """Close the boot connection (that alone ends a turn still held)."""
        if self._boot is not None:
            boot, self._boot = self._boot, None
            with trio.CancelScope(shield=True):
                await boot.aclose()
