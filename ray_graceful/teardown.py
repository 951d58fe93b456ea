"""The ordered, guarded, timed steps that end a rank, and the report they leave.

Order (DESIGN.md §3), each step wrapped so that a half-broken rank still does the half that
works, and each recorded in the ``TeardownReport`` as ran / skipped (with the reason) / failed
(with the error), with its start and duration:

1. ``stop``             - ``should_stop()`` turns true; the coordinator is told.
2. ``quiesce``          - wait (bounded) for the training thread to reach its step boundary:
                          ``should_stop(step)`` *parks* it there until the save is done, so the
                          state saved is exactly the state of ``step``. A thread found inside a
                          collective is not waited for: a collective whose peer is gone never
                          returns.
3. ``drain_device`` and ``release_peers``, in the safe order: a rank parked at its boundary
                          drains the device first (``torch.cuda.synchronize()``, bounded) and
                          then aborts its communicators, so no abort cuts NVLink traffic in
                          flight (ai2cm/ace #1438); a rank stuck in a collective aborts first
                          (a sync would never return) and drains after. Release = abort NCCL
                          communicators, shut gloo connections down; no collective is issued.
4. ``save``             - only if this rank was ordered to and is quiescent, within its
                          budget, atomically; labelled with the step it parked at.
5. ``destroy_process_group`` - bounded, on a helper thread.
6. ``exit``             - the report is written (JSON file + one log line), then Ray's
                          intended-exit path (recorded INTENDED_SYSTEM_EXIT, status 0) where
                          the process is a Ray worker; a hard ``os._exit`` if that does not end
                          the process within ``exit_grace_s``.

Two watchdogs guard the deadline. A Python thread fires at ``deadline - watchdog_margin_s``,
writes the report (``os.write`` only, never ``logging``, whose lock a wedged thread may hold)
and exits; a kernel timer (``hard_deadline.py``) ends the process half a margin later, still
before the deadline, even when a thread blocked in C holds the GIL, or the interpreter is
finalizing, and no Python thread can run.
"""

from __future__ import annotations

import gc
import json
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from types import FrameType
from typing import Any, Protocol

from . import ray_adapter
from .checkpoint import ShardRecord, write_shard
from .config import GracefulConfig
from .hard_deadline import hard_deadline
from .process_groups import GroupHandle, release

LOG_PREFIX = "ray_graceful teardown "


@dataclass
class StepRecord:
    """One teardown step: what happened and when (seconds from the teardown's start)."""

    name: str
    status: str  # "ran" | "skipped" | "failed" | "running" | "interrupted"
    detail: str = ""
    started_s: float = 0.0
    duration_s: float = 0.0


@dataclass
class SaveOrder:
    """Save shard ``shard`` under ``root`` with ``saver``, within ``budget_s``.

    No step: the step is the one the training thread parked at (or last reported), read once
    it is quiescent - never when the order arrives, when the thread may still finish a step.
    """

    root: str
    shard: str
    budget_s: float
    saver: Callable[[str, int], tuple[int, int] | None]
    group: str = ""
    rank: int = -1


class TrainingThread(Protocol):
    """What the teardown needs to know of the thread that trains (see ``worker.py``)."""

    def state(self) -> str:
        """ "parked" (at should_stop), "idle" (left its loop), "in_collective" or "in_step"."""

    def step(self) -> int | None:
        """The step the thread parked at, else the last step boundary it reported."""


@dataclass
class TeardownReport:
    """What one process's teardown did; JSON in ``report_dir`` and one log line."""

    pid: int
    hostname: str
    node_id: str
    job_id: str
    ranks: list[dict[str, Any]]
    trigger: str
    cycle: int
    started_at: float
    deadline: float
    steps: list[StepRecord] = field(default_factory=list)
    saved: list[dict[str, Any]] = field(default_factory=list)
    last_step: int | None = None  # the last step boundary the training loop reported
    exit_path: str | None = None
    exit_code: int | None = None
    finished_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["steps"] = [asdict(s) for s in list(self.steps)]
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TeardownReport:
        values = dict(data)
        values["steps"] = [StepRecord(**s) for s in data.get("steps", [])]
        return cls(**values)

    def step(self, name: str) -> StepRecord:
        for record in self.steps:
            if record.name == name:
                return record
        raise KeyError(f"no step {name!r} in this report; steps: {[s.name for s in self.steps]}")

    def summary(self) -> str:
        ranks = ",".join(f"{r['group']}/{r['rank']}" for r in self.ranks) or "-"
        steps = " ".join(f"{s.name}={s.status}({s.duration_s * 1000:.0f}ms)" for s in self.steps)
        return f"pid={self.pid} ranks={ranks} trigger={self.trigger} {steps} exit={self.exit_path}"


class _Skip(Exception):
    """Raised by a step to record itself as skipped, with the reason."""


def run_bounded(fn: Callable[[], Any], timeout: float, name: str) -> Any:
    """Run ``fn`` on a daemon thread; return its result, re-raise its error, or TimeoutError."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = fn()
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=target, name=f"ray_graceful-{name}", daemon=True)
    thread.start()
    thread.join(max(timeout, 0.0))
    if thread.is_alive():
        raise TimeoutError(f"{name} still running after {timeout:.1f}s; left behind")
    if "error" in box:
        raise box["error"]
    return box.get("result")


def write_stderr(text: str) -> None:
    """Write to stderr with os.write: safe from any thread, whoever holds logging's lock."""
    try:
        os.write(2, text.encode(errors="replace"))
    except OSError:
        pass


def hard_exit(code: int, why: str) -> None:
    write_stderr(f"ray_graceful: hard exit ({why}), status {code}\n")
    os._exit(code)


def write_report_file(report: TeardownReport, report_dir: str) -> str | None:
    """Write the report JSON with os-level calls only (the watchdog uses this too)."""
    try:
        directory = os.path.join(report_dir, report.job_id or "no-job")
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"teardown-{report.hostname}-{report.pid}.json")
        tmp = f"{path}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, report.to_json().encode())
        finally:
            os.close(fd)
        os.replace(tmp, path)
        return path
    except OSError:
        return None


def read_reports(report_dir: str, job_id: str | None = None) -> list[TeardownReport]:
    """Every TeardownReport under ``report_dir`` (for one job, if given), oldest first."""
    reports = []
    roots = (
        [os.path.join(report_dir, job_id)]
        if job_id
        else [os.path.join(report_dir, d) for d in sorted(os.listdir(report_dir))]
        if os.path.isdir(report_dir)
        else []
    )
    for root in roots:
        if not os.path.isdir(root):
            continue
        for name in sorted(os.listdir(root)):
            if name.startswith("teardown-") and name.endswith(".json"):
                with open(os.path.join(root, name)) as f:
                    reports.append(TeardownReport.from_dict(json.load(f)))
    return sorted(reports, key=lambda r: r.started_at)


def ray_identity() -> dict[str, str]:
    """Job id and node id when running inside Ray, else empty strings."""
    try:
        import ray

        if ray.is_initialized():
            ctx = ray.get_runtime_context()
            return {"job_id": ctx.get_job_id() or "", "node_id": ctx.get_node_id() or ""}
    except Exception:
        pass
    return {"job_id": "", "node_id": ""}


def request_ray_intended_exit(detail: str) -> bool:
    """Take Ray's intended-exit path now; False where there is none."""
    exit_via_ray = ray_adapter.intended_exit()
    if exit_via_ray is None:
        return False
    try:
        exit_via_ray(detail)
    except Exception as exc:
        write_stderr(f"ray_graceful: Ray's intended exit failed: {exc!r}\n")
        return False
    return True


STUCK_IN_COLLECTIVE_S = 0.3
IN_COLLECTIVE_S = 0.05  # found inside a collective this long at quiesce: abort first


def _other_threads() -> list[tuple[str, FrameType]]:
    """(name, current frame) of every thread that is not one of ray_graceful's own."""
    names = {t.ident: t.name for t in threading.enumerate()}
    threads = [(names.get(i, str(i)), frame) for i, frame in sys._current_frames().items()]
    return [(name, frame) for name, frame in threads if not name.startswith("ray_graceful-")]


def thread_in_collective() -> bool:
    """Whether a thread other than ours is inside a ``torch.distributed`` call right now."""
    marker = os.path.join("torch", "distributed", "")
    return any(marker in frame.f_code.co_filename for _name, frame in _other_threads())


def _busy_threads() -> str:
    """Where each non-ray_graceful thread is, innermost frame first: what held the exit."""
    where = []
    for name, frame in _other_threads():
        stack = traceback.extract_stack(frame)[-3:]
        where.append(
            f"{name} at "
            + " <- ".join(
                f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(stack)
            )
        )
    return "; ".join(where) or "no other thread"


class Teardown:
    """One process's teardown. ``start()`` runs it on its own thread; it never returns there."""

    def __init__(
        self,
        config: GracefulConfig,
        groups: list[GroupHandle],
        trigger: str,
        deadline: float,
        cycle: int = 0,
        save_orders: list[SaveOrder] | None = None,
        skip_save_reason: str = "",
        on_stop: Callable[[], None] | None = None,
        on_report: Callable[[TeardownReport], None] | None = None,
        training: TrainingThread | None = None,
        exit_process: bool = True,
    ) -> None:
        self.config = config
        self.groups = groups
        self.save_orders = list(save_orders or [])
        self.skip_save_reason = skip_save_reason
        self.on_stop = on_stop
        self.on_report = on_report
        self.training = training
        self.exit_process = exit_process
        self.quiescent = training is None  # no loop registered: nothing to wait for
        # Set once the training thread may leave should_stop (parked there until the save).
        self.training_released = threading.Event()
        self.t0 = time.monotonic()
        self.deadline_monotonic = self.t0 + max(deadline - time.time(), 0.0)
        identity = ray_identity()
        self.report = TeardownReport(
            pid=os.getpid(),
            hostname=socket.gethostname(),
            node_id=identity["node_id"],
            job_id=identity["job_id"],
            ranks=[{"group": g.name, "rank": g.rank, "world_size": g.world_size} for g in groups],
            trigger=trigger,
            cycle=cycle,
            started_at=time.time(),
            deadline=deadline,
        )
        self.done = threading.Event()
        self._abandon_save = threading.Event()

    # --- time ------------------------------------------------------------------------------

    def remaining(self) -> float:
        """Seconds left before the watchdog fires."""
        return self.deadline_monotonic - self.config.watchdog_margin_s - time.monotonic()

    # --- running ---------------------------------------------------------------------------

    def start(self) -> threading.Thread:
        if self.exit_process:
            # Half the watchdog's margin before the deadline: the Python watchdog fires first
            # and writes the report; this one ends the process where no Python thread can run
            # (a GIL held in C, or the interpreter finalizing during Ray's exit).
            at = self.deadline_monotonic - self.config.watchdog_margin_s / 2
            hard_deadline().arm(at, self.config.exit_code)
        threading.Thread(target=self._watchdog, name="ray_graceful-watchdog", daemon=True).start()
        thread = threading.Thread(target=self.run, name="ray_graceful-teardown", daemon=True)
        thread.start()
        return thread

    def run(self) -> TeardownReport:
        self._step("stop", self._stop)
        self._step("quiesce", self._quiesce)
        if self.quiescent:  # at a step boundary: let the device finish, then abort
            self._step("drain_device", self._drain_device)
            self._step("release_peers", self._release_peers)
        else:  # inside a collective: a sync would never return, so abort first
            self._step("release_peers", self._release_peers)
            self._step("drain_device", self._drain_device)
        try:
            self._step("save", self._save)
        finally:
            self.training_released.set()
        self._step("destroy_process_group", self._destroy)
        self._finish()
        return self.report

    def _step(self, name: str, fn: Callable[[], str]) -> None:
        record = StepRecord(name, "running", started_s=time.monotonic() - self.t0)
        self.report.steps.append(record)
        try:
            record.detail = fn() or ""
            record.status = "ran"
        except _Skip as skip:
            record.status, record.detail = "skipped", str(skip)
        except BaseException as exc:
            record.status, record.detail = "failed", f"{type(exc).__name__}: {exc}"
        record.duration_s = time.monotonic() - self.t0 - record.started_s

    def _stop(self) -> str:
        if self.on_stop is not None:
            self.on_stop()
        return "should_stop() is now true"

    def _release_peers(self) -> str:
        if not self.groups:
            raise _Skip("no process group registered")
        done, errors = [], []
        for group in self.groups:
            try:
                done.extend(release(group))
            except Exception as exc:
                errors.append(f"{group.name}: {type(exc).__name__}: {exc}")
        if errors:
            raise RuntimeError("; ".join(errors + done))
        return "; ".join(done)

    def _drain_device(self) -> str:
        try:
            import torch
        except ImportError:
            raise _Skip("torch not importable") from None
        if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
            raise _Skip("CUDA not in use in this process")
        timeout = min(self.config.cuda_sync_timeout_s, max(self.remaining(), 0.0))
        run_bounded(torch.cuda.synchronize, timeout, "cuda-synchronize")
        return "torch.cuda.synchronize() returned"

    def _wait_for_boundary(self, limit: float) -> str:
        """Poll the training thread until it is at a boundary, in a collective, or ``limit``."""
        assert self.training is not None
        started = time.monotonic()
        in_collective_since: float | None = None
        while True:
            state = self.training.state()
            now = time.monotonic()
            if state in ("parked", "idle"):
                return state
            if state == "in_collective":
                in_collective_since = in_collective_since or now
                if now - in_collective_since >= IN_COLLECTIVE_S:
                    return state
            else:
                in_collective_since = None
            if now - started >= limit:
                return state
            time.sleep(0.002)

    def _quiesce(self) -> str:
        """Reach the training thread's step boundary, bounded; a save never starts mid-step."""
        if self.training is None:
            raise _Skip("no training loop registered")
        started = time.monotonic()
        limit = min(self.config.quiesce_timeout_s, max(self.remaining(), 0.0))
        state = self._wait_for_boundary(limit)
        waited_ms = (time.monotonic() - started) * 1000
        self.quiescent = state in ("parked", "idle")
        step = self.training.step()
        if state == "parked":
            return f"training thread parked at should_stop({step}) after {waited_ms:.0f}ms"
        if state == "idle":
            return f"training thread outside its step (last step {step}) after {waited_ms:.0f}ms"
        if state == "in_collective":
            return (
                f"training thread inside a collective after {waited_ms:.0f}ms: peers are "
                "released first"
            )
        return f"training thread still inside its step after {waited_ms:.0f}ms"

    def _await_quiescent_after_release(self) -> None:
        """After the release a thread that was in a collective leaves it (with an error)."""
        if self.quiescent or self.training is None:
            return
        limit = min(self.config.quiesce_timeout_s, max(self.remaining(), 0.0))
        state = self._wait_for_boundary(limit)
        if state not in ("parked", "idle"):
            raise RuntimeError(
                f"the training thread was still inside its step {limit:.1f}s after the peers "
                "were released (not at should_stop, not out of its loop): a save now could "
                f"capture a half-applied update, so none was started ({_busy_threads()})"
            )
        self.quiescent = True

    def _save(self) -> str:
        if not self.save_orders:
            raise _Skip(self.skip_save_reason or "not ordered to save")
        self._await_quiescent_after_release()
        step = self.training.step() if self.training is not None else None
        if step is None:
            raise _Skip(
                "no step boundary recorded: call should_stop(step) in the training loop, so a "
                "checkpoint can be labelled with the step it holds"
            )
        self.report.last_step = step
        done = [f"state of step {step}"]
        for order in self.save_orders:
            budget = min(order.budget_s, self.remaining() - self.config.destroy_timeout_s)
            if budget <= 0:
                raise RuntimeError(
                    f"no time left before the deadline to save shard {order.shard!r} "
                    f"({'; '.join(done)})"
                )

            def save(order: SaveOrder = order) -> ShardRecord:
                return write_shard(
                    order.root,
                    step,
                    order.shard,
                    order.saver,
                    abandoned=self._abandon_save,
                    group=order.group,
                    rank=order.rank,
                )

            try:
                record: ShardRecord = run_bounded(save, budget, "emergency-save")
            except TimeoutError:
                self._abandon_save.set()
                raise TimeoutError(
                    f"save of shard {order.shard!r} exceeded its budget of {budget:.1f}s; "
                    "abandoned, never renamed into place"
                ) from None
            self.report.saved.append(record.to_dict())
            done.append(
                f"shard {order.shard!r}: {record.bytes} bytes in {record.seconds:.2f}s"
                + (" (already committed: kept, not rewritten)" if record.reused else "")
            )
        return "; ".join(done)

    def _destroy(self) -> str:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise _Skip("no default process group")
        timeout = min(self.config.destroy_timeout_s, max(self.remaining(), 0.0))
        run_bounded(dist.destroy_process_group, timeout, "destroy-process-group")
        return "destroy_process_group() returned"

    # --- ending ----------------------------------------------------------------------------

    def _publish(self) -> None:
        self.report.finished_s = time.monotonic() - self.t0
        path = write_report_file(self.report, self.config.report_dir)
        write_stderr(f"{LOG_PREFIX}{self.report.to_json()}\n")
        if path is None:
            write_stderr(
                f"ray_graceful: could not write the report under {self.config.report_dir}\n"
            )
        if self.on_report is not None:
            try:
                self.on_report(self.report)
            except Exception as exc:
                write_stderr(f"ray_graceful: could not deliver the report: {exc!r}\n")

    def _finish(self) -> None:
        record = StepRecord("exit", "running", started_s=time.monotonic() - self.t0)
        self.report.steps.append(record)
        if not self.exit_process:
            record.status, record.detail = "skipped", "exit_process=False"
            self._publish()
            self.done.set()
            return
        exit_via_ray = ray_adapter.intended_exit()
        in_ray = exit_via_ray is not None
        self.report.exit_path = "ray_intended" if in_ray else "hard"
        self.report.exit_code = 0 if in_ray else self.config.exit_code
        record.status = "ran"
        record.detail = (
            "Ray's intended exit requested" if in_ray else f"os._exit({self.config.exit_code})"
        )
        # Report first: once Ray's exit is requested, no Ray call may follow.
        self._publish()
        self.done.set()
        if exit_via_ray is not None:
            # A reference cycle that holds an ObjectRef (a failed ray.get's traceback, say) and
            # is only collected after Ray's core worker shut down makes the process exit with
            # status 1 ("accesses the Ray's worker after it is shutdown"): collect it now.
            gc.collect()
            try:
                exit_via_ray(f"ray_graceful teardown ({self.report.trigger})")
            except Exception as exc:
                write_stderr(f"ray_graceful: Ray's intended exit failed: {exc!r}\n")
            waited = self._wait_for_intended_exit()
            self.report.exit_path, self.report.exit_code = "hard", self.config.exit_code
            record.detail += (
                f"; the process was still alive after {waited:.2f}s "
                f"(a task had not returned: {_busy_threads()}), so os._exit"
            )
            write_report_file(self.report, self.config.report_dir)
            hard_exit(self.config.exit_code, "Ray's intended exit did not end the process in time")
        hard_exit(self.config.exit_code, "teardown finished outside a Ray worker")

    def _wait_for_intended_exit(self) -> float:
        """Give Ray's exit up to ``exit_grace_s`` to end the process; returns the time waited.

        Ray's exit waits for the running task to return. A task still inside a collective
        ``STUCK_IN_COLLECTIVE_S`` after the peers were released will not return (gloo can miss
        a shut-down connection while a send is queued), so waiting longer only costs time.
        """
        started = time.monotonic()
        limit = max(min(self.config.exit_grace_s, self.remaining()), 0.0)
        released = any(r.name == "release_peers" and r.status == "ran" for r in self.report.steps)
        stuck_since: float | None = None
        while (waited := time.monotonic() - started) < limit:
            if released and thread_in_collective():
                stuck_since = stuck_since or time.monotonic()
                if time.monotonic() - stuck_since >= STUCK_IN_COLLECTIVE_S:
                    break
            else:
                stuck_since = None
            time.sleep(0.02)
        return waited

    def _watchdog(self) -> None:
        delay = self.remaining()
        if self.done.wait(timeout=max(delay, 0.0)) and not self.exit_process:
            return
        if self.done.is_set():
            # The report is out and an exit is under way; the watchdog stays the last word.
            time.sleep(max(self.remaining(), 0.0))
        for record in self.report.steps:
            if record.status == "running":
                record.status = "interrupted"
                record.detail = "the watchdog fired at the deadline"
                record.duration_s = time.monotonic() - self.t0 - record.started_s
        self.report.exit_path, self.report.exit_code = "watchdog", self.config.exit_code
        self.report.finished_s = time.monotonic() - self.t0
        write_report_file(self.report, self.config.report_dir)
        write_stderr(f"{LOG_PREFIX}{self.report.to_json()}\n")
        hard_exit(self.config.exit_code, "watchdog: deadline reached")
