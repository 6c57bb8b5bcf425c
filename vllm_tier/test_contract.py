"""The contract test: one table of requests sent to the real vLLM server and to the stub.

Each case drives one server (with and without dev mode) and returns an *observation*:
status codes, the shape of every JSON body (keys and value types, recursively) and the
behaviour that matters (held until wake, aborted with partial text, weights changed the
output). The real server's observation must equal the stub's. Where they differ on
purpose, ``KNOWN`` pins both sides (so a change on either side is noticed) and the
stub's docstring (``stubs/vllm_stub/__init__.py``) says why.

The servers are shared by the whole module, so every case leaves them awake, not
paused, with the base weights loaded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import trio

from vllm_tier import cases_serving, cases_sleep  # noqa: F401  (they register the cases)
from vllm_tier.contract import CASES, Obs, Side, complete, err
from vllm_tier.servers import Server

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]


# -- the table ----------------------------------------------------------------------


@dataclass(frozen=True)
class Known:
    """A difference on purpose: what each side must observe (see the stub's docstring)."""

    why: str
    real: Callable[[Obs], bool]
    stub: Callable[[Obs], bool]


KNOWN: dict[str, Known] = {
    "completion_weight_versions": Known(
        "0.32 ignores return_weight_versions (0.33 returns the spans; VLLM_API.md): against "
        "0.32 the dispatcher must run with --weight-check label",
        real=lambda o: o["weight_versions"] is None,
        stub=lambda o: isinstance(o["weight_versions"], list) and len(o["weight_versions"]) == 1,
    ),
    "start_weight_update": Known(
        "a server without --weight-transfer-config answers 500 to start; the stub models "
        "the configured server VLLM_API.md describes (start opens an update)",
        real=lambda o: o["start"]["status"] == 500 and o["not_configured"],
        stub=lambda o: o["start"] == (200, {"message": "Weight update started"}),
    ),
    "pause_wait_then_new_request": Known(
        "0.32 holds a request sent while paused with mode=wait; 0.33 (VLLM_API.md, the "
        "stub) answers 503",
        real=lambda o: o["answered_while_paused"] is None and o["after_resume"] == 200,
        stub=lambda o: (o["answered_while_paused"] or {}).get("status") == 503,
    ),
    "pause_abort_then_new_request": Known(
        "0.32 holds a request sent while paused with mode=abort; 0.33 (VLLM_API.md, the "
        "stub) answers 503",
        real=lambda o: o["answered_while_paused"] is None and o["after_resume"] == 200,
        stub=lambda o: (o["answered_while_paused"] or {}).get("status") == 503,
    ),
}


def _diff(real: Obs, stub: Obs) -> str:
    keys = sorted(set(real) | set(stub))
    return "\n".join(
        f"  {k}:\n    real: {real.get(k)!r}\n    stub: {stub.get(k)!r}"
        for k in keys
        if real.get(k) != stub.get(k)
    )


async def observe(name: str, real: Server, real_nodev: Server, models: Path) -> Obs:
    # No keep-alive: vLLM may close a connection after a 500 (see test_loop's note).
    limits = httpx.Limits(max_keepalive_connections=0)
    async with (
        httpx.AsyncClient(base_url=real.url, timeout=60, limits=limits) as dev,
        httpx.AsyncClient(base_url=real_nodev.url, timeout=60, limits=limits) as nodev,
    ):
        return await CASES[name](Side(dev, nodev, models))


@pytest.mark.parametrize("name", list(CASES))
async def test_real_and_stub_agree(name: str, pair: dict[str, Server], models: Path) -> None:
    with trio.fail_after(240):
        real = await observe(name, pair["real"], pair["real-nodev"], models)
        stub = await observe(name, pair["stub"], pair["stub-nodev"], models)
    print(f"{name}: real={real!r} stub={stub!r}")
    known = KNOWN.get(name)
    if known is None:
        assert real == stub, f"real vLLM and the stub differ in {name}:\n{_diff(real, stub)}"
    else:
        assert known.real(real), f"real vLLM changed ({known.why}): {real}"
        assert known.stub(stub), f"the stub changed ({known.why}): {stub}"


async def test_generation_after_a_failed_reload_kills_the_engine(
    pair: dict[str, Server], models: Path
) -> None:
    """Last in the session: it ends both dev servers. A failed reload_weights leaves the
    model half-loaded; the next generation kills the engine and the server exits."""
    obs: dict[str, Obs] = {}
    with trio.fail_after(120):
        for side in ("real", "stub"):
            server = pair[side]
            limits = httpx.Limits(max_keepalive_connections=0)  # see observe()
            async with httpx.AsyncClient(base_url=server.url, timeout=60, limits=limits) as http:
                bad = {"method": "reload_weights", "kwargs": {"weights_path": str(models / "x")}}
                r = await http.post("/collective_rpc", json=bad)
                gen = await complete(http)
                code = await trio.to_thread.run_sync(server.proc.wait, 60)
            obs[side] = {
                "reload": r.status_code,
                "generate": err(gen),
                "dead": "EngineCore encountered an issue" in gen.text,
                "exit_code": code,
            }
    assert obs["real"] == obs["stub"], _diff(obs["real"], obs["stub"])
