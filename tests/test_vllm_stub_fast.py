"""The vLLM stub's fast mode (``--tokens-per-s inf --http-server lean``) keeps its contract.

A replica that must not be the ceiling (the dispatcher's burst and sustained-rate
benches) answers at once and is served by the lean HTTP server; its routes, bodies,
error bodies and shutdown are those of the default stub (tests/test_vllm_stub.py).
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest
import trio

from stubs.fakegpu import Ledger
from tests.test_vllm_stub import (  # noqa: F401  (ledger: the fixture)
    check_contract,
    ledger,
    start_stub,
)

pytestmark = pytest.mark.integration

FAST = ("--tokens-per-s", "inf", "--http-server", "lean")


async def test_the_fast_stub_answers_the_whole_contract_table(
    tmp_path: Path,
    ledger: Ledger,  # noqa: F811
) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "revision.txt").write_text("rev-1\n")
    with trio.fail_after(30):
        async with start_stub(tmp_path, "--enable-sleep-mode", *FAST) as stub:
            await check_contract(stub.http, ckpt)


async def test_the_fast_stub_generates_what_the_default_one_does_and_stops_cleanly(
    tmp_path: Path,
    ledger: Ledger,  # noqa: F811
) -> None:
    body = {"prompt": "a b c", "max_tokens": 200, "n": 2, "return_weight_versions": True}
    answers: list[dict[str, Any]] = []
    with trio.fail_after(40):
        for flags in ((), FAST):
            async with start_stub(tmp_path, *flags) as stub:
                r = await stub.http.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                answers.append({k: v for k, v in r.json().items() if k not in ("id", "created")})
                stub.proc.send_signal(signal.SIGTERM)
                with trio.fail_after(10):
                    assert await stub.proc.wait() == 0
                assert "engine core stopped" in stub.log.read_text()
            assert ledger.processes(0) == []
    assert answers[0] == answers[1]
    assert answers[1]["usage"]["completion_tokens"] == 400
