"""The fixed chaos set: the whole stack (slicerd, launcher + vLLM stub, dispatcher,
trainer stub, sampling clients) under seeded faults; every invariant must hold
(see `tests.chaos.runner`). `make soak` runs the long randomized version."""

from __future__ import annotations

import pytest

from tests.chaos.runner import REAP_S, RUN_LIMIT_S, Scenario, run_scenario
from tests.chaos.scenarios import FIXED

pytestmark = [pytest.mark.integration, pytest.mark.chaos]

# run_scenario bounds each run (fault window + deadline + RUN_LIMIT_S) and then its
# cleanup (about REAP_S), and reports a run that hit its bound as a violation; the
# pytest-timeout (which ends the whole session) only backs that up.
TIMEOUT_S = max(s.duration + s.deadline for s in FIXED) + RUN_LIMIT_S + REAP_S + 15


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("scenario", FIXED, ids=[s.name for s in FIXED])
async def test_chaos_scenario_keeps_every_invariant(scenario: Scenario) -> None:
    report = await run_scenario(scenario)
    assert report.injected, report.text()
    assert not report.violations, report.text()
    assert report.overlaps == 0 and not report.orphans, report.text()
