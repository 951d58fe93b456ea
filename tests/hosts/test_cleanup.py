"""A namespace cluster leaves nothing behind: no process, link, namespace or bridge - also
after a partition, whose orphaned sockets keep a namespace from being freed."""

from __future__ import annotations

import os
import subprocess

import pytest

from benchmarks.hosts import BRIDGE, HostCluster

pytestmark = pytest.mark.timeout(120)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone for our purposes
        return f.read().split(")")[-1].split()[0] != "Z"


def test_closing_removes_every_process_link_and_namespace_even_after_faults():
    with HostCluster(head_cpus=1) as hosts:
        cut = hosts.add_host(resources={"cut": 1})
        stopped = hosts.add_host(resources={"stopped": 1})
        pids = cut.pids() + stopped.pids()
        head_pids = [proc.pid for _, proc in hosts.cluster.head_node.live_processes()]
        hosts.partition(cut)
        hosts.stall(stopped, seconds=60)  # still stopped when the cluster closes
    assert not [p for p in pids + head_pids if _alive(p)], "every process it started has ended"
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "rgh" not in namespaces, namespaces
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert BRIDGE not in links and " rgv" not in links, links
