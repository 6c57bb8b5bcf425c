"""The journal never lies: atomic saves, a full disk that costs no turn, an unreadable
journal that gives one clear line (and a documented way to start anyway), one daemon per
state dir. Against the real daemon, its state dir on a tmpfs of its own."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from gpu_slicer.slicer.journal import Journal, JournalError
from tests.harness import GiB, Stack, running_stack, workload

pytestmark = pytest.mark.integration

POLL = 0.05  # the journal's retry has no event of its own: poll STATUS, bounded


@contextlib.contextmanager
def tmpfs(path: Path, size: str) -> Iterator[bool]:
    """Mount a tmpfs of `size` on `path` (False when this machine cannot)."""
    path.mkdir(parents=True, exist_ok=True)
    ok = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True,
        check=False,
    )
    try:
        yield ok.returncode == 0
    finally:
        if ok.returncode == 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


def fill(path: Path) -> Path:
    """Fill the file system of `path` until ENOSPC; the filler file."""
    filler = path / "filler"
    with open(filler, "wb") as f:
        chunk = b"\0" * (64 << 10)
        with contextlib.suppress(OSError):
            while True:
                f.write(chunk)
                f.flush()
    return filler


def journal_doc(stack: Stack) -> dict[str, object]:
    raw = (stack.base / "state" / "journal.json").read_bytes()
    assert b"\0" not in raw
    doc = json.loads(raw)
    assert isinstance(doc, dict)
    return doc


async def journal_ok(stack: Stack, ok: bool) -> dict[str, object]:
    while (st := await stack.status())["journal"]["ok"] is not ok:
        await trio.sleep(POLL)
    return st


def names(doc: dict[str, object]) -> set[str]:
    workloads = doc["workloads"]
    assert isinstance(workloads, list)
    return {w["name"] for w in workloads}


async def test_a_full_disk_costs_no_turn_and_the_journal_catches_up() -> None:
    with trio.fail_after(60):
        async with running_stack(gpus=1) as stack:
            state = stack.base / "state"
            await stack.stop()
            with tmpfs(state, "1m") as mounted:
                if not mounted:
                    pytest.skip("cannot mount a tmpfs here")
                await stack.start()
                pa, pb = stack.sleeper(4 * GiB, label="a"), stack.sleeper()
                async with (
                    await stack.client() as ra,
                    await stack.client() as rb,
                    await stack.client() as c,
                ):
                    await ra.register("a", pid=pa)
                    while names(journal_doc(stack)) != {"a"}:  # saved just after the reply
                        await trio.sleep(POLL)
                    filler = fill(state)
                    # Every change now fails to journal: the daemon keeps serving from
                    # memory, says so in STATUS and its log, and the old journal stays whole.
                    await rb.register("b", pid=pb)
                    t = await c.acquire("a")
                    st = await journal_ok(stack, False)
                    assert "No space left on device" in st["journal"]["error"]
                    assert names(journal_doc(stack)) == {"a"}
                    assert not (state / "journal.json.tmp").exists()
                    assert stack.log is not None and "cannot write journal" in stack.log.read_text()
                    released = trio.Event()

                    async def release() -> None:
                        await c.release(t, park="now")
                        released.set()

                    async with trio.open_nursery() as n:
                        n.start_soon(release)
                        # A checkpoint park waits for the journal: a crash must never leave
                        # checkpointed processes that no journal names.
                        await stack.until(
                            lambda st: workload(st, "a")["state"] == "idle"  # type: ignore[index]
                        )  # it was active: back to idle means the park was deferred
                        assert stack.ledger.state(pa) == "running" and not released.is_set()
                        assert stack.ledger.overlaps() == 0
                        # Room again: the retry writes the journal, the park goes on.
                        filler.unlink()
                        await released.wait()
                    assert stack.ledger.state(pa) == "checkpointed"
                    await journal_ok(stack, True)
                    doc = journal_doc(stack)
                    assert names(doc) == {"a", "b"}
                    # ...which a daemon killed now recovers from.
                    await stack.stop(signal.SIGKILL)
                    await stack.start()
                    st = await stack.status()
                    assert {w["name"] for w in st["workloads"]} == {"a"}  # b held nothing
                    await ra.aclose()
                    async with await stack.client() as ra2, await stack.client() as c2:
                        assert (await ra2.register("a", pid=pa))["state"] == "parked"
                        t = await c2.acquire("a")
                        assert t.restored and stack.ledger.state(pa) == "running"
                        await c2.release(t)
                await stack.stop()
            assert stack.overlaps() == 0


async def test_an_unreadable_journal_gives_one_line_and_discard_starts_anyway() -> None:
    with trio.fail_after(60):
        async with running_stack(gpus=1) as stack:
            await stack.stop()
            path = stack.base / "state" / "journal.json"
            path.write_bytes(b'{"version": 1, "workloads": [{"name": "a", "g' + b"\0" * 300)
            cmd = [sys.executable, "-m", "gpu_slicer.slicer.daemon", *stack.args]
            res = await trio.run_process(cmd, env=stack.env, check=False, capture_stderr=True)
            err = res.stderr.decode()
            assert res.returncode == 78, err  # slicer.service: RestartPreventExitStatus=78
            assert "Traceback" not in err
            (line,) = [s for s in err.splitlines() if s.startswith("slicerd: error: ")]
            assert str(path) in line and "--discard-journal" in line
            assert not os.path.exists(stack.socket)
            stack.args.append("--discard-journal")
            await stack.start()
            assert (await stack.status())["workloads"] == []
            (aside,) = path.parent.glob("journal.json.bad-*")
            assert aside.read_bytes().startswith(b'{"version": 1')  # kept for the operator
            assert stack.log is not None and "--discard-journal: moved" in stack.log.read_text()
            async with await stack.client() as r:
                await r.register("a", pid=stack.sleeper())
                # The REGISTER reply may leave just before the save of the same batch.
                while names(journal_doc(stack)) != {"a"}:
                    await trio.sleep(POLL)


def test_a_save_is_whole_or_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    j = Journal(tmp_path)
    j.save([{**GOOD, "name": "a"}])
    real_write = os.write
    writes: list[int] = []

    def short_then_full(fd: int, data: bytes) -> int:
        writes.append(len(data))
        if len(writes) == 1:
            return real_write(fd, bytes(data[:5]))  # a short write, then the disk is full
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("gpu_slicer.slicer.journal.os.write", short_then_full)
    with pytest.raises(JournalError, match="No space left on device"):
        j.save([{**GOOD, "name": "b"}])
    monkeypatch.undo()
    assert len(writes) == 2  # the short write was noticed and continued, not trusted
    assert not (tmp_path / "journal.json.tmp").exists()
    assert [w["name"] for w in Journal(tmp_path).load()] == ["a"]
    j.save([{**GOOD, "name": "b"}])  # nothing was recorded as written: it is saved now
    assert [w["name"] for w in Journal(tmp_path).load()] == ["b"]


@pytest.mark.parametrize(
    "raw", [b"", b"\0\0\0", b"[]", b'{"version": 9}', b'{"version": 1, "workloads": 3}']
)
def test_every_unreadable_journal_names_its_file_and_the_way_out(
    tmp_path: Path, raw: bytes
) -> None:
    (tmp_path / "journal.json").write_bytes(raw)
    with pytest.raises(JournalError) as e:
        Journal(tmp_path).load()
    assert str(tmp_path / "journal.json") in str(e.value)
    assert "--discard-journal" in str(e.value)


GOOD = {
    "name": "a",
    "gpu": 0,
    "pid": 1,
    "start_time": 1.0,
    "tree": True,
    "park": "checkpoint",
    "parked_max": 0,
    "owner_uid": 0,
    "state": "parked",
}


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        ({"parked_procs": [["7", None]]}, "parked_procs"),
        ({"op_procs": [[1, 2, 3]]}, "op_procs"),
        ({"gpu": "0"}, "gpu"),
        ({"tree": 1}, "tree"),
        ({"pid": None}, "pid"),
        ({"parks": "3"}, "parks"),
    ],
)
def test_a_journal_entry_of_the_wrong_shape_is_one_clear_error(
    tmp_path: Path, bad: dict[str, object], why: str
) -> None:
    doc = {"version": 1, "workloads": [GOOD, {**GOOD, **bad}]}
    (tmp_path / "journal.json").write_text(json.dumps(doc))
    with pytest.raises(JournalError, match=f"workload entry 1: {why}"):
        Journal(tmp_path).load()
    (tmp_path / "journal.json").write_text(json.dumps({"version": 1, "workloads": [GOOD]}))
    assert Journal(tmp_path).load() == [GOOD]


@pytest.mark.parametrize("state_dir", ["/proc/self/nope", "/sys/kernel/slicer"])
async def test_an_unusable_state_dir_is_one_line_and_no_restart(state_dir: str) -> None:
    with trio.fail_after(60):
        async with running_stack(gpus=1) as stack:
            await stack.stop()
            args = list(stack.args)
            args[args.index("--state-dir") + 1] = state_dir
            cmd = [sys.executable, "-m", "gpu_slicer.slicer.daemon", *args]
            res = await trio.run_process(cmd, env=stack.env, check=False, capture_stderr=True)
            err = res.stderr.decode()
            assert res.returncode == 78, err
            assert "Traceback" not in err and state_dir.split("/")[1] in err
