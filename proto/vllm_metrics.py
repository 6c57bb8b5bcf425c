"""vLLM's sleep state as its Prometheus text says it (``GET /metrics``): sans-IO, shared
by the launcher (its park never deepens a sleep it finds) and the dispatcher (what a
replica slept by someone else still holds)."""

from __future__ import annotations

import re

__all__ = ["parse_sleep_state"]

_SLEEP_STATE = re.compile(r'sleep_state="([a-z_]+)"[^}]*\}\s+(\S+)')


def parse_sleep_state(text: str) -> str | None:
    """The ``sleep_state`` label whose ``vllm:engine_sleep_state`` sample is 1 in a
    Prometheus text (``awake``, ``weights_offloaded``, ``discard_all``); ``"paused"`` when
    every sample is 0 (a pause, or a level-0 sleep: memory untouched); None when the
    metric is missing or says two things at once. Matched by name and label, never by
    the whole line (other labels, such as ``engine`` and ``model_name``, vary)."""
    states: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:engine_sleep_state{"):
            continue
        m = _SLEEP_STATE.search(line)
        if m is None:
            continue
        try:
            states[m[1]] = float(m[2])
        except ValueError:
            return None
    if not states:
        return None
    on = [k for k, v in states.items() if v == 1.0]
    if len(on) > 1:
        return None
    return on[0] if on else "paused"
