"""The namespace cluster itself: each host is its own address, and each fault does what a
host's failure does - observed from the driver, as the coordinator would see it."""

from __future__ import annotations

import os
import time

import pytest
import ray

from benchmarks.hosts import HostCluster, netem_unavailable

pytestmark = pytest.mark.timeout(120)


@ray.remote(num_cpus=0)
class Probe:
    def where(self) -> tuple[str, int]:
        return ray.util.get_node_ip_address(), os.getpid()


def probe_on(host) -> tuple:
    """An actor on ``host`` and what it says of itself."""
    (resource,) = [r for r in host.resources]
    actor = Probe.options(resources={resource: 0.01}).remote()
    return actor, ray.get(actor.where.remote(), timeout=60)


def round_trip(actor, timeout: float) -> float | None:
    """Seconds one call takes, or None when it has no answer within ``timeout``."""
    started = time.monotonic()
    try:
        ray.get(actor.where.remote(), timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        return None
    return time.monotonic() - started


def answers_within(actor, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if round_trip(actor, timeout=1.0) is not None:
            return True
    return False


def test_a_host_is_a_namespace_with_its_own_address(hosts: HostCluster):
    host = hosts.add_host(resources={"hostA": 1})
    _, (ip, pid) = probe_on(host)
    assert ip == host.ip != "127.0.0.1"
    assert pid in host.pids(), "the actor's process lives in the host's namespace"
    hosts.remove_host(host)


def test_a_crashed_host_has_no_process_left_and_its_actors_fail(hosts: HostCluster):
    host = hosts.add_host(resources={"hostB": 1})
    actor, _ = probe_on(host)
    killed = hosts.crash(host)
    assert len(killed) >= 3, "the raylet, its helpers and the actor"
    assert host.pids() == []
    with pytest.raises((ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)):
        ray.get(actor.where.remote(), timeout=30)
    hosts.remove_host(host)


def test_a_partitioned_host_runs_on_unreachable_and_answers_once_healed(hosts: HostCluster):
    host = hosts.add_host(resources={"hostC": 1})
    actor, (_, pid) = probe_on(host)
    hosts.partition(host)
    assert round_trip(actor, timeout=2.0) is None, "nothing reaches a cut-off host"
    assert pid in host.pids(), "its processes are alive"
    hosts.heal(host)
    assert answers_within(actor, 30), "the same actor answers once the link is back"
    hosts.remove_host(host)


def test_a_slow_host_answers_late_by_the_added_delay(hosts: HostCluster):
    """``slow``: tc netem where the kernel has it, else the host's link relayed through user
    space (this machine: no sch_netem). Either way the host keeps its address, its processes
    and their connections, and ``heal`` gives it its own link back."""
    host = hosts.add_host(resources={"hostD": 1})
    actor, (_, pid) = probe_on(host)
    before = min(round_trip(actor, 5.0) or 5.0 for _ in range(3))
    hosts.slow(host, delay_ms=200)
    slowed = min(round_trip(actor, 5.0) or 5.0 for _ in range(3))
    hosts.slow(host, delay_ms=100, from_host_ms=150)  # a new link: both ways now
    both = min(round_trip(actor, 5.0) or 5.0 for _ in range(3))
    hosts.heal(host)
    healed = min(round_trip(actor, 5.0) or 5.0 for _ in range(3))
    print(f"round trip: {before:.3f} s, slowed {slowed:.3f} s, both ways {both:.3f} s, healed "
          f"{healed:.3f} s ({'netem' if netem_unavailable() is None else 'relay'})")  # fmt: skip
    assert before < 0.15, before
    assert slowed >= 0.2, f"a 200 ms delay on every packet to the host: {slowed:.3f} s"
    assert both >= 0.25, f"100 ms to the host and 150 ms from it: {both:.3f} s"
    assert healed < 0.15, f"healed, the host answers as before: {healed:.3f} s"
    assert pid in host.pids(), "the same actor process answered throughout"
    hosts.remove_host(host)
    assert not [line for line in _links() if "rgo" in line or "rgi" in line], "no relay left"


def _links() -> list[str]:
    import subprocess

    return subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout.splitlines()


def test_a_stalled_host_is_silent_then_answers_when_it_resumes(hosts: HostCluster):
    host = hosts.add_host(resources={"hostE": 1})
    actor, (_, pid) = probe_on(host)
    hosts.stall(host, seconds=2.0)
    assert round_trip(actor, timeout=1.0) is None, "a stopped host answers nothing"
    assert answers_within(actor, 20), "it answers again after SIGCONT"
    assert pid in host.pids()
    hosts.remove_host(host)
