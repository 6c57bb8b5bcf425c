"""The demo's sampling client (trio + httpx): as each expected revision is published to
the dispatcher, it submits `requests` sampling requests pinned to that revision
(``POST /v1/samples``), then long-polls each (``GET /v1/samples/{id}?wait=``) until it
is finished, and checks that every choice of every result names exactly that revision in
its ``weight_versions``. Every wait is bounded by one deadline for the whole run."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import trio

POLL_WAIT_S = 10.0  # one long-poll
REVISIONS_POLL_S = 0.05
MAX_TOKENS = 8
PARALLEL_POLLS = 64
SUBMIT_CONNECTIONS = 16
KEEPALIVE_S = 1.0
POLL_RETRIES = 3  # a long-poll (a GET) is retried on a transport error


@dataclass
class Outcome:
    """One request: what was asked and how it ended."""

    revision: str
    index: int
    id: str | None = None
    status: str = "unsent"  # unsent, pending (lost), done, failed, mismatch, error
    detail: str = ""
    versions: list[str] = field(default_factory=list)
    submitted: float | None = None  # monotonic
    finished: float | None = None


@dataclass
class ClientReport:
    """Every request's outcome, and when each revision was first seen."""

    outcomes: list[Outcome] = field(default_factory=list)
    seen: dict[str, float] = field(default_factory=dict)  # revision -> monotonic
    errors: list[str] = field(default_factory=list)

    def served(self) -> int:
        """Requests served with exactly their revision."""
        return sum(1 for o in self.outcomes if o.status == "done")

    def problems(self, expected: int) -> list[str]:
        """Every loss, failure and mismatch, one line each (at most 20 listed)."""
        bad = [o for o in self.outcomes if o.status != "done"]
        out = [f"{o.revision} #{o.index} ({o.id}): {o.status}: {o.detail}" for o in bad[:20]]
        if len(bad) > 20:
            out.append(f"... and {len(bad) - 20} more")
        if len(self.outcomes) != expected:
            out.append(f"{len(self.outcomes)} requests sent, {expected} expected")
        return [*self.errors, *out]


def _versions(result: dict[str, Any]) -> list[list[str]]:
    """Each choice's weight versions (the span names, in order)."""
    out: list[list[str]] = []
    for c in result.get("choices") or []:
        spans = c.get("weight_versions") if isinstance(c, dict) else None
        out.append([str(s.get("version")) for s in spans or [] if isinstance(s, dict)])
    return out


def check(o: Outcome, body: dict[str, Any]) -> None:
    """Settle `o` from a finished sample `body`: done only when the dispatcher ran it
    with its revision and each choice names that revision and no other."""
    o.finished = time.monotonic()
    if body.get("status") == "failed":
        o.status, o.detail = "failed", str(body.get("error"))
        return
    if body.get("revision") != o.revision:
        o.status, o.detail = "mismatch", f"sample ran as revision {body.get('revision')!r}"
        return
    per_choice = _versions(body.get("result") or {})
    o.versions = sorted({v for vs in per_choice for v in vs})
    if not per_choice or any(set(vs) != {o.revision} or not vs for vs in per_choice):
        o.status, o.detail = "mismatch", f"choices' weight_versions: {per_choice}"
        return
    o.status = "done"


async def _submit(http: httpx.AsyncClient, o: Outcome) -> None:
    body = {"prompt": f"{o.revision} question {o.index}", "max_tokens": MAX_TOKENS}
    try:
        r = await http.post("/v1/samples", json={**body, "revision": o.revision})
    except httpx.HTTPError as e:
        o.status, o.detail = "error", f"POST /v1/samples: {type(e).__name__}: {e}"
        return
    if r.status_code != 202:
        o.status, o.detail = "error", f"POST /v1/samples: HTTP {r.status_code} {r.text}"
        return
    o.id, o.status, o.submitted = str(r.json()["id"]), "pending", time.monotonic()


async def _poll(http: httpx.AsyncClient, o: Outcome, limit: trio.CapacityLimiter) -> None:
    failures = 0
    async with limit:
        while True:
            try:
                r = await http.get(f"/v1/samples/{o.id}", params={"wait": POLL_WAIT_S})
            except httpx.TransportError as e:
                failures += 1
                if failures >= POLL_RETRIES:
                    o.status, o.detail = "error", f"GET: {type(e).__name__}: {e}"
                    return
                await trio.sleep(0.1 * failures)
                continue
            if r.status_code != 200:
                o.status, o.detail = "error", f"GET: HTTP {r.status_code} {r.text}"
                return
            got: dict[str, Any] = r.json()
            if got.get("status") != "pending":
                check(o, got)
                return


async def _revision(
    submit: httpx.AsyncClient,
    poll: httpx.AsyncClient,
    outcomes: list[Outcome],
    limit: trio.CapacityLimiter,
) -> None:
    """Submit all of one revision's requests at once, then long-poll each."""
    async with trio.open_nursery() as n:
        for o in outcomes:
            n.start_soon(_submit, submit, o)
    async with trio.open_nursery() as n:
        for o in outcomes:
            if o.status == "pending":
                n.start_soon(_poll, poll, o, limit)


async def sample_revisions(
    url: str, revisions: list[str], requests: int, timeout: float
) -> ClientReport:
    """Sample each of `revisions` (`requests` times) as it appears at `url`; bounded by
    `timeout` seconds in all (what is unfinished by then stays `pending`: lost)."""
    report = ClientReport()
    limit = trio.CapacityLimiter(PARALLEL_POLLS)
    # Submissions and long-polls on pools of their own: polls never delay a submission.
    # Idle connections are dropped well before the server's keep-alive timeout (hypercorn:
    # 5 s): a POST on a connection the server is just closing would be reset, and a POST
    # is not retried (it might have been journaled).
    pools = (
        httpx.Limits(max_connections=SUBMIT_CONNECTIONS, keepalive_expiry=KEEPALIVE_S),
        httpx.Limits(max_connections=PARALLEL_POLLS, keepalive_expiry=KEEPALIVE_S),
    )
    async with (
        httpx.AsyncClient(base_url=url, timeout=POLL_WAIT_S + 10, limits=pools[0]) as http,
        httpx.AsyncClient(base_url=url, timeout=POLL_WAIT_S + 10, limits=pools[1]) as poll,
    ):
        with trio.move_on_after(timeout) as scope:
            async with trio.open_nursery() as nursery:
                todo = list(revisions)
                while todo:
                    try:
                        r = await http.get("/v1/revisions")
                        names = {x["revision"] for x in r.json()["revisions"]}
                    except (httpx.HTTPError, ValueError, KeyError, TypeError):
                        names = set()  # the dispatcher may be busy: ask again
                    for rev in [x for x in todo if x in names]:
                        todo.remove(rev)
                        report.seen[rev] = time.monotonic()
                        batch = [Outcome(rev, i) for i in range(requests)]
                        report.outcomes += batch
                        nursery.start_soon(_revision, http, poll, batch, limit)
                    if todo:
                        await trio.sleep(REVISIONS_POLL_S)
        if scope.cancelled_caught:
            missing = [r for r in revisions if r not in report.seen]
            report.errors.append(
                f"client gave up after {timeout:.0f} s"
                + (f"; never published: {', '.join(missing)}" if missing else "")
            )
            for o in report.outcomes:
                if o.status == "pending":
                    o.detail = "no result by the client's deadline (lost)"
                elif o.status == "unsent":
                    o.detail = "not submitted by the client's deadline"
            for rev in missing:
                report.outcomes += [
                    Outcome(rev, i, detail="revision never published") for i in range(requests)
                ]
    return report
