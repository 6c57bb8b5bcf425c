"""The blocking trainer client (`slicer.client.Slicer`) and `slicer.offload.cooperative_turn`
against a real slicerd on the fake GPU.

The blocking calls run in worker threads (`trio.to_thread.run_sync`) so that the trio loop,
which drives the harness, keeps going; every acquire carries a `wait=` bound and every test
a `trio.fail_after`, so nothing can hang. Every test closes its clients and asserts that the
fake GPU recorded no overlap.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import subprocess
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest
import trio

from gpu_slicer.slicer.client import ClientError, Slicer, Turn, Unreachable, socket_path
from gpu_slicer.slicer.config import DEFAULT_SOCKET
from tests.harness import GiB, Stack, queue_is, running_stack, workload

pytestmark = pytest.mark.integration

T = TypeVar("T")
WAIT = 20.0  # every ACQUIRE's own bound (seconds)


async def sync(fn: Callable[..., T], *args: Any, **kw: Any) -> T:
    """Run a blocking call in a worker thread (abandoned if the test's deadline passes)."""
    return await trio.to_thread.run_sync(functools.partial(fn, *args, **kw), abandon_on_cancel=True)


def holder_is(name: str | None, gpu: int = 0) -> Callable[[dict[str, Any]], bool]:
    def pred(st: dict[str, Any]) -> bool:
        h = st["gpus"][gpu].get("holder")
        got = h.get("workload") if isinstance(h, dict) else h
        return bool(got == name)

    return pred


@contextlib.contextmanager
def clients(*made: Slicer) -> Iterator[None]:
    """Close every client on the way out."""
    try:
        yield
    finally:
        for c in made:
            c.close()


async def trainer(stack: Stack, name: str, **register: Any) -> Slicer:
    """A connected, registered blocking client (park=cooperative, its own sleeper pid)."""
    s = await sync(Slicer, stack.socket, name, 10.0)
    try:
        await sync(s.register, pid=register.pop("pid", None) or stack.sleeper(), park="cooperative")
    except BaseException:
        s.close()
        raise
    return s


class Boom(Exception):
    """Raised inside a turn."""


async def test_exception_inside_a_turn_releases_it_and_the_waiter_gets_the_turn() -> None:
    with trio.fail_after(60):
        async with running_stack() as stack:
            a = await trainer(stack, "a")
            b = await trainer(stack, "b")
            with clients(a, b):
                holding, go = threading.Event(), threading.Event()
                got: dict[str, Any] = {}

                def a_turn() -> None:
                    with a.turn(wait=WAIT) as t:
                        got["a"] = t
                        holding.set()
                        if not go.wait(WAIT):
                            raise AssertionError("never told to go on")
                        raise Boom(t.turn)

                async def run_a() -> None:
                    with pytest.raises(Boom):
                        await sync(a_turn)

                async def run_b() -> None:
                    got["b"] = await sync(b.acquire, wait=WAIT)

                async with trio.open_nursery() as n:
                    n.start_soon(run_a)
                    assert await sync(holding.wait, WAIT)
                    await stack.until(holder_is("a"))
                    n.start_soon(run_b)
                    await stack.until(queue_is(["b"]))  # b waits behind a's turn
                    go.set()  # a raises inside its turn
                ta, tb = got["a"], got["b"]
                assert isinstance(tb, Turn) and tb.workload == "b" and tb.turn > ta.turn
                st = await stack.until(holder_is("b"))
                assert workload(st, "a")["state"] == "parked"  # type: ignore[index]
                await sync(b.release, tb)
                # a's connection is still in step: it takes its next turn normally
                t2 = await sync(lambda: _one_turn(a))
                assert t2.turn > tb.turn and t2.workload == "a"
            assert stack.overlaps() == 0


def _one_turn(s: Slicer) -> Turn:
    with s.turn(wait=WAIT) as t:
        return t


async def test_daemon_restart_between_turns_trainer_reconnects_and_takes_turns() -> None:
    with trio.fail_after(90):
        async with running_stack() as stack:
            pid = stack.sleeper()
            s = await trainer(stack, "trainer", pid=pid)
            with clients(s):
                first = await sync(_one_turn, s)
                await stack.stop(signal.SIGKILL)
                await stack.start()
                # the old connection died with the daemon: the next turn says so, at once
                with pytest.raises(Unreachable):
                    await sync(_one_turn, s)
            s2 = await trainer(stack, "trainer", pid=pid)  # reconnect and re-register
            other = await trainer(stack, "other")
            with clients(s2, other):
                st = await stack.status()
                w = workload(st, "trainer")
                assert w is not None and w["registrant"] is not None
                turns = []
                for c in (s2, other, s2):
                    turns.append(await sync(_one_turn, c))
                assert [t.workload for t in turns] == ["trainer", "other", "trainer"]
                assert turns[0].turn < turns[1].turn < turns[2].turn
                assert turns[0].turn > 0 and first.workload == "trainer"
            assert stack.overlaps() == 0


async def test_env_defaults_socket_and_workload(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLICER_SOCKET", raising=False)
    monkeypatch.delenv("SLICER_WORKLOAD", raising=False)
    assert socket_path() == DEFAULT_SOCKET
    with trio.fail_after(40):
        async with running_stack() as stack:
            monkeypatch.setenv("SLICER_SOCKET", stack.socket)
            monkeypatch.setenv("SLICER_WORKLOAD", "envw")
            assert socket_path() == stack.socket
            assert socket_path("/elsewhere.sock") == "/elsewhere.sock"  # explicit wins
            s = await sync(Slicer.from_env)
            explicit = await sync(Slicer, stack.socket, "named")
            with clients(s, explicit):
                assert s.path == stack.socket and s.workload == "envw"
                assert explicit.workload == "named"
                reg = await sync(s.register, pid=stack.sleeper(), park="cooperative")
                assert reg["workload"] == "envw"
                t = await sync(_one_turn, s)
                assert t.workload == "envw" and t.turn > 0
                st = await stack.status()
                assert workload(st, "envw") is not None
            monkeypatch.delenv("SLICER_WORKLOAD")
            nameless = await sync(Slicer.from_env)
            with clients(nameless):
                assert nameless.workload is None
                with pytest.raises(ClientError) as e:
                    await sync(nameless.acquire, wait=1.0)
                assert e.value.code == "bad-request" and "SLICER_WORKLOAD" in e.value.text
            assert stack.overlaps() == 0


def test_slicer_imports_without_torch() -> None:
    code = (
        "import sys\n"
        "sys.modules['torch'] = None  # any `import torch` now raises ImportError\n"
        "import gpu_slicer.slicer, gpu_slicer.slicer.client, gpu_slicer.slicer.offload\n"
        "o = gpu_slicer.slicer.offload.Offloader(object())\n"
        "assert not o.offloaded\n"
        "print('ok')\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


# ---- cooperative_turn ------------------------------------------------------------------

MODEL_BYTES = 48 * GiB  # two of these cannot share the 80 GiB fake GPU


def _torch() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a torch wheel without numpy warns at import
        return pytest.importorskip("torch", reason="torch is not installed")


async def test_cooperative_turn_offloads_before_release_exceptions_included() -> None:
    torch = _torch()
    from gpu_slicer.slicer.offload import Offloader, cooperative_turn

    class Mirrored(Offloader):
        """An Offloader whose model also stands for 48 GiB on the fake GPU: the ledger
        holds it exactly while the model is on the "device"."""

        def __init__(self, model: Any, opt: Any, stack: Stack, pid: int) -> None:
            super().__init__(model, opt)
            self.stack, self.pid = stack, pid
            stack.ledger.alloc(pid, 0, MODEL_BYTES, tag="model", workload="a")

        def offload(self) -> Any:
            was = self.offloaded
            moved = super().offload()
            if not was:
                self.stack.ledger.free(self.pid, tag="model")
            return moved

        def restore(self, device: Any = None) -> Any:
            if self.offloaded:
                self.stack.ledger.alloc(self.pid, 0, MODEL_BYTES, tag="model", workload="a")
            return super().restore(device)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
    opt = torch.optim.Adam(model.parameters())

    def train_step() -> None:
        opt.zero_grad()
        model(torch.randn(16, 8)).square().mean().backward()
        opt.step()

    def b_turn(b: Slicer, pid: int) -> Turn:
        with b.turn(wait=WAIT, park="now") as t:
            stack.ledger.alloc(pid, 0, MODEL_BYTES, tag="model", workload="b")
            stack.ledger.free(pid, tag="model")
            return t

    with trio.fail_after(60):
        async with running_stack(gpus=1) as stack:
            pa, pb = stack.sleeper(), stack.sleeper()
            off = Mirrored(model, opt, stack, pa)  # resident before it registers
            a = await trainer(stack, "a", pid=pa)
            b = await trainer(stack, "b", pid=pb)
            with clients(a, b):

                def a_turn(fail: bool, expect: dict[str, Any] | None = None) -> Turn:
                    with cooperative_turn(a, off, "cpu") as t:
                        assert not off.offloaded
                        for k, v in (expect or {}).items():  # restored bit-exactly
                            got = model.state_dict()[k]
                            assert got.dtype == v.dtype and torch.equal(got, v), k
                        train_step()
                        if fail:
                            raise Boom(t.turn)
                        return t

                t1 = await sync(a_turn, False)
                assert not t1.restored and off.offloaded  # offloaded at the end of the turn
                st = await stack.status()
                assert workload(st, "a")["state"] == "parked"  # type: ignore[index]
                await sync(b_turn, b, pb)  # b's 48 GiB fit only because a's are gone
                with pytest.raises(Boom):
                    await sync(a_turn, True)
                assert off.offloaded  # offloaded on the way out of the failed turn, too
                assert off.last is not None and off.last.direction == "offload"
                assert stack.ledger.processes(0) == []
                st = await stack.until(holder_is(None))
                assert workload(st, "a")["state"] == "parked"  # type: ignore[index]
                await sync(b_turn, b, pb)  # the turn was released: b gets the GPU
                snap = {k: v.clone() for k, v in model.state_dict().items()}
                t3 = await sync(a_turn, False, snap)
                assert t3.restored and t3.turn > t1.turn
            assert stack.overlaps() == 0
