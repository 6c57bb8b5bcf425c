"""BENCHMARKS.md's hot-path section: every target of issue 14, before and after.

Used by ``bench/efficiency.py --hotpath-before ... --dispatch-json ... --handoff-json ...``
(``make bench``). *Before* is ``bench/hotpath_before.json``: figures measured once at
commit b59b1fe (the commands are in the file). *After* is this run: the JSON that
``bench/dispatch.py --json-file`` and ``bench/handoff.py --json-file`` wrote, and the
whole-loop scenarios' orchestration overhead. The profile summaries are
``bench/profile_summary.py``'s output for a profiled run of each (``--profile-text``).
"""

from __future__ import annotations

from typing import Any

TARGET_OVERHEAD_P50_MS, TARGET_OVERHEAD_P99_MS = 5.0, 15.0


def _v(ok: bool | None) -> str:
    return "n/a" if ok is None else ("PASS" if ok else "MISS")


def _overheads(scenarios: list[dict[str, Any]]) -> tuple[list[float], list[float]]:
    """Orchestration overhead p50 and p99 (ms) of every scenario of this run."""
    p50 = [r["switches"]["all"]["overhead"]["p50"] for r in scenarios]
    p99 = [r["switches"]["all"]["overhead"]["p99"] for r in scenarios]
    return p50, p99


def _span(xs: list[float]) -> str:
    return f"{min(xs):.1f}-{max(xs):.1f}" if xs else "n/a"


def rows(
    before: dict[str, Any],
    disp: dict[str, Any] | None,
    hand: dict[str, Any] | None,
    scenarios: list[dict[str, Any]],
) -> list[tuple[str, str, str, str]]:
    """(target, before, after, verdict) for every target of the issue."""
    b, bd = before["dispatcher"], before["daemon"]
    out: list[tuple[str, str, str, str]] = []
    d = disp or {}
    fast = d.get("fast", {})
    cpu = d.get("dispatcher_cpu_us_per_request")
    out.append(("dispatcher CPU per request (sequential phase) <= 1 ms",
                f"{b['cpu_us_per_request']:.0f} us",
                "n/a" if cpu is None else f"{cpu:.0f} us",
                _v(None if cpu is None else cpu <= 1000)))  # fmt: skip
    added = d.get("added_ms", {}).get("p50")
    out.append(("added latency p50 <= 2 ms", f"{b['added_p50_ms']:.2f} ms",
                "n/a" if added is None else f"{added:.2f} ms",
                _v(None if added is None else added <= 2.0)))  # fmt: skip
    ratio = d.get("throughput_ratio")
    after_ratio = "n/a"
    if ratio is not None:
        after_ratio = f"{ratio:.2f} ({d['via_rps']:.0f} / {d['direct_rps']:.0f} req/s)"
    out.append(("throughput through the dispatcher / direct >= 0.8",
                f"{b['throughput_ratio']:.2f} ({b['via_rps']:.0f} / {b['direct_rps']:.0f} req/s)",
                after_ratio, _v(None if ratio is None else ratio >= 0.8)))  # fmt: skip
    s = fast.get("sustained")
    rps = s.get("committed_rps") if s else None
    out.append(("sustained short requests/s, fast replica >= 2,000",
                f"no batch route; {b['via_rps']:.0f} req/s per-request route",
                "n/a" if rps is None else f"{rps:.0f} req/s",
                _v(None if rps is None else rps >= 2000)))  # fmt: skip
    burst = fast.get("burst")
    if burst:
        vd = d.get("verdicts", {})
        c = burst.get("counters_delta") or burst.get("counters") or {}
        what = ", ".join(f"{k} {c[k]}" for k in ("commits", "expired", "send_errors",
                                                 "turn_errors") if k in c)  # fmt: skip
        out.append((f"burst of {burst.get('requests', 20000)}: all committed, no timeouts",
                    "not measured", what or "see the dispatcher report",
                    vd.get("burst_committed", "n/a")))  # fmt: skip
        out.append(("burst: dispatcher peak RSS bounded",
                    "not measured",
                    f"{burst['rss_before_mib']} -> {burst['rss_peak_mib']} MiB",
                    vd.get("burst_rss", "n/a")))  # fmt: skip
    p50, p99 = _overheads(scenarios)
    ok_o = bool(p50) and max(p50) < TARGET_OVERHEAD_P50_MS and max(p99) < TARGET_OVERHEAD_P99_MS
    out.append(("orchestration per switch p50 < 5 ms / p99 < 15 ms (every scenario)",
                f"{_span(bd['orchestration_p50_ms'])} / {_span(bd['orchestration_p99_ms'])} ms",
                f"{_span(p50)} / {_span(p99)} ms" if p50 else "n/a",
                _v(ok_o if p50 else None)))  # fmt: skip
    h = hand or {}
    r = h.get("ratios", {})
    hp = r.get("handoff_over_ping")
    out.append(("handoff p50 <= 2x PING round trip (same run)",
                f"{bd['handoff_over_ping']:.1f}x ({bd['handoff_p50_us']:.0f} / "
                f"{bd['ping_p50_us']:.0f} us)",
                "n/a" if hp is None else f"{hp:.1f}x ({h['handoff']['handoff_us']['p50']:.0f} / "
                f"{h['reacquire']['ping_us']['p50']:.0f} us)",
                _v(None if hp is None else hp <= 2.0)))  # fmt: skip
    ap = r.get("acquire_over_ping")
    out.append(("re-ACQUIRE p50 <= 1.5x PING round trip (same run)",
                f"{bd['reacquire_over_ping']:.2f}x ({bd['reacquire_p50_us']:.0f} us)",
                "n/a" if ap is None else
                f"{ap:.2f}x ({h['reacquire']['acquire_us']['p50']:.0f} us)",
                _v(None if ap is None else ap <= 1.5)))  # fmt: skip
    c = h.get("cascade")
    if c:
        fifo = c["fifo_by_turn"] and c["quiet"]["fifo_by_turn"]
        mx = c["status_during_ms"].get("max")
        n = c.get("queue_len_before", 1000)
        out.append((f"{n} waiters FIFO, STATUS during the cascade < 50 ms",
                    f"FIFO {bd['cascade_fifo']}, max {bd['status_during_cascade_max_ms']} ms",
                    f"FIFO {fifo}, max {mx} ms",
                    _v(bool(fifo and mx is not None and mx < 50))))  # fmt: skip
    return out


def markdown(
    before: dict[str, Any],
    disp: dict[str, Any] | None,
    hand: dict[str, Any] | None,
    scenarios: list[dict[str, Any]],
    profiles: dict[str, str],
) -> list[str]:
    """The section's lines."""
    lines = ["## Hot path: the latency and throughput targets, before and after\n"]
    lines.append(
        "Before: measured once at commit b59b1fe (`bench/hotpath_before.json` holds the"
        " figures and the commands). After: this run (`bench/dispatch.py`, `bench/handoff.py`"
        " and the scenarios above). One run each on the same kind of machine; other work may"
        " share the machine (see Machine).\n"
    )
    lines.append("| target | before | after | verdict |")
    lines.append("|---|---|---|---|")
    for t, b, a, v in rows(before, disp, hand, scenarios):
        lines.append(f"| {t} | {b} | {a} | {v} |")
    lines.append("")
    lines.append("### Profiles (own CPU time by package, then the top functions)\n")
    for title, key, text in (
        ("dispatcher, before", "dispatcher_before", before["dispatcher"].get("profile")),
        ("dispatcher, after", "dispatcher_after", profiles.get("dispatcher")),
        ("slicerd (handoff loop), before", "daemon_before", before["daemon"].get("profile")),
        ("slicerd (handoff loop), after", "daemon_after", profiles.get("daemon")),
    ):
        if not text:
            continue
        cmd = {
            "dispatcher_before": before["dispatcher"].get("profile_command"),
            "daemon_before": before["daemon"].get("profile_command"),
        }.get(key)
        lines.append(f"**{title}**" + (f" (`{cmd}`)" if cmd else "") + "\n")
        lines.append("```\n" + text.rstrip() + "\n```\n")
    return lines
