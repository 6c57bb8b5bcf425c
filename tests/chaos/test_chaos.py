"""The fixed chaos set: the whole stack (slicerd, launcher + vLLM stub, dispatcher,
trainer stub, sampling clients) under seeded faults; every invariant must hold
(see `tests.chaos.runner`). `make soak` runs the long randomized version."""

from __future__ import annotations

import pytest
import trio

from tests.chaos.runner import Scenario, run_scenario
from tests.chaos.scenarios import FIXED

pytestmark = pytest.mark.integration


@pytest.mark.timeout(170)
@pytest.mark.parametrize("scenario", FIXED, ids=[s.name for s in FIXED])
async def test_chaos_scenario_keeps_every_invariant(scenario: Scenario) -> None:
    # fault window + settle (every result in, deadline-bounded) + teardown
    with trio.fail_after(scenario.duration + scenario.deadline + 90):
        report = await run_scenario(scenario)
    assert report.injected, report.text()
    assert not report.violations, report.text()
    assert report.overlaps == 0 and not report.orphans, report.text()
