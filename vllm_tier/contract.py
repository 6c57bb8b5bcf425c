"""The contract test's vocabulary: a *case* drives one kind of server (real or stub,
with and without dev mode, a :class:`Side`) and returns an observation; helpers shape
bodies and errors so that the real server's observation can equal the stub's.

Cases live in ``cases_serving`` (routes, errors, weights, parameters) and
``cases_sleep`` (sleep, wake, pause); ``test_contract`` runs the table.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from vllm_tier.servers import MODEL_NAME

Obs = dict[str, Any]


@dataclass
class Side:
    """What a case may touch: one server kind (real or stub), with and without dev mode."""

    dev: httpx.AsyncClient
    nodev: httpx.AsyncClient
    models: Path


Case = Callable[[Side], Awaitable[Obs]]
CASES: dict[str, Case] = {}


def case(fn: Case) -> Case:
    """Register a case under its function name (without ``case_``)."""
    CASES[fn.__name__.removeprefix("case_")] = fn
    return fn


def shape(x: Any) -> Any:
    """Keys and value types, recursively (a list by its first item)."""
    if isinstance(x, dict):
        return {k: shape(v) for k, v in sorted(x.items())}
    if isinstance(x, list):
        return [shape(x[0])] if x else []
    return type(x).__name__


def err(r: httpx.Response) -> Obs:
    """An error answer: status, then vLLM's error type and param (or FastAPI's detail)."""
    body = r.json()
    if "error" in body:
        return {
            "status": r.status_code,
            "type": body["error"]["type"],
            "param": body["error"]["param"],
            "code": body["error"]["code"],
        }
    return {"status": r.status_code, "body": body}


def text_of(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"])


async def complete(
    http: httpx.AsyncClient, prompt: Any = "hello world", **kw: Any
) -> httpx.Response:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 4, "temperature": 0, **kw}
    return await http.post("/v1/completions", json=body)


async def metric(http: httpx.AsyncClient, name: str) -> float:
    """A gauge of /metrics by name (the first sample)."""
    for line in (await http.get("/metrics")).text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


async def sleep_states(http: httpx.AsyncClient) -> dict[str, float]:
    """The ``vllm:engine_sleep_state`` samples by their ``sleep_state`` label."""
    out = {}
    for line in (await http.get("/metrics")).text.splitlines():
        if line.startswith("vllm:engine_sleep_state{"):
            label = line.split('sleep_state="', 1)[1].split('"', 1)[0]
            out[label] = float(line.rsplit(" ", 1)[1])
    return out
