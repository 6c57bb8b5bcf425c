"""The blocking client against a scripted peer: events between replies, FAULT in step."""

from __future__ import annotations

import socket
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpu_slicer import proto
from gpu_slicer.slicer.client import ClientError, Faulted, Slicer, Unreachable


@pytest.fixture
def scripted() -> Iterator[tuple[str, list[bytes]]]:
    """A one-connection Unix server that answers each request line with the next script
    entry; returns its path and the script list to fill."""
    path = str(Path(tempfile.mkdtemp()) / "s.sock")
    script: list[bytes] = []
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    srv.listen(1)

    def serve() -> None:
        conn, _ = srv.accept()
        with conn, conn.makefile("rb") as f:
            for answer in script:
                if not f.readline():
                    return
                conn.sendall(answer)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield path, script
    t.join(5)
    srv.close()


def test_fault_before_a_reply_keeps_the_connection_in_step(
    scripted: tuple[str, list[bytes]],
) -> None:
    path, script = scripted
    script += [
        b"WAITING w turn=1 waiters=1\nFAULT w turn=1 reason=lock-failed -- boom\n"
        b"ERR park-failed -- park of w: lock-failed\n",
        b"OK\n",
    ]
    with Slicer(path, "w", timeout=5) as s:
        with pytest.raises(Faulted) as e:
            s.request(proto.Release("w", 1))
        assert e.value.fault.reason == "lock-failed"
        assert [type(m).__name__ for m in s.events] == ["Waiting", "Fault"]
        s.request(proto.Ping())  # reads its own OK, not the ERR of the RELEASE


def test_err_reply_raises_client_error_with_code(scripted: tuple[str, list[bytes]]) -> None:
    path, script = scripted
    script += [b"ERR not-holder -- this connection does not hold turn 3 of w\n"]
    with Slicer(path, "w", timeout=5) as s, pytest.raises(ClientError) as e:
        s.request(proto.Release("w", 3))
    assert e.value.code == "not-holder" and "turn 3" in e.value.text


def test_unreachable_socket() -> None:
    with pytest.raises(Unreachable):
        Slicer("/nonexistent/slicer.sock")
