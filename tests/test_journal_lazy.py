"""The journal off the hot path: what changes nothing durable writes nothing, a cooperative
handoff writes one document after its grant left, and a daemon killed right after a grant
recovers correctly from what was on disk at that instant (`slicer.journal`'s argument).

In-process (`tests/inproc.py`), on virtual time; the journal is a real file in tmp_path.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from gpu_slicer.slicer.effects import Effect, Grant
from gpu_slicer.slicer.journal import Journal
from tests.inproc import GiB, Stack, inproc_server

BOUND = 60  # virtual seconds


class Disk:
    """Spies on one server's journal: every document written to disk, and what was on
    disk each time a grant left."""

    def __init__(self, s: Stack, monkeypatch: pytest.MonkeyPatch) -> None:
        self.written: list[dict[str, Any]] = []
        self.at_grant: list[bytes] = []
        journal = s.server.journal
        replace, perform = journal._replace, s.server._perform

        def spy_replace(data: bytes) -> None:
            replace(data)
            self.written.append(json.loads(data))

        def spy_perform(e: Effect) -> None:
            if isinstance(e, Grant):
                self.at_grant.append(journal.path.read_bytes())
            perform(e)

        monkeypatch.setattr(journal, "_replace", spy_replace)
        monkeypatch.setattr(s.server, "_perform", spy_perform)


def states(doc: dict[str, Any]) -> dict[str, str]:
    return {w["name"]: w["state"] for w in doc["workloads"]}


async def test_turns_that_change_nothing_durable_write_no_journal(
    tmp_path: Path, autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    with trio.fail_after(BOUND):
        async with inproc_server(tmp_path) as s:
            s.host.spawn(101)
            s.gpu.load(101, 10 * GiB)
            reg, c = await s.client(), await s.client()
            assert (await reg.ask("REGISTER a pid=101 park=cooperative")).endswith("state=idle")
            await trio.testing.wait_all_tasks_blocked()
            disk = Disk(s, monkeypatch)
            for turn in range(1, 6):  # re-ACQUIRE of an idle workload: it stays resident
                assert (await c.ask("ACQUIRE a")).startswith(f"OK turn={turn} ")
                assert await c.ask(f"RELEASE a turn={turn}") == "OK parked=0 park_ms=0"
            await trio.testing.wait_all_tasks_blocked()
            assert disk.written == []
            assert len(disk.at_grant) == 5


async def test_a_cooperative_handoff_writes_one_document_after_its_grant(
    tmp_path: Path, autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    with trio.fail_after(BOUND):
        async with inproc_server(tmp_path) as s:
            s.host.spawn(101)
            s.host.spawn(102)
            reg_a, reg_b = await s.client(), await s.client()
            await reg_a.ask("REGISTER a pid=101 park=cooperative")
            await reg_b.ask("REGISTER b pid=102 park=cooperative")
            d1, d2 = await s.client(), await s.client()
            assert (await d1.ask("ACQUIRE a")).startswith("OK turn=1 ")
            await d2.send("ACQUIRE b")
            assert await d1.line() == "WAITING a turn=1 waiters=1"
            await trio.testing.wait_all_tasks_blocked()
            disk = Disk(s, monkeypatch)
            await d1.send("RELEASE a turn=1")
            assert (await d2.line()).startswith("OK turn=2 ")
            assert await d1.line() == "OK parked=1 park_ms=0"
            await trio.testing.wait_all_tasks_blocked()
            # Before: one inline write for "parking" and one for "parked", both before the
            # grant. Now one document, written after the grant left (b is active in it).
            assert [states(doc) for doc in disk.written] == [{"a": "parked", "b": "active"}]
            assert states(json.loads(disk.at_grant[0])) == {"a": "registered", "b": "registered"}


async def test_a_crash_right_after_a_grant_recovers_from_what_was_on_disk(
    tmp_path: Path, autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """a (cuda-checkpoint, 30 GiB) is restored and granted; the record of the finished
    restore is written behind the grant. A daemon SIGKILLed at the grant leaves a's
    restore intent on disk: the restarted one asks the driver, finds a running (restored)
    and parks it before anything else is granted."""
    (tmp_path / "1").mkdir()
    with trio.fail_after(BOUND):
        async with inproc_server(tmp_path / "1") as s:
            s.host.spawn(101)
            s.host.spawn(111, ppid=101)
            s.host.spawn(102)
            s.gpu.load(111, 30 * GiB)
            reg_a, reg_b = await s.client(), await s.client()
            await reg_a.ask("REGISTER a pid=101")
            await reg_b.ask("REGISTER b pid=102 park=cooperative")
            d1, d2 = await s.client(), await s.client()
            await d1.ask("ACQUIRE a")
            await d1.ask("RELEASE a turn=1 park=now")  # a is checkpointed
            assert s.parker.parks == [[111]]
            assert (await d2.ask("ACQUIRE b")).startswith("OK turn=2 ")
            await d1.send("ACQUIRE a")
            assert await d2.line() == "WAITING b turn=2 waiters=1"
            await trio.testing.wait_all_tasks_blocked()
            disk = Disk(s, monkeypatch)
            await d2.send("RELEASE b turn=2")
            assert (await d1.line()).startswith("OK turn=3 restored=1 ")
            assert s.gpu.resident() == {111}
            await trio.testing.wait_all_tasks_blocked()
            (on_disk,) = disk.at_grant
            # Written behind the grant: a's finished restore.
            assert states(disk.written[-1]) == {"a": "active", "b": "parked"}
        doc = json.loads(on_disk)
        (a,) = [w for w in doc["workloads"] if w["name"] == "a"]
        assert a["state"] == "restoring" and a["parked_procs"] == [[111, 1000]]

        # The restart: the same processes, a's memory back on the device (restored).
        def prepare(s2: Stack) -> None:
            s2.host.spawn(101)
            s2.host.spawn(111, ppid=101)
            s2.host.spawn(102)
            s2.gpu.load(111, 30 * GiB)

        state = tmp_path / "2"
        state.mkdir()
        (state / "journal.json").write_bytes(on_disk)
        entries = Journal(state).load()
        async with inproc_server(state, entries=entries, prepare=prepare) as s2:
            st = await s2.until(
                lambda st: {w["name"]: w["state"] for w in st["workloads"]}.get("a") == "parked"
            )
            assert s2.parker.parks == [[111]]  # it was running: parked by this daemon
            assert s2.parker.restores == []  # never restored again
            assert s2.gpu.resident() == set()
            assert st["gpus"][0]["holder"] is None
