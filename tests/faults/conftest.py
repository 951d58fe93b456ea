"""The fault-injection suite's bookkeeping: every scenario records what it saw.

Set ``RG_FAULT_REPS`` to repeat each scenario more (`make test` runs 1), and
``RG_FAULTS_SUMMARY`` to a path to get the results as JSON plus the Markdown table that
docs/reliability.md shows.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from collections.abc import Iterable

import pytest

from ray_graceful.tools.bench.kit import recorded_crashes

REPS = int(os.environ.get("RG_FAULT_REPS", "1"))
_results: dict[str, list[dict]] = defaultdict(list)


class FaultLog:
    def record(
        self,
        scenario: str,
        ranks: int,
        released: int,
        hangs: int,
        checkpoint: str,
        pids: Iterable[int] = (),
        killed: Iterable[int] = (),
    ):
        """``checkpoint``: "committed", "abandoned (correct)", or "n/a".

        ``pids``: the scenario's rank processes, whose end Ray recorded as a crash
        (SYSTEM_ERROR) is counted - except those the scenario ``killed`` on purpose.
        """
        _results[scenario].append(
            {
                "ranks": ranks,
                "released": released,
                "hangs": hangs,
                "checkpoint": checkpoint,
                "crashes": recorded_crashes(set(pids) - set(killed)),
            }
        )


@pytest.fixture
def fault_log():
    return FaultLog()


def pytest_generate_tests(metafunc):
    if "rep" in metafunc.fixturenames:
        metafunc.parametrize("rep", range(REPS), ids=[f"rep{i}" for i in range(REPS)])


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("RG_FAULTS_SUMMARY")
    if not path or not _results:
        return
    rows = [
        "| scenario | repetitions | ranks released | checkpoint | hangs | Ray: crashes |",
        "|---|---|---|---|---|---|",
    ]
    for scenario, runs in _results.items():
        released = sum(r["released"] for r in runs)
        total = sum(r["ranks"] for r in runs)
        outcomes = sorted({r["checkpoint"] for r in runs})
        rows.append(
            f"| {scenario} | {len(runs)} | {released}/{total} | "
            f"{', '.join(outcomes)} | {sum(r['hangs'] for r in runs)} | "
            f"{sum(r['crashes'] for r in runs)}/{released} |"
        )
    with open(path, "w") as f:
        json.dump(_results, f, indent=2)
    with open(os.path.splitext(path)[0] + ".md", "w") as f:
        f.write("\n".join(rows) + "\n")
