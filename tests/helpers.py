"""Waiting and looking things up in a real Ray cluster, without the dashboard."""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

from ray_graceful import GracefulConfig
from ray_graceful.worker.process_groups import free_port as free_port  # re-exported for the tests


def fast_config(root: Any, **overrides: Any) -> GracefulConfig:
    """The coordinator's logic tests' config: files under ``root``, no gathering window, short
    deadlines, no health probe."""
    values: dict[str, Any] = {
        "report_dir": os.path.join(str(root), "reports"),
        "checkpoint_dir": os.path.join(str(root), "ckpt"),
        "notice_gather_s": 0.0,
        "drain_poll_interval_s": 0.05,
        "teardown_timeout_s": 3.0,
        "save_budget_s": 1.0,
        "expected_save_s": 0.1,
        "plan_margin_s": 0.0,
        "health_probe": "none",
    }
    return GracefulConfig(**{**values, **overrides})


def _checked(condition: Callable[[], Any], end: float, timeout: float, what: str) -> Any:
    """``condition()``; an AssertionError naming ``what`` once it is still false after ``end``."""
    value = condition()
    if not value and time.monotonic() > end:
        raise AssertionError(f"timed out after {timeout}s waiting for {what}")
    return value


def wait_for(condition: Callable[[], Any], timeout: float, what: str, every: float = 0.02) -> Any:
    """Poll ``condition`` until truthy; fail the test naming ``what`` after ``timeout``."""
    end = time.monotonic() + timeout
    while not (value := _checked(condition, end, timeout, what)):
        time.sleep(every)
    return value


async def until(condition: Callable[[], Any], timeout: float, what: str) -> Any:
    """``wait_for`` on an event loop: poll ``condition`` between the loop's other work (the
    coordinator's own tasks run meanwhile); fail the test naming ``what`` after ``timeout``."""
    import asyncio

    end = time.monotonic() + timeout
    while not (value := _checked(condition, end, timeout, what)):
        await asyncio.sleep(0.005)
    return value


def in_collective_path(pid: int) -> str:
    """Where the test ranks (``actors.all_reduce_seen``) say whether they are inside a
    collective: a rank blocked in one cannot answer a Ray call, so it says so in a file."""
    return os.path.join(tempfile.gettempdir(), f"ray_graceful-tests-in-collective-{pid}")


def mark_collective(pid: int, where: str) -> None:
    with open(in_collective_path(pid), "w") as f:
        f.write(where)


def in_collective(pid: int) -> bool:
    try:
        with open(in_collective_path(pid)) as f:
            return f.read() == "in"
    except OSError:
        return False


def wait_in_collective(pids: list[int], timeout: float = 30.0) -> None:
    """Until every rank of ``pids`` is inside a collective (one that blocks: a peer is absent).
    A rank marks itself right before the call, so it may still be a few instructions short of
    it; a collective that cannot complete blocks it either way."""
    wait_for(lambda: all(in_collective(pid) for pid in pids), timeout, f"{pids} to block")


def saving_path(pid: int) -> str:
    """Where a test rank with a slow save (``actors.GracefulRank``, ``save_seconds``) says that
    its save has begun: a rank inside its save answers no Ray call either."""
    return os.path.join(tempfile.gettempdir(), f"ray_graceful-tests-saving-{pid}")


def wait_saving(pids: list[int], timeout: float = 30.0) -> None:
    """Until every rank of ``pids`` is inside its save."""
    wait_for(lambda: all(os.path.exists(saving_path(p)) for p in pids), timeout, f"{pids} saving")


def worker_exit(pid: int) -> tuple[str | None, str] | None:
    """(exit type, exit detail) that the GCS recorded for the dead worker ``pid``."""
    from ray_graceful.ray_adapter import worker_exit_details

    return worker_exit_details({pid}).get(pid)


def report_for(report_dir: str, pid: int) -> dict | None:
    """The TeardownReport JSON that process ``pid`` wrote, if any."""
    for base, _dirs, files in os.walk(report_dir):
        for name in files:
            if name.startswith("teardown-") and name.endswith(f"-{pid}.json"):
                with open(os.path.join(base, name)) as f:
                    return json.load(f)
    return None


def kill_actors(*actors: Any) -> None:
    import ray

    for actor in actors:
        try:
            ray.kill(actor)
        except Exception:
            pass


def register_stand_in_rank(coordinator, pid: str = "p0", group: str = "g"):
    """Register one rank (group/0) on this node as a worker would, without a worker: for
    tests of what reaches the coordinator (the CLI, the examples' hooks)."""
    import ray

    from ray_graceful.protocol import RankSpec, Register

    node = ray.get_runtime_context().get_node_id()
    spec = RankSpec(group, 0, 1, "0", True)
    return ray.get(coordinator.handle.register.remote(Register(pid, node, 1, "h", "", (spec,))))
