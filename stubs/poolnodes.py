"""N simulated nodes sharing one real Redis: a sampling pool, for the tests, the demo and
the bench.

    with RedisServer(tmp / "redis") as redis:
        async with running_pool(3, redis, trainer_work=(0.05, 0.15, 0.4)) as pool:
            await publish(pool.nodes[0].front, "r1", pool.base)
            sent = await submit_many(pool.fronts, 300)
            got = await results(pool.nodes[1].front, [s.id for s in sent])

A node (`Node`) is what one machine of a pool runs, each process its own:

- a `stubs.stack.Stack` in a directory of its own (``pool.base/NAME``): its own fake GPU
  ledger (one GPU) and its own slicerd;
- the vLLM stub under the real launcher (``slicer-launch vllm --workload v``, park mode
  `replica_park`, `launcher_args`), booted, slept and released before anything else;
- a pool-mode dispatcher (``slicer-dispatch --workload v --queue REDIS --pool P
  --consumer NAME DISPATCH_ARGS``) in front of it; `Node.front` is its base URL;
- the trainer stub (workload ``trainer``, checkpoint-parked, `trainer_bytes` of working
  set, ``--work`` its own step length from `trainer_work`, `trainer_steps` steps), started
  last, so that every replica and the trainer compete for the node's GPU.

The nodes are named ``node0`` .. ``node{N-1}``; that is also each dispatcher's consumer
name in the pool. Nodes start concurrently (each bounded by its components' readiness:
the launcher's READY=1, the dispatcher's port).

`running_pool` stops everything on the way out (each node's components, last started
first, then its slicerd) and, on a clean exit, asserts that every node's ledger counted
no overlap (the message names the node and shows its overlap log). `Node.kill_dispatcher`
(SIGKILL, mid-turn or not) and `Node.restart_dispatcher` stand in for a dispatcher that
dies and one that comes back.

Helpers, each taking a front's base URL: `publish` (a checkpoint dir with
``revision.txt``, which the vLLM stub reports as its weight version, then ``POST
/v1/revisions``), `submit_many` (``POST /v1/samples/batch``, round robin over fronts),
`results` (``POST /v1/samples/results`` long-polls until every id is finished),
`dispatcher_status` (``GET /status``) and `versions` (the weight versions a result names).
`Pool.stats` and `Pool.served` read the pool's counters straight from Redis, `Pool.claimed`
which sample ids a consumer holds claimed.

No pytest here: the demo and the bench use it too.
"""

from __future__ import annotations

import shutil
import signal
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import trio

from gpu_slicer.dispatcher.poolscripts import GROUP, prefix
from stubs.proc import StackError, free_port, log_tail, tempdir
from stubs.proc import stop as stop_process
from stubs.redisserver import RedisServer
from stubs.stack import Stack, vllm_stub_argv

__all__ = [
    "Node",
    "Pool",
    "Sample",
    "dispatcher_status",
    "publish",
    "results",
    "running_pool",
    "submit_many",
    "versions",
]

REPLICA = "v"  # the replica's workload name on every node (each node has its own slicerd)
TRAINER = "trainer"
DISPATCHER = "dispatcher"
LAUNCHER = "launcher"
HTTP_TIMEOUT_S = 60.0
SUBMIT_CHUNK = 500  # requests per POST /v1/samples/batch
RESULTS_CHUNK = 500  # ids per POST /v1/samples/results
RESULTS_WAIT_S = 10.0


@dataclass
class Node:
    """One simulated node of a pool (module docstring)."""

    name: str
    stack: Stack
    port: int  # its dispatcher's
    replica: str  # the vLLM stub's base URL
    dispatch_args: list[str]  # everything after --workload/--replica/--listen/--socket
    trainer_args: list[str]

    @property
    def front(self) -> str:
        """Its dispatcher's base URL."""
        return f"http://127.0.0.1:{self.port}"

    def overlaps(self) -> int:
        """Its fake GPU's overlap count (must stay 0)."""
        return self.stack.overlaps()

    async def start_dispatcher(self) -> None:
        """Start its dispatcher (component ``dispatcher``); returns once its port accepts."""
        await self.stack.dispatcher(REPLICA, self.replica, self.port, args=self.dispatch_args)

    async def kill_dispatcher(self) -> int:
        """SIGKILL its dispatcher (no turn end, no give-back: it just dies) and reap it;
        its exit status (``-SIGKILL``)."""
        rc = await stop_process(self.stack.procs[DISPATCHER], 0, sig=signal.SIGKILL)
        self.stack.rcs[DISPATCHER] = rc
        return rc

    async def restart_dispatcher(self) -> None:
        """Start its dispatcher again (same port, same consumer name), after
        `kill_dispatcher` or a stop; returns once its port accepts."""
        p = self.stack.procs.get(DISPATCHER)
        if p is not None and p.poll() is None:
            raise StackError(f"{self.name}: its dispatcher still runs (pid {p.pid})")
        self.stack.rcs.pop(DISPATCHER, None)
        await self.start_dispatcher()

    async def status(self) -> dict[str, Any]:
        """Its dispatcher's ``GET /status``."""
        return await dispatcher_status(self.front)


@dataclass
class Pool:
    """The nodes of `running_pool`, their Redis and their shared directory ``base``
    (checkpoints go to ``base/ckpt``: every node's files are this machine's)."""

    name: str
    redis: RedisServer
    base: Path
    nodes: list[Node] = field(default_factory=list)

    @property
    def fronts(self) -> list[str]:
        """Every node's front (dispatcher base URL), in node order."""
        return [n.front for n in self.nodes]

    def overlaps(self) -> dict[str, int]:
        """Each node's fake GPU overlap count, by node name (each must stay 0)."""
        return {n.name: n.overlaps() for n in self.nodes}

    def _hash(self, key: str) -> dict[str, int]:
        raw = self.redis.command("HGETALL", prefix(self.name) + key)
        assert isinstance(raw, list)
        return {k.decode(): int(v) for k, v in zip(raw[::2], raw[1::2], strict=True)}

    def stats(self) -> dict[str, int]:
        """The pool's counters as Redis has them now (``committed``, ``failed``,
        ``duplicates``, ``reclaimed``, ``returned``; 0 when never counted), read straight
        from the ``stats`` hash: exact at once, where ``GET /status`` shows a figure up to
        a tick old."""
        names = ("committed", "failed", "duplicates", "reclaimed", "returned")
        return {k: 0 for k in names} | self._hash("stats")

    def served(self) -> dict[str, int]:
        """Results committed per replica (node name), from Redis' ``served`` hash."""
        return self._hash("served")

    def claimed(self, consumer: str) -> set[str]:
        """The sample ids whose stream entries consumer `consumer` (a dispatcher's
        ``pool_mode.consumer``) holds claimed now, from the consumer group's pending lists
        of every active revision (a dead dispatcher's stay there until reclaimed)."""
        pre = prefix(self.name)
        revs = self.redis.command("SMEMBERS", pre + "active")
        assert isinstance(revs, list)
        out: set[str] = set()
        for rev in revs:
            q = pre + "q:" + rev.decode()
            pel = self.redis.command("XPENDING", q, GROUP, "-", "+", "100000", consumer)
            assert isinstance(pel, list)
            for entry_id, *_ in pel:
                got = self.redis.command("XRANGE", q, entry_id, entry_id)
                assert isinstance(got, list)
                for _, fields in got:
                    out.add(dict(zip(fields[::2], fields[1::2], strict=True))[b"i"].decode())
        return out

    def check_alive(self) -> None:
        """`StackError` naming the node when any node's slicerd or component exited."""
        for n in self.nodes:
            try:
                n.stack.check_alive()
            except StackError as e:
                raise StackError(f"{n.name}: {e}") from None


async def _start_node(node: Node, launcher_argv: list[str], launcher_args: list[str],
                      park: str, timeout: float, trainer: bool = True) -> None:  # fmt: skip
    await node.stack.start()
    await node.stack.launcher(REPLICA, launcher_argv, park=park, args=launcher_args,
                              timeout=timeout, component=LAUNCHER)  # fmt: skip
    await node.start_dispatcher()
    if trainer:
        node.stack.trainer(TRAINER, node.trainer_args)


@asynccontextmanager
async def running_pool(
    n: int,
    redis: RedisServer,
    *,
    pool: str = "pa",
    trainer_work: Sequence[float] = (0.05,),
    trainer_steps: int = 1_000_000,
    trainer_bytes: str = "30GiB",
    dispatch_args: Sequence[str] = (),
    stub_args: Sequence[str] = ("--tokens-per-s", "20000"),
    replica_park: str = "cooperative",
    launcher_args: Sequence[str] = (),
    slicerd_args: Sequence[str] = (),
    capacity: str = "80GiB",
    boot_timeout: float = 60.0,
    trainers: bool = True,
) -> AsyncIterator[Pool]:
    """`n` nodes of pool `pool` on `redis`, started (module docstring). Node i's trainer
    works ``trainer_work[i % len(trainer_work)]`` s a step. `dispatch_args` go to every
    dispatcher after ``--queue/--pool/--consumer`` (e.g. ``--turn-seconds``,
    ``--reclaim-idle``), `stub_args` to every vLLM stub, `launcher_args` to every
    launcher, `slicerd_args` to every slicerd; ``trainers=False`` starts no trainer (a
    node of replica and dispatcher only: the bench). On a clean exit asserts each node's
    overlap count is 0; on any exit stops every process and removes the directories
    (printing the failing node's logs' tails on an error)."""
    if n < 1 or not trainer_work:
        raise ValueError("a pool needs at least one node and one trainer step length")
    base = tempdir("slicer-pool-")
    p = Pool(name=pool, redis=redis, base=base)
    for i in range(n):
        name = f"node{i}"
        # pdeathsig: a killed demo or test leaves no node's processes behind.
        stack = Stack.create(base / name, *slicerd_args, gpus=1, capacity=capacity,
                             pdeathsig=True)  # fmt: skip
        dargs = ["--queue", redis.url, "--pool", pool, "--consumer", name, *dispatch_args]
        targs = ["--bytes", trainer_bytes, "--work", str(trainer_work[i % len(trainer_work)])]
        targs += ["--steps", str(trainer_steps), "--park", "checkpoint"]
        node = Node(name, stack, free_port(), "", dargs, targs)
        p.nodes.append(node)
    try:
        async with trio.open_nursery() as nursery:
            for node in p.nodes:
                rport = free_port()
                node.replica = f"http://127.0.0.1:{rport}"
                argv = vllm_stub_argv(REPLICA, rport, *stub_args)
                nursery.start_soon(_start_node, node, argv, list(launcher_args),
                                   replica_park, boot_timeout, trainers)  # fmt: skip
        yield p
        bad = {k: v for k, v in p.overlaps().items() if v}
        assert not bad, f"GPU overlaps {bad}: " + "; ".join(
            f"{k}: {p.nodes[int(k[4:])].stack.ledger.overlap_log()}" for k in bad
        )
    except BaseException:
        for node in p.nodes:
            print(f"---- {node.name}: logs (tails) ----", file=sys.stderr)
            for comp in ("slicerd", LAUNCHER, DISPATCHER, TRAINER):
                path = node.stack.base / f"{comp}.log"
                if path.exists():
                    print(f"-- {comp} --\n{log_tail(path, 2500)}", file=sys.stderr)
        raise
    finally:
        with trio.CancelScope(shield=True):
            async with trio.open_nursery() as nursery:
                for node in p.nodes:
                    nursery.start_soon(_close, node.stack)
            shutil.rmtree(base, ignore_errors=True)


async def _close(stack: Stack) -> None:
    await stack.close(daemon_signal=signal.SIGKILL)
    await stack.reap()


# -- the client side -------------------------------------------------------------------


class Sample(NamedTuple):
    """A request `submit_many` sent: its id, the front that accepted it, its revision."""

    id: str
    front: str
    revision: str | None


def _client(front: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=front, timeout=HTTP_TIMEOUT_S)


async def publish(front: str, rev: str, base_dir: Path) -> Path:
    """Save "weights" of `rev` (``base_dir/ckpt/REV/revision.txt``: the vLLM stub loads
    it as its weight version) and publish them through `front`; the checkpoint dir.
    `StackError` unless the front answers 201 or 200."""
    path = base_dir / "ckpt" / rev
    path.mkdir(parents=True, exist_ok=True)
    (path / "revision.txt").write_text(rev)
    async with _client(front) as http:
        r = await http.post("/v1/revisions", json={"revision": rev, "path": str(path)})
    if r.status_code not in (200, 201):
        raise StackError(f"publish {rev} on {front}: {r.status_code} {r.text}")
    return path


async def submit_many(
    fronts: Sequence[str],
    n: int,
    *,
    revision: str | None = None,
    max_tokens: int = 4,
    prefix: str = "q",
    start: int = 0,
) -> list[Sample]:
    """Send `n` completion requests (prompt ``PREFIX{i}``, `max_tokens`, pinned to
    `revision` when given, else the pool's newest), request i through
    ``fronts[i % len(fronts)]``, each front's share in ``POST /v1/samples/batch`` calls
    of `SUBMIT_CHUNK`; the samples in request order, once every front acknowledged
    (that is, Redis has them). `StackError` on any answer but 202."""
    out: list[Sample | None] = [None] * n

    async def send(k: int, front: str) -> None:
        idx = list(range(k, n, len(fronts)))
        async with _client(front) as http:
            for at in range(0, len(idx), SUBMIT_CHUNK):
                part = idx[at : at + SUBMIT_CHUNK]
                reqs = []
                for i in part:
                    body: dict[str, Any] = {"kind": "completion", "prompt": f"{prefix}{start + i}"}
                    body["max_tokens"] = max_tokens
                    if revision is not None:
                        body["revision"] = revision
                    reqs.append(body)
                r = await http.post("/v1/samples/batch", json={"requests": reqs})
                if r.status_code != 202:
                    raise StackError(f"submit on {front}: {r.status_code} {r.text}")
                for i, s in zip(part, r.json()["samples"], strict=True):
                    out[i] = Sample(s["id"], front, s.get("revision"))

    async with trio.open_nursery() as nursery:
        for k, front in enumerate(fronts[:n]):
            nursery.start_soon(send, k, front)
    return [s for s in out if s is not None]


async def results(
    front: str, ids: Sequence[str], *, wait: float = RESULTS_WAIT_S
) -> dict[str, dict[str, Any]]:
    """Long-poll every sample of `ids` through `front` (``POST /v1/samples/results``,
    `RESULTS_CHUNK` ids a call, `wait` s each) until none is pending; each id's answer
    (as ``GET /v1/samples/{id}`` gives it). Unbounded: wrap it in ``trio.fail_after``."""
    got: dict[str, dict[str, Any]] = {}
    todo = list(ids)
    async with _client(front) as http:
        while todo:
            part = todo[:RESULTS_CHUNK]
            r = await http.post("/v1/samples/results", json={"ids": part, "wait": wait})
            if r.status_code != 200:
                raise StackError(f"results on {front}: {r.status_code} {r.text}")
            for body in r.json()["results"]:
                if body["status"] != "pending":
                    got[body["id"]] = body
            todo = [i for i in todo if i not in got]
    return got


async def dispatcher_status(front: str) -> dict[str, Any]:
    """A dispatcher's ``GET /status``."""
    async with _client(front) as http:
        r = await http.get("/status")
    if r.status_code != 200:
        raise StackError(f"status of {front}: {r.status_code} {r.text}")
    body: dict[str, Any] = r.json()
    return body


def versions(result: dict[str, Any]) -> set[str]:
    """Every weight version named by any span of any choice of a vLLM result."""
    return {s["version"] for c in result["choices"] for s in c["weight_versions"]}
