"""One client connection: peer credentials, reading and framing its lines, its outbox.

A connection's replies and events go into its bounded outbox (a client that stops reading
is dropped, never waited for). Its reader frames lines and hands each request to the
server; requests pipelined behind one that waits are queued on the connection (bounded)
for the server to resume, and a burst yields to the other connections after every line.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
from collections import deque
from collections.abc import Callable

import trio

from gpu_slicer import proto
from gpu_slicer.proto import Err

# The server's logger: slicerd's log lines keep the name they had.
log = logging.getLogger("slicer.server")

OUTBOX = 1024  # lines; a watcher further behind than this is dropped
MAX_BACKLOG = 64  # requests pipelined behind one that waits


def peer_credentials(sock: trio.socket.SocketType) -> tuple[int, int, int]:
    """(pid, uid, gid) of the peer, from SO_PEERCRED."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid


SO_PEERPIDFD = 77  # Linux 6.5+; the socket module of Python 3.11 does not name it


def peer_pidfd(sock: trio.socket.SocketType) -> int | None:
    """A pidfd of the very process that connected (None where the kernel has none): it
    tells whether the pid SO_PEERCRED gave still names that process."""
    try:
        return int(sock.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD))
    except OSError:
        return None


def pidfd_names(fd: int, pid: int) -> bool:
    """Whether pidfd `fd`'s process lives and has pid `pid` here (its fdinfo says -1 once
    it has exited, and a live process's pid is never reused)."""
    try:
        with open(f"/proc/self/fdinfo/{fd}", "rb") as f:
            for line in f:
                if line.startswith(b"Pid:"):
                    return int(line.split()[1]) == pid
    except (OSError, ValueError):
        return False
    return False


class Connection:
    """One client: its stream, outbox, and the request it is waiting on."""

    def __init__(self, cid: int, stream: trio.SocketStream, pid: int, uid: int) -> None:
        self.cid, self.stream, self.pid, self.uid = cid, stream, pid, uid
        self.outbox, self._inbox = trio.open_memory_channel[bytes](OUTBOX)
        self.pending = False
        self.backlog: deque[bytes] = deque()
        self.watching = False
        self.wait_scope: trio.CancelScope | None = None
        self.nursery: trio.Nursery | None = None
        self.dropped = ""
        self.closing = False  # its reader ended: nothing of its pipeline runs any more
        self.queued = 0  # lines in the outbox or being written by the writer
        # The peer's PID namespace (inode), read at accept: every pid it sends is read
        # there (`GpuOps.register`). None: unreadable, taken as slicerd's own.
        self.pidns: int | None = None
        # The peer's start time at accept: `pid=self` names it only while it still lives.
        self.peer_start: int | None = None

    def send(self, data: bytes) -> None:
        """Send one line now if the socket takes it, else queue it for the writer; drop
        the connection when its outbox is full."""
        if self.dropped:
            return
        if self.queued == 0:
            # Nothing is queued, so writing directly keeps the order and saves the trip
            # through the writer task (most replies leave here, within microseconds).
            try:
                sent = os.write(self.stream.socket.fileno(), data)
            except BlockingIOError:
                sent = 0
            except OSError:
                self.drop("peer closed")
                return
            if sent == len(data):
                return
            data = data[sent:]
        try:
            self.outbox.send_nowait(data)
            self.queued += 1
        except trio.WouldBlock:
            self.drop("client stopped reading")
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            pass  # the connection is closing; its handler cleans up

    def drop(self, why: str) -> None:
        """Close the connection from our side."""
        if not self.dropped:
            self.dropped = why
            log.warning("dropping connection %d (pid %d): %s", self.cid, self.pid, why)
        if self.nursery is not None:
            self.nursery.cancel_scope.cancel()

    async def writer(self, write_timeout: float) -> None:
        """Send queued lines, batching whatever is ready; drop on a stuck peer."""
        async with self._inbox:
            async for first in self._inbox:
                batch = [first]
                while True:
                    try:
                        batch.append(self._inbox.receive_nowait())
                    except (trio.WouldBlock, trio.EndOfChannel):
                        break
                with trio.move_on_after(write_timeout) as cs:
                    try:
                        await self.stream.send_all(b"".join(batch))
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        self.drop("peer closed")
                        return
                self.queued -= len(batch)
                if cs.cancelled_caught:
                    self.drop(f"write blocked for {write_timeout}s")
                    return


async def linger(stream: trio.SocketStream) -> None:
    """Half-close `stream` and discard what it still sends, briefly, before it is closed."""
    # Closing with unread input makes the kernel send RST, which can destroy the ERR
    # we just sent: half-close, then discard input briefly (bounded) before closing.
    with trio.move_on_after(1):
        try:
            await stream.send_eof()
            while await stream.receive_some(65536):
                pass
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass


async def reader(conn: Connection, dispatch: Callable[[Connection, bytes], None]) -> bool:
    """Read lines until EOF (False) or a line too long (True: flush the ERR, close),
    handing each request line to `dispatch`."""
    buf = proto.LineBuffer()
    while True:
        try:
            data = await conn.stream.receive_some(65536)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return False
        if not data:
            return False
        try:
            lines = buf.feed(data)
        except proto.LineTooLong as e:
            conn.send(proto.encode(Err.from_error(e)))
            return True
        for i, line in enumerate(lines):
            if conn.watching:
                break  # a WATCH stream takes no more requests
            if conn.pending or conn.backlog:
                # Behind a request that waits: the rest of what arrived is queued at
                # once, in order, so a resume never finds a half-read pipeline.
                rest = lines[i:]
                if len(conn.backlog) + len(rest) > MAX_BACKLOG:
                    conn.drop(f"more than {MAX_BACKLOG} requests pipelined")
                    return False
                conn.backlog.extend(rest)
                break
            dispatch(conn, line)
            if i + 1 < len(lines) and not conn.pending:
                # One connection's burst never holds the loop: every other connection
                # (and the watchdog) gets its turn between two of its answered lines.
                await trio.lowlevel.checkpoint()
