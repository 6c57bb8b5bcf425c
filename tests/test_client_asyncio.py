"""The asyncio client (`AsyncioSlicer`) against the real slicerd on the fake GPU, beside the
trio one (`AsyncSlicer`) running the very same trainer loop.

The harness is trio (pytest-trio); the asyncio side is a plain ``asyncio.run`` in a worker
thread (`in_asyncio`), bounded by `asyncio.timeout` there and by `trio.fail_after` here. It
reaches back into the test's trio loop (STATUS waits, the other workload's calls) through
`OnTrio`. Nothing sleeps to wait: every wait is a reply, a WATCH event or an event object.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import signal
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import trio

from gpu_slicer import proto
from gpu_slicer.slicer.client import (
    AsyncioSlicer,
    AsyncSlicer,
    Faulted,
    Turn,
    Unreachable,
    connect_async,
)
from stubs.fakegpu import Ledger
from tests.harness import GiB, Stack, running_stack

T = TypeVar("T")
WAIT = 20.0  # every ACQUIRE's own bound (seconds)
STEPS = 3
WORKING_SET = 30 * GiB  # two of them resident at once on one 80 GiB GPU is an overlap


async def in_asyncio(main: Callable[[], Coroutine[Any, Any, T]], bound: float = 60) -> T:
    """`main()` under a fresh asyncio loop in a worker thread, bounded there by `bound` s."""

    async def bounded() -> T:
        async with asyncio.timeout(bound):
            return await main()

    return await trio.to_thread.run_sync(lambda: asyncio.run(bounded()), abandon_on_cancel=True)


class OnTrio:
    """Awaitable calls, from the asyncio thread, of async functions on the test's trio loop."""

    def __init__(self) -> None:
        self.token = trio.lowlevel.current_trio_token()

    def __call__(self, fn: Callable[..., Awaitable[T]], *args: Any) -> asyncio.Future[T]:
        run = functools.partial(trio.from_thread.run, fn, *args, trio_token=self.token)
        return asyncio.get_running_loop().run_in_executor(None, run)


def queue_is(names: list[str]) -> Callable[[dict[str, Any]], bool]:
    return lambda st: st["gpus"][0]["queue"] == names


def holder(st: dict[str, Any]) -> dict[str, Any] | None:
    h = st["gpus"][0]["holder"]
    return h if isinstance(h, dict) else None


def holder_is(name: str | None) -> Callable[[dict[str, Any]], bool]:
    return lambda st: (holder(st) or {}).get("workload") == name


def released_after(grants: int) -> Callable[[dict[str, Any]], bool]:
    """STATUS once `grants` turns were granted in all and nobody holds GPU 0: a late grant
    was made and given back (too brief to catch the holder itself)."""
    return lambda st: st["totals"]["grants"] == grants and holder(st) is None


async def trainer(socket: str, name: str, pid: int, ledger_dir: str, steps: int) -> list[Turn]:
    """A cooperative trainer loop written once for both loops: it registers, then takes
    `steps` turns with its working set on the fake GPU inside each (freed before the turn
    ends); `connect_async` picks the client of whichever loop runs it."""
    ledger = Ledger(ledger_dir)
    turns: list[Turn] = []
    async with await connect_async(socket, name) as s:
        await s.register(pid=pid, park="cooperative")
        for _ in range(steps):
            async with s.turn(wait=WAIT) as t:
                ledger.alloc(pid, 0, WORKING_SET, tag="weights", workload=name)
                turns.append(t)  # the "training step"
                ledger.free(pid)
        await s.unregister()
    return turns


def test_the_asyncio_client_has_the_trio_client_s_calls() -> None:
    calls = ["connect", "from_env", "aclose", "__aenter__", "__aexit__", "request"]
    calls += ["next_message", "ping", "register", "acquire", "release", "parked"]
    calls += ["unregister", "status", "watch", "turn"]
    for name in calls:
        trio_, asyncio_ = getattr(AsyncSlicer, name), getattr(AsyncioSlicer, name)
        assert inspect.signature(trio_).parameters == inspect.signature(asyncio_).parameters
        assert inspect.iscoroutinefunction(trio_) == inspect.iscoroutinefunction(asyncio_)
    assert AsyncioSlicer.workload is AsyncSlicer.workload  # events, on_event: one SessionView


def test_connect_to_no_daemon_is_unreachable() -> None:
    async def main() -> None:
        with pytest.raises(Unreachable) as e:
            await AsyncioSlicer.connect("/nonexistent/slicer.sock", "w", timeout=5)
        assert "/nonexistent/slicer.sock" in e.value.text

    asyncio.run(main())


GRANT4 = b"OK turn=4 restored=0 waited_ms=0\n"
RELEASED = b"OK parked=0 park_ms=0\n"


def test_a_turn_cancelled_twice_still_waits_for_its_release(tmp_path: Path) -> None:
    """As trio shields it: the RELEASE ending a cancelled turn is waited for even when the
    task is cancelled again meanwhile, and its reply is its own (the connection in step)."""
    path = str(tmp_path / "s.sock")

    async def main() -> list[bytes]:
        seen: list[bytes] = []
        asked, answer = asyncio.Event(), asyncio.Event()

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while line := await reader.readline():
                seen.append(line)
                if line.startswith(b"RELEASE"):
                    asked.set()
                    await answer.wait()
                writer.write(GRANT4 if line.startswith(b"ACQUIRE") else RELEASED)
            writer.close()

        server = await asyncio.start_unix_server(serve, path)
        async with server, await AsyncioSlicer.connect(path, "w") as s:
            inside = asyncio.Event()

            async def body() -> None:
                async with s.turn():
                    inside.set()
                    await asyncio.Event().wait()  # until cancelled

            task = asyncio.create_task(body())
            await inside.wait()
            task.cancel()
            await asyncio.wait_for(asked.wait(), WAIT)
            task.cancel()  # again, while the RELEASE waits for its reply
            await asyncio.sleep(0)  # one loop pass: the task has taken that cancellation
            assert not task.done()
            answer.set()
            with pytest.raises(asyncio.CancelledError):
                await task
            await s.ping()  # RELEASED here is the PING's reply (any OK): in step
        return seen

    assert asyncio.run(main()) == [b"ACQUIRE w\n", b"RELEASE w turn=4\n", b"PING\n"]


def test_a_garbled_line_fails_every_later_call_at_once_and_closes(tmp_path: Path) -> None:
    """A line the session cannot read leaves the connection out of step: the call in
    flight and every later one raise `RemoteProtocolError` at once (before the fix the
    next one waited out its whole timeout), and the client closes the connection."""
    path = str(tmp_path / "s.sock")

    async def main() -> list[bytes]:
        seen: list[bytes] = []
        closed = asyncio.Event()

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while line := await reader.readline():
                seen.append(line)
                writer.write(b"FAULT w turn=1 reason=\xff\xfe\n")
            closed.set()
            writer.close()

        server = await asyncio.start_unix_server(serve, path)
        async with server, await AsyncioSlicer.connect(path, "w") as s:
            with pytest.raises(proto.RemoteProtocolError) as e:
                await s.ping()
            assert e.value.code == proto.ErrorCode.BAD_ENCODING
            async with asyncio.timeout(1):  # each at once: not REPLY_TIMEOUT (30 s)
                for later in (s.ping, s.status, lambda: s.acquire(wait=1.0)):
                    with pytest.raises(proto.RemoteProtocolError):
                        await later()
                await closed.wait()  # closed by the client itself, before aclose
        return seen

    assert asyncio.run(main()) == [b"PING\n"]


@pytest.mark.integration
@pytest.mark.parametrize("loop", ["asyncio", "trio"])
async def test_two_trainers_take_their_turns_in_turn(loop: str) -> None:
    """Two trainer loops contend for GPU 0, both under asyncio (AsyncioSlicer) or both under
    trio (AsyncSlicer): each gets all its turns, and the ledger never saw both working sets
    resident at once."""
    with trio.fail_after(90):
        async with running_stack() as stack:
            pids = {"ta": stack.sleeper(), "tb": stack.sleeper()}
            run = functools.partial(trainer, stack.socket, ledger_dir=str(stack.ledger.directory))
            got: dict[str, list[Turn]] = {}
            if loop == "asyncio":

                async def both() -> list[list[Turn]]:
                    return list(
                        await asyncio.gather(*(run(n, pid=p, steps=STEPS) for n, p in pids.items()))
                    )

                got = dict(zip(pids, await in_asyncio(both), strict=True))
            else:

                async def one(name: str) -> None:
                    got[name] = await run(name, pid=pids[name], steps=STEPS)

                async with trio.open_nursery() as n:
                    for name in pids:
                        n.start_soon(one, name)
            for name, turns in got.items():
                assert [t.workload for t in turns] == [name] * STEPS
                assert [t.turn for t in turns] == sorted({t.turn for t in turns})
            every = [t.turn for turns in got.values() for t in turns]
            assert len(set(every)) == 2 * STEPS  # one holder per turn number
            st = await stack.status()
            assert holder(st) is None and st["gpus"][0]["queue"] == []  # all released
            assert stack.ledger.processes(0) == []
            assert stack.overlaps() == 0


async def _holding(stack: Stack, name: str) -> tuple[AsyncSlicer, Turn]:
    """A trio client registered as `name` and holding GPU 0."""
    h = await stack.client()
    await h.register(name, pid=stack.sleeper(), park="cooperative")
    return h, await h.acquire(wait=WAIT)


@contextlib.asynccontextmanager
async def held_by_h() -> AsyncIterator[tuple[Stack, AsyncSlicer, Turn, int, OnTrio]]:
    """A running stack whose GPU 0 workload "h" holds (`_holding`), with a sleeper's pid for
    workload "c" and an `OnTrio`; on the way out h's connection is closed and the ledger is
    checked for overlaps."""
    async with running_stack() as stack:
        h, held = await _holding(stack, "h")
        yield stack, h, held, stack.sleeper(), OnTrio()
        await h.aclose()
        assert stack.overlaps() == 0


async def _waiting_in_queue(
    c: AsyncioSlicer, stack: Stack, pid: int, on_trio: OnTrio, wait: float | None = WAIT
) -> asyncio.Task[Turn]:
    """`c` registered as a cooperative workload of `pid`, its ACQUIRE (a task) in GPU 0's
    queue."""
    await c.register(pid=pid, park="cooperative")
    waiting = asyncio.create_task(c.acquire(wait=wait))
    await on_trio(stack.until, queue_is(["c"]))
    return waiting


@pytest.mark.integration
async def test_a_timed_out_acquire_s_late_grant_is_released_and_the_connection_in_step() -> None:
    with trio.fail_after(60):
        async with held_by_h() as (stack, h, held, pid, on_trio):

            async def main() -> tuple[int, Turn]:
                async with await AsyncioSlicer.connect(stack.socket, "c") as c:
                    await c.register(pid=pid, park="cooperative")
                    with pytest.raises(TimeoutError):
                        await c.request(proto.Acquire("c"), timeout=0.2)
                    await on_trio(stack.until, queue_is(["c"]))  # still asked, by nobody
                    grants = (await on_trio(stack.status))["totals"]["grants"]
                    await on_trio(h.release, held)
                    # The late grant is read and given back by the client's own reader.
                    await on_trio(stack.until, released_after(grants + 1))
                    late = held.turn + 1
                    # Its own grant comes next: not busy.
                    async with c.turn(wait=WAIT) as t:
                        st = await on_trio(stack.status)
                        assert holder(st) == {"workload": "c", "turn": t.turn}
                    await c.ping()  # its own reply, not the RELEASE's
                    assert not [m for m in c.events if not isinstance(m, proto.Waiting)]
                    return late, t

            late, t = await in_asyncio(main)
            assert t.workload == "c" and t.turn > late
            assert holder(await stack.status()) is None


@pytest.mark.integration
@pytest.mark.parametrize("loop", ["asyncio", "trio"])
async def test_an_abandoned_acquire_s_late_grant_is_given_back_while_its_client_computes(
    loop: str,
) -> None:
    """h holds GPU 0; c gives up its ACQUIRE (a cancelled task) and goes on computing,
    making no call; x waits behind c. When h releases, slicerd grants c late, and c's
    client, reading in the background, gives that turn back at once: x is granted while c
    still makes no call (before the fix, only c's next call would have)."""
    with trio.fail_after(60):
        async with running_stack() as stack:
            h, held = await _holding(stack, "h")
            x, x_pid = await stack.client(), stack.sleeper()
            await x.register("x", pid=x_pid, park="cooperative")
            pid, ledger = stack.sleeper(), stack.ledger
            x_turns: list[Turn] = []

            async def x_waits() -> None:
                x_turns.append(await x.acquire(wait=WAIT))
                ledger.alloc(x_pid, 0, WORKING_SET, tag="weights", workload="x")
                ledger.free(x_pid)
                await x.release(x_turns[0])

            async def while_c_computes() -> None:  # on trio; c makes no call meanwhile
                async with trio.open_nursery() as n:
                    n.start_soon(x_waits)
                    await stack.until(queue_is(["c", "x"]))
                    await h.release(held)

            if loop == "asyncio":
                on_trio = OnTrio()

                async def main() -> Turn:
                    async with await AsyncioSlicer.connect(stack.socket, "c") as c:
                        waiting = await _waiting_in_queue(c, stack, pid, on_trio, wait=None)
                        waiting.cancel()
                        with pytest.raises(asyncio.CancelledError):
                            await waiting
                        await on_trio(while_c_computes)
                        async with c.turn(wait=WAIT) as t:  # in step, not busy
                            pass
                        return t

                t = await in_asyncio(main)
            else:
                async with await AsyncSlicer.connect(stack.socket, "c") as c:
                    await c.register(pid=pid, park="cooperative")
                    async with trio.open_nursery() as n:
                        scope = trio.CancelScope()

                        async def ask() -> None:
                            with scope:
                                await c.acquire()

                        n.start_soon(ask)
                        await stack.until(queue_is(["c"]))
                        scope.cancel()
                    await while_c_computes()
                    async with c.turn(wait=WAIT) as t:  # in step, not busy
                        pass
            assert [u.workload for u in x_turns] == ["x"]
            assert x_turns[0].turn == held.turn + 2  # c's late grant came between
            assert t.workload == "c" and t.turn > x_turns[0].turn
            assert holder(await stack.status()) is None
            await h.aclose()
            await x.aclose()
            assert stack.overlaps() == 0


@pytest.mark.integration
async def test_cancelled_tasks_abandon_their_acquire_and_release_their_turn() -> None:
    with trio.fail_after(60):
        async with held_by_h() as (stack, h, held, pid, on_trio):

            async def main() -> None:
                async with await AsyncioSlicer.connect(stack.socket, "c") as c:
                    waiting = await _waiting_in_queue(c, stack, pid, on_trio)
                    waiting.cancel()
                    with pytest.raises(asyncio.CancelledError):
                        await waiting
                    grants = (await on_trio(stack.status))["totals"]["grants"]
                    await on_trio(h.release, held)
                    # The abandoned grant, given back with no call of ours.
                    await on_trio(stack.until, released_after(grants + 1))
                    await c.ping()  # its own reply, not the RELEASE's
                    # A task cancelled inside its turn still releases it (shielded).
                    inside = asyncio.Event()

                    async def body() -> None:
                        async with c.turn(wait=WAIT):
                            inside.set()
                            await asyncio.Event().wait()  # until cancelled

                    task = asyncio.create_task(body())
                    await inside.wait()
                    task.cancel()
                    with pytest.raises(asyncio.CancelledError):
                        await task
                    st = await on_trio(stack.status)
                    assert holder(st) is None  # released before the cancellation went on
                    # And an asyncio.timeout around the turn is the loop's TimeoutError.
                    with pytest.raises(TimeoutError):
                        async with asyncio.timeout(0.1), c.turn(wait=WAIT):
                            await asyncio.Event().wait()
                    assert holder(await on_trio(stack.status)) is None

            await in_asyncio(main)


@pytest.mark.integration
async def test_tasks_sharing_one_connection_each_get_their_own_replies() -> None:
    """Several tasks on one connection. While one waits for a turn behind another workload,
    a second task's STATUS and PING queue behind that ACQUIRE (slicerd answers in order)
    and return with their own replies once it is granted, whichever task read them; while
    the turn is held, a third task reads the WAITING line another workload's ACQUIRE sends
    the holder, between the replies of a fourth task's STATUS calls."""
    with trio.fail_after(60):
        async with held_by_h() as (stack, h, held, pid, on_trio):
            h_turns: list[Turn] = []

            async with trio.open_nursery() as n:

                async def h_waits() -> None:
                    async def take() -> None:
                        h_turns.append(await h.acquire(wait=WAIT))

                    n.start_soon(take)

                async def main() -> tuple[Turn, list[Any]]:
                    async with await AsyncioSlicer.connect(stack.socket, "c") as c:
                        await c.register(pid=pid, park="cooperative")
                        granted, go = asyncio.Event(), asyncio.Event()
                        turns: list[Turn] = []

                        async def take_turn() -> None:
                            async with c.turn(wait=WAIT) as t:
                                turns.append(t)
                                granted.set()
                                await go.wait()

                        taker = asyncio.create_task(take_turn())
                        await on_trio(stack.until, queue_is(["c"]))
                        behind = asyncio.gather(c.status(), c.ping())
                        await on_trio(h.release, held)
                        first = await behind  # answered after the grant, each its own
                        assert granted.is_set()
                        hint = asyncio.create_task(c.next_message(timeout=WAIT))
                        await on_trio(h_waits)
                        await on_trio(stack.until, queue_is(["h"]))
                        # the WAITING was sent before the queue showed h: one of these
                        # STATUS calls or `hint` itself reads it
                        for st in await asyncio.gather(c.status(), c.status()):
                            assert holder_is("c")(st) and st["gpus"][0]["queue"] == ["h"]
                        msg = await hint
                        assert isinstance(msg, proto.Waiting) and msg.workload == "c"
                        assert msg.turn == turns[0].turn and msg.waiters == 1
                        go.set()
                        await taker
                        await c.ping()
                        return turns[0], first

                t, (st, pong) = await in_asyncio(main)
            assert t.workload == "c" and pong is None
            assert holder(st) == {"workload": "c", "turn": t.turn} and st["gpus"][0]["queue"] == []
            assert [x.workload for x in h_turns] == ["h"] and h_turns[0].turn > t.turn
            await h.release(h_turns[0])


@pytest.mark.integration
async def test_the_daemon_going_away_is_unreachable() -> None:
    with trio.fail_after(60):
        async with held_by_h() as (stack, _, _, pid, on_trio):

            async def main() -> None:
                async with await AsyncioSlicer.connect(stack.socket, "c") as c:
                    waiting = await _waiting_in_queue(c, stack, pid, on_trio)
                    await on_trio(stack.stop, signal.SIGKILL)
                    with pytest.raises(Unreachable):
                        await waiting
                    with pytest.raises(Unreachable):
                        await c.ping()  # the session stays failed
                with pytest.raises(Unreachable):
                    await AsyncioSlicer.connect(stack.socket, "c", timeout=5)

            await in_asyncio(main)


@pytest.mark.integration
async def test_a_fault_of_the_trainer_s_park_raises_faulted() -> None:
    """A cooperative trainer ends its turn with its working set still on the GPU while
    another workload waits: the park fails, and the release at the end of `turn` raises
    `Faulted` (the FAULT reached this connection, the registrant's, before the reply)."""
    with trio.fail_after(60):
        async with running_stack("--fault-kill-after", "1") as stack:
            pid, on_trio = stack.sleeper(), OnTrio()
            ledger_dir = str(stack.ledger.directory)
            w = await stack.client()
            await w.register("w", pid=stack.sleeper(), park="cooperative")
            w_turns: list[Turn] = []

            async with trio.open_nursery() as n:

                async def w_waits() -> None:
                    async def take() -> None:
                        w_turns.append(await w.acquire(wait=WAIT))

                    n.start_soon(take)
                    await stack.until(queue_is(["w"]))

                async def main() -> proto.Fault:
                    ledger = Ledger(ledger_dir)
                    async with await AsyncioSlicer.connect(stack.socket, "c") as c:
                        await c.register(pid=pid, park="cooperative")
                        with pytest.raises(Faulted) as e:
                            async with c.turn(wait=WAIT):
                                ledger.alloc(pid, 0, WORKING_SET, tag="weights", workload="c")
                                await on_trio(w_waits)
                            # ends the turn without freeing: the park cannot hold
                        return e.value.fault

                fault = await in_asyncio(main)
            assert (fault.workload, fault.reason) == ("c", "still-resident")
            assert [t.workload for t in w_turns] == ["w"]  # after c's process was killed
            await w.release(w_turns[0])
            await w.aclose()
            assert stack.overlaps() == 0


class Boom(Exception):
    pass


@pytest.mark.integration
@pytest.mark.parametrize("ending", ["raise", "cancel"])
async def test_a_turn_whose_daemon_dies_mid_body_keeps_the_body_s_outcome_trio(
    ending: str,
) -> None:
    """slicerd SIGKILLed during the body: the body's exception, or its cancellation, goes
    on; the `Unreachable` the release met does not replace it (before the fix it did, so a
    `move_on_after` around the turn raised instead of moving on)."""
    with trio.fail_after(60):
        async with running_stack() as stack, await stack.client() as s:
            await s.register("w", pid=stack.sleeper(), park="cooperative")
            with trio.CancelScope() as scope, contextlib.ExitStack() as expect:
                if ending == "raise":
                    expect.enter_context(pytest.raises(Boom))
                async with s.turn(wait=WAIT):
                    await stack.stop(signal.SIGKILL)
                    if ending == "raise":
                        raise Boom
                    scope.cancel()
                    await trio.sleep_forever()
            assert scope.cancelled_caught == (ending == "cancel")
            with pytest.raises(Unreachable):
                await s.ping()  # the connection was failed and closed
            assert stack.overlaps() == 0


@pytest.mark.integration
@pytest.mark.parametrize("ending", ["raise", "timeout"])
async def test_a_turn_whose_daemon_dies_mid_body_keeps_the_body_s_outcome_asyncio(
    ending: str,
) -> None:
    """As under trio: the body's exception, or the `asyncio.timeout` around it, goes on."""
    with trio.fail_after(60):
        async with running_stack() as stack:
            pid, on_trio = stack.sleeper(), OnTrio()

            async def main() -> None:
                async with await AsyncioSlicer.connect(stack.socket, "w") as s:
                    await s.register(pid=pid, park="cooperative")
                    with pytest.raises(Boom if ending == "raise" else TimeoutError):
                        async with asyncio.timeout(None) as bound, s.turn(wait=WAIT):
                            await on_trio(stack.stop, signal.SIGKILL)
                            if ending == "raise":
                                raise Boom
                            bound.reschedule(asyncio.get_running_loop().time())
                            await asyncio.Event().wait()
                    with pytest.raises(Unreachable):
                        await s.ping()

            await in_asyncio(main)
            assert stack.overlaps() == 0


@contextlib.contextmanager
def silent_peer(path: str) -> Iterator[None]:
    """A Unix socket at `path` that accepts nothing and reads nothing, as a stopped daemon
    (connects succeed all the same: the backlog)."""
    with socket.socket(socket.AF_UNIX) as srv:
        srv.bind(path)
        srv.listen(1)
        yield


def test_a_negative_timeout_is_a_timeout(tmp_path: Path) -> None:
    """`TimeoutError`, as every other timeout of the asyncio client."""
    path = str(tmp_path / "s.sock")

    async def main() -> None:
        async with await AsyncioSlicer.connect(path, "w") as s:
            with pytest.raises(TimeoutError):
                await s.next_message(timeout=-1)
            with pytest.raises(TimeoutError):
                await s.request(proto.Ping(), timeout=-1)

    with silent_peer(path):
        asyncio.run(main())


def test_aclose_returns_while_the_daemon_reads_nothing(tmp_path: Path) -> None:
    """A stopped daemon reads nothing: `aclose` with bytes still buffered returns at once
    (before the fix it waited for them to be written, forever)."""
    path = str(tmp_path / "s.sock")
    with silent_peer(path):

        async def main() -> None:
            s = await AsyncioSlicer.connect(path, "w")
            # Requests the peer never reads, more than the socket's buffers hold: they
            # stay in the transport's buffer.
            s._writer.write(b"PING\n" * 400_000)
            assert s._writer.transport.get_write_buffer_size() > 0
            async with asyncio.timeout(10):
                await s.aclose()

        asyncio.run(main())
