"""Regression tests for product bugs the chaos runner found (each names its scenario).

Marked ``xfail(strict=True)`` while the bug is open, so `make test` stays green and the
test turns into a failure (XPASS) the moment the fix lands: then drop the marker.
"""

from __future__ import annotations

import contextlib
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import trio

from stubs.proc import free_port
from tests.chaos.runner import fill_fs
from tests.harness import running_stack

pytestmark = [pytest.mark.integration, pytest.mark.chaos]


@contextlib.contextmanager
def tmpfs(size: str) -> Iterator[Path]:
    """A small tmpfs mounted on a fresh directory (skips the test when mount fails)."""
    mnt = Path(tempfile.mkdtemp(prefix="chaos-tmpfs-"))
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
        capture_output=True,
        check=False,
    )
    if r.returncode != 0:
        mnt.rmdir()
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
        with contextlib.suppress(OSError):
            mnt.rmdir()


def fill(directory: Path) -> Path:
    """Fill the file system of `directory` to the last byte; the filler file."""
    filler = directory / "filler"
    fill_fs(filler)  # unbuffered: no ENOSPC left over for close()
    return filler


# Regression (soak-7, seed 219531151): with the state disk full, Store.expire's transaction
# failed and the ticker retried it forever, so a request past its deadline stayed
# "pending" for long-poll clients.
async def test_a_request_past_its_deadline_fails_even_while_the_state_disk_is_full() -> None:
    with trio.fail_after(60), tmpfs("4m") as state:
        async with running_stack() as stack:
            port = free_port()
            args = ["--sample-deadline", "3"]
            # Its log goes to a file (base/dispatcher.log): a pipe nobody reads blocks it.
            await stack.dispatcher("v", "http://127.0.0.1:9", port, state_dir=state, args=args)
            try:
                async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
                    path = stack.base / "ckpt"  # a checkpoint: a directory with a file
                    path.mkdir()
                    (path / "revision.txt").write_text("r1")
                    r = await http.post("/v1/revisions", json={"revision": "r1", "path": str(path)})
                    assert r.status_code == 201, r.text
                    r = await http.post("/v1/samples", json={"prompt": "x", "max_tokens": 4})
                    assert r.status_code == 202, r.text
                    sid, t0 = r.json()["id"], time.monotonic()
                    fill(state)  # the disk fills (and stays full) after the acknowledgement
                    await trio.sleep(max(0.0, t0 + 3 + 4 - time.monotonic()))  # deadline + 4 s
                    r = await http.get(f"/v1/samples/{sid}", params={"wait": 0})
                    assert r.status_code == 200, r.text
                    body = r.json()
                    # The README: "A request pending longer than --sample-deadline fails
                    # with `deadline exceeded: ...`". It is still "pending" here.
                    assert body["status"] == "failed", body
                    assert body["error"].startswith("deadline exceeded"), body
            except BaseException:
                print("---- dispatcher log (tail) ----")
                print((stack.base / "dispatcher.log").read_text(errors="replace")[-6000:])
                raise
            finally:
                await stack.stop_component("dispatcher")
