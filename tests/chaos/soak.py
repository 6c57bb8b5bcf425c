"""`make soak SEED=1 MINUTES=20`: randomized chaos scenarios until the time is up.

Each scenario gets its own seed, drawn from ``random.Random(SEED)``; every fault kind may
be drawn. Prints each scenario's report as it ends, then the summary table; exits 1 on
any invariant violation. ``--jsonl FILE`` also writes one JSON report per line.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

import trio

from tests.chaos.runner import Report, Scenario, jsonable, run_scenario, summary_table


async def soak(seed: int, minutes: float, jsonl: str | None) -> list[Report]:
    rng = random.Random(seed)
    end = time.monotonic() + minutes * 60
    reports: list[Report] = []
    k = 0
    while time.monotonic() < end:
        k += 1
        sc = Scenario(
            name=f"soak-{k}",
            seed=rng.randrange(1 << 30),
            duration=rng.uniform(20, 45),
            faults=rng.randint(2, 7),
            deadline=60,
        )
        print(f"==== {sc.name} seed {sc.seed}: {sc.faults} faults over {sc.duration:.0f} s",
              flush=True)  # fmt: skip
        r = await run_scenario(sc, lambda s: print(s, flush=True))
        reports.append(r)
        if jsonl:
            with open(jsonl, "a") as f:
                f.write(json.dumps(jsonable(r)) + "\n")
    return reports


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="soak")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--minutes", type=float, default=20.0)
    p.add_argument("--jsonl")
    args = p.parse_args(argv)
    t0 = time.monotonic()
    reports = trio.run(soak, args.seed, args.minutes, args.jsonl)
    print()
    print(f"soak SEED={args.seed} MINUTES={args.minutes:g}: "
          f"{(time.monotonic() - t0) / 60:.1f} min")  # fmt: skip
    print(summary_table(reports))
    bad = [r for r in reports if r.violations]
    for r in bad:
        print(f"\n{r.scenario} seed {r.seed}:")
        for v in r.violations:
            print(f"  VIOLATION: {v}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
