"""Age-bounded reuse of a clean GPU reading for a grant check (`verify_reuse_ms`).

A re-ACQUIRE within the window is granted on the reading of the grant before it; after
the window, after anything that changes who may be on the GPU, and after a reading that
found foreign memory, the GPU is read again, so a foreign process is caught. In-process
(`tests/inproc.py`) on virtual time: the window is crossed with `MockClock.jump`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
import trio.testing

from gpu_slicer.slicer.config import load
from gpu_slicer.slicer.errors import ConfigError
from gpu_slicer.slicer.state import Limits
from tests.inproc import Client, GiB, Stack, inproc_server

BOUND = 60  # virtual seconds
WINDOW = 0.020  # the default verify_reuse_ms, in seconds
STRANGER = 4242


class Reads:
    """Counts the server's reads of the GPU backend's processes."""

    def __init__(self, s: Stack, monkeypatch: pytest.MonkeyPatch) -> None:
        self.n = 0
        read = s.gpu.processes

        def counted(index: int) -> dict[int, int]:
            self.n += 1
            return read(index)

        monkeypatch.setattr(s.gpu, "processes", counted)


async def solo(s: Stack, held: int = 10 * GiB) -> Client:
    """Registers "a" (pid 101 holding `held` bytes, cooperative: it stays resident
    between turns); returns a client that takes its turns."""
    s.host.spawn(101)
    if held:
        s.gpu.load(101, held)
    reg = await s.client()
    state = "idle" if held else "registered"
    assert (await reg.ask("REGISTER a pid=101 park=cooperative")).endswith(f"state={state}")
    return await s.client()


async def turn(c: Client, name: str = "a") -> None:
    """One turn: ACQUIRE granted, RELEASE (no park)."""
    reply = await c.ask(f"ACQUIRE {name}")
    assert reply.startswith("OK turn="), reply
    t = reply.split()[1].removeprefix("turn=")
    assert await c.ask(f"RELEASE {name} turn={t}") == "OK parked=0 park_ms=0"


def stranger_arrives(s: Stack) -> None:
    s.host.spawn(STRANGER)
    s.gpu.load(STRANGER, GiB)  # nobody's process


async def refused_for_the_stranger(s: Stack, c: Client) -> None:
    """ACQUIRE a is not granted: STATUS names the stranger as what blocks it."""
    await c.send("ACQUIRE a")
    st = await s.until(lambda st: st["gpus"][0]["foreign"] != [])
    assert st["gpus"][0]["foreign"] == [{"pid": STRANGER, "bytes": GiB}]
    assert st["gpus"][0]["holder"] is None


async def test_a_re_acquire_within_the_window_reads_the_gpu_once_for_two_grants(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    with trio.fail_after(BOUND):
        async with inproc_server(tmp_path) as s:
            c = await solo(s)
            reads = Reads(s, monkeypatch)
            await turn(c)
            await turn(c)
            assert reads.n == 1
            autojump_clock.jump(WINDOW)  # the reading is as old as the window: read again
            await turn(c)
            assert reads.n == 2
            await turn(c)
            assert reads.n == 2


async def test_with_a_zero_window_every_grant_reads_the_gpu(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    with trio.fail_after(BOUND):
        async with inproc_server(tmp_path, verify_reuse_ms=0) as s:
            c = await solo(s)
            reads = Reads(s, monkeypatch)
            for _ in range(5):
                await turn(c)
            assert reads.n == 5
            stranger_arrives(s)
            await refused_for_the_stranger(s, c)  # the very next grant catches it


async def test_a_foreign_process_is_caught_by_the_first_grant_after_the_window(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    with trio.fail_after(BOUND):
        async with inproc_server(tmp_path) as s:
            c = await solo(s)
            await turn(c)
            stranger_arrives(s)
            # The trade: within the window of a clean reading, it is reused.
            await turn(c)
            autojump_clock.jump(WINDOW)
            await refused_for_the_stranger(s, c)
            s.host.exit(STRANGER)
            assert (await c.line()).startswith("OK turn=3 ")  # granted once it left
            assert (await s.status())["gpus"][0]["foreign"] == []


async def _register_b(s: Stack, c: Client) -> None:
    s.host.spawn(102)
    reg_b = await s.client()
    assert await reg_b.ask("REGISTER b pid=102") == "OK workload=b gpu=0 state=registered"


async def _unregister_b(s: Stack, c: Client) -> None:
    # b registered before a's reading; its unregistration comes after it.
    reg_b = s.clients[-1]
    assert await reg_b.ask("UNREGISTER b") == "OK"


async def _grant_b(s: Stack, c: Client) -> None:
    await turn(c, "b")  # neither holds memory: granted without a park


async def _park_a(s: Stack, c: Client) -> None:
    reply = await c.ask("ACQUIRE a")
    t = reply.split()[1].removeprefix("turn=")
    s.gpu.mem[0].pop(101)  # cooperative: a frees the GPU itself
    assert await c.ask(f"RELEASE a turn={t} park=now") == "OK parked=1 park_ms=0"


@pytest.mark.parametrize(
    "event",
    [_register_b, _unregister_b, _grant_b, _park_a],
    ids=["register", "unregister", "grant-to-another", "park"],
)
async def test_a_foreign_process_is_caught_by_the_next_grant_after_an_invalidating_event(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, event: object
) -> None:
    with trio.fail_after(BOUND):
        async with inproc_server(tmp_path) as s:
            # Neither holds memory when b is granted: no park comes between.
            c = await solo(s, held=0 if event is _grant_b else 10 * GiB)
            if event in (_unregister_b, _grant_b):
                await _register_b(s, c)
            await turn(c)  # a clean reading, for a
            assert callable(event)
            await event(s, c)
            stranger_arrives(s)
            await refused_for_the_stranger(s, c)  # within the window, yet read again
            s.host.exit(STRANGER)
            assert (await c.line()).startswith("OK turn=")


async def test_a_reading_that_refused_a_grant_is_never_reused(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The blocked GPU is looked at again every 5 ms, well within the 20 ms window: each
    # look reads the backend, and the first one after the stranger left grants.
    limits = Limits(recheck_every=0.005)
    with trio.fail_after(BOUND):
        async with inproc_server(tmp_path, limits) as s:
            c = await solo(s)
            stranger_arrives(s)
            reads = Reads(s, monkeypatch)
            await refused_for_the_stranger(s, c)
            s.host.exit(STRANGER)
            before = reads.n
            t0 = trio.current_time()
            assert (await c.line()).startswith("OK turn=1 ")
            assert trio.current_time() - t0 <= 0.005
            assert reads.n == before + 1


def test_the_window_is_configured_and_bounded(tmp_path: Path) -> None:
    conf = tmp_path / "slicer.toml"
    conf.write_text("verify_reuse_ms = 0\n")
    assert load(str(conf)).verify_reuse_ms == 0.0
    conf.write_text("")
    assert load(str(conf)).verify_reuse_ms == 20.0
    assert load(str(conf), {"verify_reuse_ms": 5.0}).verify_reuse_ms == 5.0
    for bad in ("-1", "1001"):
        conf.write_text(f"verify_reuse_ms = {bad}\n")
        with pytest.raises(ConfigError, match="verify_reuse_ms must be in"):
            load(str(conf))
