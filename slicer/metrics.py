"""slicerd's Prometheus metrics (prometheus-client), served by `slicer.metrics_http`.

Opt-in: config `metrics_listen` (``--metrics-listen HOST:PORT``); off by default (then
this module, and prometheus-client, are never imported). Each
daemon has its own `CollectorRegistry` (never the process-global one), and two feeds:

* counters and histograms are fed from the WATCH events the server performs (`event`,
  hooked as `Server.on_event`): the state machine stays pure, the server decides nothing
  more than before, and every figure is what a watcher sees;
* gauges are read at scrape time by a collector: queues, holders, connections and
  workload states from the state machine; the GPUs' used, workload-resident and foreign
  bytes from the GPU backend (one census per GPU, shared by scrapes within `READING_TTL`,
  so a scraper in a loop costs the backend at most one reading per interval).

The series (all names start with ``slicer_``; ``gpu`` is the GPU index) are listed in
README.md, "Metrics". The series labelled by ``workload`` live only while it is registered:
its ``unregistered`` event removes them all, so a node that sees a new workload name per
job keeps as many series as it has workloads, not one set per name it ever saw (and a
scrape, rendered in the daemon's loop, stays short).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import trio
from prometheus_client import Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from gpu_slicer.slicer import __version__
from gpu_slicer.slicer.model import WState

if TYPE_CHECKING:
    from gpu_slicer.slicer.server import Server

__all__ = ["CONTENT_TYPE", "READING_TTL", "SlicerMetrics"]

log = logging.getLogger("slicer.metrics")

# The classic text format's type, which every Prometheus reads (generate_latest writes that
# format; newer prometheus-client versions name 1.0.0 in CONTENT_TYPE_LATEST instead).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
READING_TTL = 1.0  # seconds a scrape's reading of the GPUs is shared by the next scrapes
WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 1800, 3600)
MOVE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class SlicerMetrics:
    """The metrics of one daemon (`server`): its registry, the event feed, rendering."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.registry = CollectorRegistry(auto_describe=False)
        reg = self.registry
        self.granted = Counter(
            "slicer_turns_granted", "Turns granted.", ["gpu", "workload"], registry=reg
        )
        self.ended = Counter(
            "slicer_turns_ended",
            "Turns ended, by how (released, holder-closed, unregistered).",
            ["gpu", "workload", "how"],
            registry=reg,
        )
        self.wasted = Counter(
            "slicer_turns_wasted",
            "Turns released used=0 (no work done) after a park or restore paid for them.",
            ["gpu", "workload"],
            registry=reg,
        )
        self.wait = Histogram(
            "slicer_acquire_wait_seconds",
            "Time from ACQUIRE to its grant.",
            ["gpu"],
            buckets=WAIT_BUCKETS,
            registry=reg,
        )
        self.park = Histogram(
            "slicer_park_seconds",
            "Duration of parks that held, by how (checkpoint, cooperative).",
            ["gpu", "how"],
            buckets=MOVE_BUCKETS,
            registry=reg,
        )
        self.restore = Histogram(
            "slicer_restore_seconds",
            "Duration of restores that held.",
            ["gpu"],
            buckets=MOVE_BUCKETS,
            registry=reg,
        )
        self.park_bytes = Counter(
            "slicer_park_bytes", "Device bytes moved off the GPU by parks.", ["gpu"], registry=reg
        )
        self.restore_bytes = Counter(
            "slicer_restore_bytes", "Device bytes brought back by restores.", ["gpu"], registry=reg
        )
        self.parks_failed = Counter(
            "slicer_parks_failed", "Parks that failed (the workload faulted).", ["gpu"],
            registry=reg,
        )  # fmt: skip
        self.restores_failed = Counter(
            "slicer_restores_failed", "Restores that failed (the workload faulted).", ["gpu"],
            registry=reg,
        )  # fmt: skip
        self.faults = Counter(
            "slicer_faults", "Workload faults, by reason.", ["gpu", "reason"], registry=reg
        )
        # The park or restore in flight per GPU (its workload, and for a restore the
        # bytes it brings back): a FAULT of that workload is that move failing.
        self._moving: dict[int, tuple[str, str, int]] = {}
        # The label sets of each workload's children in the workload-labelled series.
        self._labelled: dict[str, set[tuple[Counter, tuple[str, ...]]]] = {}
        self._state = _StateCollector(server)

    def event(self, body: dict[str, Any]) -> None:
        """Count one WATCH event (the server calls this for each one it performs)."""
        try:
            self._count(body)
        except Exception:  # a metric must never cost the daemon an effect
            log.exception("counting event %r failed", body.get("event"))

    def _count(self, body: dict[str, Any]) -> None:
        kind, name, index = body.get("event"), str(body.get("workload")), body.get("gpu")
        if kind == "unregistered":
            self._forget(name)
            return
        if not isinstance(index, int):
            return
        gpu = str(index)
        match kind:
            case "granted":
                self._turn(self.granted, name, gpu, name)
                self.wait.labels(gpu).observe(int(body.get("waited_ms", 0)) / 1000)
            case "released":
                self._turn(self.ended, name, gpu, name, str(body.get("how")))
                if body.get("wasted"):
                    self._turn(self.wasted, name, gpu, name)
            case "parking":
                self._moving[index] = ("park", name, 0)
            case "restoring":
                self._moving[index] = ("restore", name, self._parked_bytes(name))
            case "parked":
                self._moving.pop(index, None)
                how = str(body.get("how", "checkpoint"))
                self.park.labels(gpu, how).observe(int(body.get("park_ms", 0)) / 1000)
                self.park_bytes.labels(gpu).inc(max(0, int(body.get("bytes", 0))))
            case "restored":
                moving = self._moving.pop(index, None)
                self.restore.labels(gpu).observe(int(body.get("restore_ms", 0)) / 1000)
                if moving is not None and moving[:2] == ("restore", name):
                    self.restore_bytes.labels(gpu).inc(moving[2])
            case "park-deferred" | "recovered":
                self._moving.pop(index, None)
            case "fault":
                self.faults.labels(gpu, str(body.get("reason"))).inc()
                moving = self._moving.get(index)
                if moving is not None and moving[1] == name:
                    del self._moving[index]
                    failed = self.parks_failed if moving[0] == "park" else self.restores_failed
                    failed.labels(gpu).inc()

    def _forget(self, name: str) -> None:
        # Every child of a workload-labelled series, on every GPU, whatever its other
        # labels: the workload's turn counts end with it.
        # (Tracked here: remove_by_labels is newer than the prometheus-client we allow.)
        for series, labels in self._labelled.pop(name, set()):
            with contextlib.suppress(KeyError):
                series.remove(*labels)

    def _turn(self, series: Counter, name: str, *labels: str) -> None:
        self._labelled.setdefault(name, set()).add((series, labels))
        series.labels(*labels).inc()

    def _parked_bytes(self, name: str) -> int:
        w = self.server.sm.registered.get(name)
        return w.parked_bytes if w is not None else 0

    async def render(self) -> tuple[bytes, str]:
        """The exposition text of every series now, and its content type.

        The state machine's gauges are read here, on the daemon's loop, as a snapshot;
        writing the text (most of a scrape's cost: about 20 ms with 200 workloads on two
        cores, `bench/surface.py`) runs in a worker thread, so the loop serves clients
        meanwhile. The counters and histograms are safe to read there (prometheus-client
        guards them with locks)."""
        snapshot = _Snapshot(self.registry, list(self._state.collect()))
        return await trio.to_thread.run_sync(generate_latest, snapshot), CONTENT_TYPE


class _Snapshot:
    # What generate_latest asks of a registry: the live counters, then the gauges read
    # on the loop.
    def __init__(self, registry: CollectorRegistry, gauges: list[Metric]) -> None:
        self.registry, self.gauges = registry, gauges

    def collect(self) -> Iterator[Metric]:
        yield from self.registry.collect()
        yield from self.gauges


def _per_gpu(
    rows: Iterable[tuple[int, Sequence[int]]], *series: tuple[str, str]
) -> list[GaugeMetricFamily]:
    # One gpu-labelled gauge family per (name, help) of `series`, each row (GPU index,
    # values) giving the j-th family its j-th value.
    families = [GaugeMetricFamily(name, doc, labels=["gpu"]) for name, doc in series]
    for index, values in rows:
        for family, value in zip(families, values, strict=True):
            family.add_metric([str(index)], value)
    return families


class _StateCollector(Collector):
    """Gauges read from the state machine and the GPU backend at scrape time."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self._totals: dict[int, int] | None = None
        self._reading: tuple[float, dict[int, tuple[int, int, int, int]]] = (-READING_TTL, {})

    def collect(self) -> Iterator[Metric]:
        server, sm = self.server, self.server.sm
        info = GaugeMetricFamily("slicer_info", "The daemon's version.", labels=["version"])
        info.add_metric([__version__], 1)
        yield info
        yield from _per_gpu(
            (
                (index, (len(gpu.queue), int(gpu.holder is not None), int(gpu.op is not None)))
                for index, gpu in sorted(sm.gpus.items())
            ),
            ("slicer_queue_length", "Connections waiting for a turn (ACQUIRE)."),
            ("slicer_turn_held", "1 while a turn is held."),
            ("slicer_gpu_operation", "1 while a park, restore, verify or recovery runs."),
        )
        states = {s: 0 for s in WState}
        for w in sm.workloads():
            states[w.state] += 1
        by_state = GaugeMetricFamily(
            "slicer_workloads", "Workloads (registered or still tracked), by state.",
            labels=["state"],
        )  # fmt: skip
        for s, n in states.items():
            by_state.add_metric([str(s)], n)
        yield by_state
        yield GaugeMetricFamily(
            "slicer_connections", "Client connections open.", value=len(server.conns)
        )
        yield GaugeMetricFamily(
            "slicer_journal_ok", "1 while the journal is written.",
            value=1 if server.journal_error is None else 0,
        )  # fmt: skip
        yield from self._bytes()

    def _bytes(self) -> Iterator[Metric]:
        # Each reading is (total, used, resident, foreign), the families' order.
        yield from _per_gpu(
            sorted(self._read().items()),
            ("slicer_gpu_total_bytes", "Device memory."),
            ("slicer_gpu_used_bytes", "Device memory in use (any process)."),
            ("slicer_gpu_resident_bytes", "Device memory held by workloads' processes."),
            ("slicer_gpu_foreign_bytes", "Device memory held by processes of no workload."),
        )

    def _read(self) -> dict[int, tuple[int, int, int, int]]:
        # Per GPU: (capacity, used, workload-resident, foreign) bytes. A GPU the backend
        # cannot read is left out of this scrape (its series are absent, not zero).
        at, cached = self._reading
        now = time.monotonic()
        if now - at < READING_TTL:
            return cached
        server = self.server
        if self._totals is None:
            try:
                self._totals = {d.index: d.total for d in server.backend.devices()}
            except Exception as e:
                log.warning("metrics: cannot list the GPUs: %s", e)
                return {}
        out: dict[int, tuple[int, int, int, int]] = {}
        for index, cap in self._totals.items():
            try:
                seen = server.backend.processes(index)
                taken = server.ops.attr.attribute(seen, server.ops.attr.roots(index))
                free = server.backend.free_bytes(index)
            except Exception as e:
                log.debug("metrics: cannot read GPU %d: %s", index, e)
                continue
            res = sum(taken.bytes_by_wid.values())
            alien = sum(taken.foreign.values()) + taken.unattributed
            out[index] = (cap, cap - free, res, alien)
        self._reading = (now, out)
        return out
