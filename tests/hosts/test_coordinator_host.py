"""The coordinator's own host lost: the driver's host, and with it the driver and the coordinator.

The job (``driver_job.py``) runs its driver inside host A; the coordinator starts next to it,
as by default. Its four ranks train on hosts B and C with ``host_watch=True``. Host A then
fails:

- **silenced** (its link down, then every process killed: nothing is sent). Ray hears nothing
  either and declares host A dead only after about 64 s (``../shared/RAY_FACTS.md``); until
  then the job's ranks would train on for a driver that is gone. Each node agent on B and C
  stops hearing the coordinator's beats, probes its watch, gets no answer and orders its ranks
  out, saving nothing (a step the coordinator never committed cannot be proven). Asserted:
  every rank's teardown report says it was cut off and saved nothing, and every rank's process
  is gone while Ray still calls host A alive. (Ordered out about 1.1 s after the fault; the
  processes are gone at about 7 s: with their owner, the driver, silent, Ray's intended exit
  does not finish within ``exit_grace_s``, and Ray's kill that follows takes some 4 s more.)
- **crashed** (every process killed; the host's kernel, this machine's, still answers): the
  refused connections tell Ray that host A's raylet is gone, and Ray ends the job's actors
  itself ("its owner has died"), 12-13 s after the crash. The agents take the refused probe
  for a coordinator that Ray restarts and order no one out. Asserted: every rank's process is
  gone, and no teardown report was written.

The coordinator does not come back in either case: its owner, the driver, is gone, and Ray
restarts no actor of a finished job. A new run of the job is a cold start from the newest
checkpoint complete on disk (none here: nothing was committed). docs/reliability.md keeps the
times printed here.
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid

import pytest

from benchmarks.hosts import HostCluster

pytestmark = pytest.mark.timeout(240)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _wait_ready(ready: str, driver, log_path: str, timeout_s: float = 150) -> dict:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(ready):
        if driver.poll() is not None or time.monotonic() > deadline:
            with open(log_path) as f:
                tail = f.read()[-3000:]
            raise AssertionError(f"the job on host A did not start training:\n{tail}")
        time.sleep(0.2)
    with open(ready) as f:
        return json.load(f)


def _teardown_reports(report_dir) -> list[dict]:
    return [
        json.loads(path.read_text())
        for path in report_dir.glob("*/teardown-*.json")
        if path.is_file()
    ]


@pytest.mark.parametrize("fault", ["silence", "crash"])
def test_the_coordinators_host_lost_every_rank_leaves_before_rays_verdict(
    hosts: HostCluster, tmp_path, fault: str
):
    tag = uuid.uuid4().hex[:8]
    a = hosts.add_host(num_cpus=1)
    b, c = (hosts.add_host(num_cpus=2, resources={f"{h}-{tag}": 1}) for h in "BC")
    ready, log_path = str(tmp_path / "ready.json"), str(tmp_path / "driver.log")
    command = [sys.executable, "-m", "tests.hosts.driver_job", a.ip, tag]
    command += [f"B-{tag}", f"C-{tag}", b.ip, ready]
    driver = hosts.start_process(a, command, log_path)
    try:
        job = _wait_ready(ready, driver, log_path)
        assert job["coordinator_node"] == a.node_id(), "the coordinator runs next to its driver"
        ranks = set(job["pids"])
        assert ranks <= set(b.pids()) | set(c.pids()), "the ranks run on hosts B and C"
        started, fault_at = time.monotonic(), time.time()
        hosts.fail(a, fault)
        driver.wait(10)
        deadline = started + 60  # Ray's verdict on a silenced host: about 64 s
        while ranks & (set(b.pids()) | set(c.pids())):
            assert time.monotonic() < deadline, f"ranks still alive after the {fault} of host A"
            time.sleep(0.05)
        gone = time.monotonic() - started
        print(f"{fault} of the coordinator's host: every rank gone {gone:.2f} s after it")
        reports = _teardown_reports(tmp_path / "reports")
        if fault == "silence":
            assert a.node_id() is not None, "released by the agents, before Ray's verdict"
            assert sorted(r["pid"] for r in reports) == sorted(ranks), reports
            for report in reports:
                assert "cut off from the coordinator" in report["trigger"], report
                assert report["saved"] == [], "a cut-off rank saves nothing"
                phases = {p["name"]: p for p in report["phases"]}
                ordered_at = report["started_at"] - fault_at
                print(f"  pid {report['pid']}: ordered out {ordered_at:.2f} s after the fault; "
                      f"its exit: {phases['exit']['detail']}")  # fmt: skip
        else:
            assert reports == [], "a refused probe orders no one out: Ray ended the job"
        assert b.pids() and c.pids(), "hosts B and C live on"
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait(10)
        for host in (a, b, c):
            hosts.remove_host(host)
