"""The ordered, guarded, timed phases that end a rank, and the report they leave.

Order, each phase wrapped so that a half-broken rank still does the half that
works, and each recorded in the ``TeardownReport`` as ran / skipped (with the reason) / failed
(with the error), with its start and duration:

1. ``stop``             - ``should_stop()`` turns true; the coordinator is told.
2. ``quiesce``          - wait (bounded) for the training thread to reach its step boundary:
                          ``should_stop(step)`` *parks* it there until the save is done, so the
                          state saved is exactly the state of ``step``. A thread found inside a
                          collective is given ``IN_COLLECTIVE_S`` to finish it, no more: a
                          collective whose peer is gone never returns. None at all when the
                          order says nobody of the cycle saves or rejoins (no boundary needed).
3. ``drain_device`` and ``release_peers``, in the safe order: a rank parked at its boundary
                          drains the device first (its queue polled through an event, bounded)
                          and then aborts its communicators, so no abort cuts NVLink traffic in
                          flight (ai2cm/ace #1438); a rank stuck in a collective aborts first
                          (a sync would never return) and drains after. A parked rank whose
                          queue does not drain (the host ran ahead into a collective a departed
                          peer never joins) is released anyway and saves nothing. Release =
                          abort every NCCL communicator at once, shut gloo connections down; no
                          collective is issued.
4. ``save``             - only if this rank was ordered to and is quiescent: its own shards,
                          then those it backs up (``emergency_save.py``), labelled with the
                          step the training thread parked at.
5. ``destroy_process_group`` - bounded, on a helper thread.
6. ``exit``             - the report is written (JSON file + one log line), then Ray's
                          intended-exit path (recorded INTENDED_SYSTEM_EXIT, status 0) where
                          the process is a Ray worker. Where a task cannot return (a thread
                          still inside a collective after the release), Ray kills the actor
                          instead (recorded INTENDED_SYSTEM_EXIT too, status 1); a hard
                          ``os._exit`` only if neither ends the process.

Two watchdogs guard the deadline. A Python thread fires at ``deadline - watchdog_margin_s``,
writes the report (``os.write`` only, never ``logging``, whose lock a wedged thread may hold)
and exits; a kernel timer (``hard_deadline.py``) ends the process half a margin later, still
before the deadline, even when a thread blocked in C holds the GIL, or the interpreter is
finalizing, and no Python thread can run.
"""

from __future__ import annotations

import gc
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Protocol

from .. import ray_adapter
from ..bounded import wait_until
from ..config import GracefulConfig
from ..protocol import PhaseStatus, ReportedRank, TeardownPhase
from .device import device_queue_finished
from .emergency_save import EmergencySave, ShardSave
from .exit_path import hard_exit, leave_without_finalization, skip_finalization, write_stderr
from .hard_deadline import hard_deadline
from .late_copy import LateCopies
from .process_groups import GroupHandle, release_all
from .report_file import (
    LOG_PREFIX,
    PhaseRecord,
    Skip,
    TeardownReport,
    ray_identity,
    write_report_file,
)
from .stop_step import Position, agree, all_parked
from .threads import ThreadAt, busy_threads, run_bounded, thread_in_collective


class TrainingThread(Protocol):
    """What the teardown needs to know of the thread that trains (``training_loop.py``)."""

    def state(self) -> ThreadAt:
        """Where the thread is: at should_stop, out of its loop, in a collective, in its step."""

    def step(self) -> int | None:
        """The step the thread parked at, else the last step boundary it reported."""


# Still inside a collective this long after its peers were released: gloo's queued-send race,
# which nothing wakes. Measured from the release to the thread leaving its collective: 3-6 ms
# in the test suite, 16-130 ms with 16 ranks tearing down at once on two cores.
STUCK_IN_COLLECTIVE_S = 0.2
FORCED_EXIT_WAIT_S = 2.0  # Ray's forced intended exit may take this long; then exit hard
# An evicted Ray Train worker's training function waits in ``carry_on`` for the teardown, and
# raises within milliseconds of its end; one that has not by then is stuck elsewhere.
TRAIN_FN_RAISES_WITHIN_S = 2.0
# Found inside a collective this long at quiesce: release first. A healthy step's collective
# that ends within it still parks at the boundary, where the rank can save (20 ms was tried:
# 10 ms off an N=8 release's p50, and a saver released mid-step lost its save under load).
IN_COLLECTIVE_S = 0.05


class Teardown:
    """One process's teardown. ``start()`` runs it on its own thread; it never returns there."""

    def __init__(
        self,
        config: GracefulConfig,
        groups: list[GroupHandle],
        trigger: str,
        deadline: float,
        cycle: int = 0,
        save_orders: list[ShardSave] | None = None,
        skip_save_reason: str = "",
        on_stop: Callable[[], None] | None = None,
        on_report: Callable[[TeardownReport], None] | None = None,
        on_saved: Callable[[list[str], list[str], str], None] | None = None,
        training: TrainingThread | None = None,
        exit_process: bool = True,
        boundary_needed: bool = True,
        late: LateCopies | None = None,
        train_ends_it: bool = False,
        agree_in: list[GroupHandle] | None = None,
    ) -> None:
        self.config = config
        self.late = late  # an earlier cycle's held shards, still on their way: finished first
        self.groups = groups
        self.skip_save_reason = skip_save_reason
        self.on_stop = on_stop
        self.on_report = on_report
        self.training = training
        self.exit_process = exit_process
        # Under Ray Train's replica groups the evicted worker's process is Train's to end: its
        # training function raises out of ``carry_on`` once this is done (``train_fn_raised``),
        # and Train replaces its group and kills it. Its own exit while Train replaced another
        # worker's group failed Train's controller (an ActorDiedError there is not retried).
        self.train_ends_it = train_ends_it and exit_process
        self.train_fn_raised = threading.Event()
        # How long a collective the thread is found in may take to finish at quiesce: none
        # when the coordinator says nobody of the cycle needs a step boundary.
        self.in_collective_s = IN_COLLECTIVE_S if boundary_needed else 0.0
        self.quiescent = training is None  # no loop registered: nothing to wait for
        # The step this rank's state provably is: the thread is held inside should_stop(step).
        # A thread found outside its loop may have left it by an exception from a collective a
        # peer's release broke, its update half-applied: not proof (warm restart: such a rank
        # loads the committed step instead of trusting its own state).
        self.clean_step: int | None = None
        self.device_behind = False  # the drain found work of the parked step not yet run
        # Set once the training thread may leave should_stop (parked there until the save).
        self.training_released = threading.Event()
        # The groups whose ranks agree on the step they stop at before anyone is released
        # (``stop_step.py``; the order's ``agree_stop_step``), the step agreed, and the
        # condition a parked thread waits on: released, or told to run on to that step.
        self.agree_in = list(agree_in or []) if training is not None else []
        self.stop_step: int | None = None
        self._training_moves = threading.Condition()
        self.released_at: float | None = None  # monotonic, once release_peers ran
        self.t0 = time.monotonic()
        self.deadline_monotonic = self.t0 + max(deadline - time.time(), 0.0)
        identity = ray_identity()
        self.cycle = cycle
        self.report = TeardownReport(
            pid=os.getpid(),
            hostname=socket.gethostname(),
            node_id=identity["node_id"],
            job_id=identity["job_id"],
            ranks=[ReportedRank(g.name, g.rank, g.world_size) for g in groups],
            trigger=trigger,
            cycle=cycle,
            started_at=time.time(),
            deadline=deadline,
        )
        self.done = threading.Event()
        until = self.deadline_monotonic - config.watchdog_margin_s
        self.saving = EmergencySave(
            config, list(save_orders or []), until, cycle=cycle, on_saved=on_saved
        )

    # --- time ------------------------------------------------------------------------------

    def remaining(self) -> float:
        """Seconds left before the watchdog fires."""
        return self.saving.remaining()

    # --- the training thread's boundary ----------------------------------------------------

    def runs_on_past(self, step: int) -> bool:
        """The group agreed to stop at a later step than ``step``: train on to it."""
        stop = self.stop_step
        return stop is not None and step < stop and not self.training_released.is_set()

    def hold_at(self, step: int) -> bool:
        """Hold the training thread parked at ``step`` until the save is done (True), or until
        the group agreed on a later step (False: train on). Bounded by the deadline."""
        with self._training_moves:
            self._training_moves.wait_for(
                lambda: self.training_released.is_set() or self.runs_on_past(step),
                timeout=max(self.remaining(), 0.0) + 1.0,
            )
            return not self.runs_on_past(step)

    def _let_training_go(self) -> None:
        with self._training_moves:
            self.training_released.set()
            self._training_moves.notify_all()

    def _run_on_to(self, step: int) -> None:
        with self._training_moves:
            self.stop_step = step
            self._training_moves.notify_all()

    # --- running ---------------------------------------------------------------------------

    def start(self, then: Callable[[], None] | None = None) -> threading.Thread:
        """Run the teardown on a thread of its own, and its watchdog on another. ``then`` (a
        survivor's ask to rejoin) runs on the watchdog's thread once the teardown ended within
        its deadline: that thread has nothing left to watch then, and a teardown that overran
        ends the process instead."""
        if self.exit_process:
            # Half the watchdog's margin before the deadline: the Python watchdog fires first
            # and writes the report; this one ends the process where no Python thread can run
            # (a GIL held in C, or the interpreter finalizing during Ray's exit).
            at = self.deadline_monotonic - self.config.watchdog_margin_s / 2
            hard_deadline().arm(at, self.config.exit_code)
        threading.Thread(
            target=self._watchdog, args=(then,), name="ray_graceful-watchdog", daemon=True
        ).start()
        thread = threading.Thread(target=self.run, name="ray_graceful-teardown", daemon=True)
        thread.start()
        return thread

    def run(self) -> TeardownReport:
        self._phase(TeardownPhase.STOP, self._stop)
        self._phase(TeardownPhase.QUIESCE, self._quiesce)
        if self.quiescent:  # at a step boundary: let the device finish, then abort
            self._phase(TeardownPhase.DRAIN_DEVICE, self._drain_device)
            self._phase(TeardownPhase.RELEASE_PEERS, self._release_peers)
        else:  # inside a collective: a sync would never return, so abort first
            self._phase(TeardownPhase.RELEASE_PEERS, self._release_peers)
            self._phase(TeardownPhase.DRAIN_DEVICE, self._drain_device)
        try:
            self._phase(TeardownPhase.SAVE, self._save)
        finally:
            self.report.saved = list(self.saving.saved)
            self._let_training_go()
            self.saving.tell_saved(self._how_the_save_went())
        self._phase(TeardownPhase.DESTROY_PROCESS_GROUP, self._destroy)
        self._finish()
        return self.report

    def _phase(self, name: TeardownPhase, fn: Callable[[], str]) -> None:
        record = PhaseRecord(name, PhaseStatus.RUNNING, started_s=time.monotonic() - self.t0)
        self.report.phases.append(record)
        try:
            record.detail = fn() or ""
            record.status = PhaseStatus.RAN
        except Skip as skip:
            record.status, record.detail = PhaseStatus.SKIPPED, str(skip)
        except BaseException as exc:
            record.status, record.detail = PhaseStatus.FAILED, f"{type(exc).__name__}: {exc}"
        record.duration_s = time.monotonic() - self.t0 - record.started_s

    def _stop(self) -> str:
        if self.on_stop is not None:
            self.on_stop()
        return "should_stop() is now true"

    def _release_peers(self) -> str:
        if not self.groups:
            raise Skip("no process group registered")
        done = release_all(self.groups)  # every group's communicators aborted at once
        self.released_at = time.monotonic()
        return "; ".join(done)

    def _drain_device(self) -> str:
        try:
            import torch
        except ImportError:
            raise Skip("torch not importable") from None
        if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
            raise Skip("CUDA not in use in this process")
        timeout = min(self.config.cuda_sync_timeout_s, max(self.remaining(), 0.0))
        if device_queue_finished(torch, timeout):
            return "the device's queued work finished"
        # The queue holds a collective a peer that left will never join: the host ran ahead of
        # the device (NCCL returns at enqueue), so the thread parked at a step whose work has not
        # run. Its state is not that step; the release ends the collective, and nothing is saved.
        self.clean_step = self.report.parked_at = None
        self.device_behind = True
        raise TimeoutError(
            f"the device's queued work had not finished after {timeout:.1f}s (a collective "
            "waiting for a peer that left): released without it, and this rank's state is not "
            "the step it parked at"
        )

    def _wait_for_boundary(self, limit: float) -> ThreadAt:
        """Poll the training thread until it is at a boundary, in a collective for
        ``in_collective_s`` (its peers must be released first), or ``limit``."""
        assert self.training is not None
        training = self.training
        in_collective_since: float | None = None

        def settled() -> ThreadAt | None:
            nonlocal in_collective_since
            state = ThreadAt(training.state())
            if state.at_boundary:
                return state
            if state is not ThreadAt.IN_COLLECTIVE:
                in_collective_since = None
                return None
            in_collective_since = in_collective_since or time.monotonic()
            return state if time.monotonic() - in_collective_since >= self.in_collective_s else None

        return wait_until(settled, limit, every=0.002) or ThreadAt(training.state())

    def _quiesce(self) -> str:
        """Reach the training thread's step boundary, bounded; a save never starts mid-step."""
        if self.training is None:
            raise Skip("no training loop registered")
        started = time.monotonic()
        limit = min(self.config.quiesce_timeout_s, max(self.remaining(), 0.0))
        state = self._wait_for_boundary(limit)
        agreed = ""
        if self.agree_in:  # within the same bound: the agreement is part of reaching a boundary
            state, how = self._agree_on_the_stop_step(state, started + limit)
            agreed = f" ({how})"
        waited_ms = (time.monotonic() - started) * 1000
        self.quiescent = state.at_boundary
        step = self.training.step()
        self.clean_step = step if state is ThreadAt.PARKED else None
        self.report.parked_at = self.clean_step
        if state is ThreadAt.PARKED:
            return f"training thread parked at should_stop({step}) after {waited_ms:.0f}ms{agreed}"
        if state is ThreadAt.IDLE:
            return (
                f"training thread outside its step (last step {step}) after {waited_ms:.0f}ms"
                f"{agreed}"
            )
        if state is ThreadAt.IN_COLLECTIVE:
            return (
                f"training thread inside a collective after {waited_ms:.0f}ms: peers are "
                f"released first{agreed}"
            )
        return f"training thread still inside its step after {waited_ms:.0f}ms{agreed}"

    def _agree_on_the_stop_step(self, state: ThreadAt, until: float) -> tuple[ThreadAt, str]:
        """Agree with every peer on the step all stop at, and reach it (``stop_step.py``): a
        rank parked below it trains on to it, one inside the step before it finishes that
        step. Where they agree, no rank is released from inside its step; where they do not
        (a peer that never said, one out of its loop below the step), nothing changed."""
        assert self.training is not None
        training = self.training
        last = training.step()
        if last is None:
            return state, "no step boundary recorded to agree on"
        if state is ThreadAt.PARKED:
            position = Position(last, can_run_on=True)
        elif state is ThreadAt.IDLE:
            position = Position(last, can_run_on=False)
        else:  # inside the step after ``last``: it stops at the next boundary at the earliest
            position = Position(last + 1, can_run_on=True)
        agreed, how = agree(self.agree_in, self.cycle, position, until - time.monotonic())
        if agreed is None:
            return state, how
        if not (state is ThreadAt.PARKED and agreed == last):
            self._run_on_to(agreed)

            def reached() -> ThreadAt | None:
                now = ThreadAt(training.state())
                parked_there = now is ThreadAt.PARKED and (training.step() or 0) >= agreed
                return now if parked_there or now is ThreadAt.IDLE else None

            settled = wait_until(reached, until - time.monotonic(), every=0.002)
            state = settled or ThreadAt(training.state())
        parked_there = state is ThreadAt.PARKED and (training.step() or 0) >= agreed
        if parked_there or state is ThreadAt.IDLE:  # in no collective now
            how += f"; {all_parked(self.agree_in, self.cycle, until - time.monotonic())}"
        return state, how

    def _await_quiescent_after_release(self) -> None:
        """After the release a thread that was in a collective leaves it (with an error)."""
        if self.quiescent or self.training is None:
            return
        limit = min(self.config.quiesce_timeout_s, max(self.remaining(), 0.0))
        if not self._wait_for_boundary(limit).at_boundary:
            raise RuntimeError(
                f"the training thread was still inside its step {limit:.1f}s after the peers "
                "were released (not at should_stop, not out of its loop): a save now could "
                f"capture a half-applied update, so none was started ({busy_threads()})"
            )
        self.quiescent = True

    def _save(self) -> str:
        if not self.saving.orders:
            raise Skip(self.skip_save_reason or "not ordered to save")
        self._await_quiescent_after_release()
        if self.device_behind:
            raise RuntimeError(
                "the device had not run the work of the step the training thread parked at when "
                "its communicators were aborted: that state is not a step, so none was saved"
            )
        step = self.training.step() if self.training is not None else None
        if step is None:
            raise Skip(
                "no step boundary recorded: call should_stop(step) in the training loop, so a "
                "checkpoint can be labelled with the step it holds"
            )
        self.report.last_step = step
        # Only a rank that provably is that step trains on from its own state (rejoin.py): one
        # that is not must load its shard back, so it is saved now, not held.
        return self.saving.run(step, may_hold=self.clean_step == step)

    def _how_the_save_went(self) -> str:
        try:
            record = self.report.phase(TeardownPhase.SAVE)
        except KeyError:
            return "no save phase ran"
        return f"save {record.status}: {record.detail}"[:300]

    def _destroy(self) -> str:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise Skip("no default process group")
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

    def _finish_late_copy(self) -> None:
        """A held step of an earlier cycle whose copy is still running: this process may be
        its last holder. Finished within what is left before the watchdog."""
        if not self.exit_process or self.late is None or not self.late.pending():
            return
        left = self.remaining() - self.config.watchdog_margin_s
        if not self.late.finish(max(left, 0.0)):
            write_stderr("ray_graceful: leaving with a held shard's copy unfinished\n")

    def _left_to_train(self, record: PhaseRecord) -> bool:
        """Ray Train ends this process: published as such, then ``done`` - the training
        function, waiting in ``carry_on``, raises. The watchdog stays the backstop at the
        deadline. A function that does not raise within ``TRAIN_FN_RAISES_WITHIN_S`` (stuck
        outside ``carry_on``) leaves Train nothing to see: this process exits as any other."""
        record.status, record.duration_s = PhaseStatus.RAN, 0.0
        record.detail = "left to Ray Train: the training function raises, Train ends the process"
        self.report.exit_path, self.report.exit_code = "ray_train", 0
        self._publish()
        self.done.set()
        if self.train_fn_raised.wait(TRAIN_FN_RAISES_WITHIN_S):
            return True
        record.detail += f"; it did not raise within {TRAIN_FN_RAISES_WITHIN_S:.0f}s"
        write_stderr("ray_graceful: the training function did not raise: the worker exits\n")
        return False

    def _finish(self) -> None:
        record = PhaseRecord(
            TeardownPhase.EXIT, PhaseStatus.RUNNING, started_s=time.monotonic() - self.t0
        )
        self.report.phases.append(record)
        self._finish_late_copy()
        if not self.exit_process:
            record.status, record.detail = PhaseStatus.SKIPPED, "exit_process=False"
            self._publish()
            self.done.set()
            return
        published = self.train_ends_it
        if published and self._left_to_train(record):
            return
        exit_via_ray = ray_adapter.intended_exit()
        in_ray = exit_via_ray is not None
        self.report.exit_path = "ray_intended" if in_ray else "hard"
        self.report.exit_code = 0 if in_ray else self.config.exit_code
        record.status = PhaseStatus.RAN
        record.detail = (record.detail + "; " if published else "") + (
            "Ray's intended exit requested" if in_ray else f"os._exit({self.config.exit_code})"
        )
        # Report first: once Ray's exit is requested, no Ray call may follow.
        if published:  # left to Train, which saw nothing: its file says how it ended instead
            write_report_file(self.report, self.config.report_dir)
        else:
            self._publish()
            self.done.set()
        if exit_via_ray is not None:
            self._exit_through_ray(exit_via_ray, record)
        hard_exit(self.config.exit_code, "teardown finished outside a Ray worker")

    def _exit_through_ray(self, exit_via_ray: Callable[[str], None], record: PhaseRecord) -> None:
        """Ray's intended exit; Ray's kill of the actor if a task still has not returned after
        ``exit_grace_s``; ``os._exit`` if neither ended the process."""
        # A reference cycle that holds an ObjectRef (a failed ray.get's traceback, say) and is
        # only collected after Ray's core worker shut down makes the process exit with status 1
        # ("accesses the Ray's worker after it is shutdown"). gc.freeze() puts every object
        # where no later collection looks - in O(1), where gc.collect() over a heavy import
        # graph takes seconds - and the finalization that would collect them is skipped.
        gc.freeze()
        skip_finalization(0)
        ray_stopped = ray_adapter.core_worker_stopped_check()
        try:
            exit_via_ray(f"ray_graceful teardown ({self.report.trigger})")
        except Exception as exc:
            write_stderr(f"ray_graceful: Ray's intended exit failed: {exc!r}\n")
        waited, stuck_s = self._wait_for_intended_exit(ray_stopped)
        why = (
            f"; the process was still alive after {waited:.2f}s "
            f"(a task had not returned: {busy_threads()})"
        )
        if stuck_s is not None:
            why += f", its thread still in a collective {stuck_s:.2f}s after the release"
        force = ray_adapter.forced_intended_exit()
        if force is not None:
            # Ray kills the actor from its IO thread: recorded INTENDED_SYSTEM_EXIT (status 1,
            # Ray's QuickExit) instead of the crash an os._exit is recorded as.
            self.report.exit_path, self.report.exit_code = "ray_kill", 1
            record.detail += f"{why}, so Ray killed the actor"
            write_report_file(self.report, self.config.report_dir)
            try:
                force()
                time.sleep(FORCED_EXIT_WAIT_S)
            except Exception as exc:
                write_stderr(f"ray_graceful: Ray could not kill the actor: {exc!r}\n")
            why = f"; Ray's kill had not ended it after {FORCED_EXIT_WAIT_S:.0f}s"
        self.report.exit_path, self.report.exit_code = "hard", self.config.exit_code
        record.detail += f"{why}, so os._exit"
        write_report_file(self.report, self.config.report_dir)
        hard_exit(self.config.exit_code, "Ray's intended exit did not end the process in time")

    def _wait_for_intended_exit(
        self, ray_stopped: Callable[[], bool] | None = None
    ) -> tuple[float, float | None]:
        """Give Ray's exit up to ``exit_grace_s`` to end the process.

        Once Ray's core worker has shut down (``ray_stopped``), the process leaves at once,
        status 0: the raylet holds the intended exit, and what Ray's destructor still does -
        joining gRPC poll threads that wake every 250 ms - only keeps a finished process alive.

        Ray's exit waits for the running task to return. A task still inside a collective
        ``STUCK_IN_COLLECTIVE_S`` after the peers were released will not return (gloo can miss
        a shut-down connection while a send is queued), so waiting longer only costs time. The
        time counts from the release, not from this wait: a saver that released its peers
        seconds ago is not made to wait again. Returns the time waited, and how long after the
        release the thread was found stuck (None when it was not).
        """
        started = time.monotonic()
        limit = max(min(self.config.exit_grace_s, self.remaining()), 0.0)
        stuck_since: float | None = None
        while (waited := time.monotonic() - started) < limit:
            if ray_stopped is not None and ray_stopped():
                leave_without_finalization(0)
            if self.released_at is not None and thread_in_collective():
                stuck_since = stuck_since or self.released_at
                if (stuck_s := time.monotonic() - stuck_since) >= STUCK_IN_COLLECTIVE_S:
                    return waited, stuck_s
            else:
                stuck_since = time.monotonic()  # out of it since: a new collective counts anew
            time.sleep(0.02)
        return waited, None

    def _watchdog(self, then: Callable[[], None] | None = None) -> None:
        delay = self.remaining()
        if self.done.wait(timeout=max(delay, 0.0)) and not self.exit_process:
            if then is not None:
                then()
            return
        if self.done.is_set():
            # The report is out and an exit is under way; the watchdog stays the last word.
            time.sleep(max(self.remaining(), 0.0))
        for record in self.report.phases:
            if record.status == PhaseStatus.RUNNING:
                record.status = PhaseStatus.INTERRUPTED
                record.detail = "the watchdog fired at the deadline"
                record.duration_s = time.monotonic() - self.t0 - record.started_s
        self.report.exit_path, self.report.exit_code = "watchdog", self.config.exit_code
        self.report.saved = list(self.saving.saved)
        self.report.finished_s = time.monotonic() - self.t0
        write_report_file(self.report, self.config.report_dir)
        write_stderr(f"{LOG_PREFIX}{self.report.to_json()}\n")
        hard_exit(self.config.exit_code, "watchdog: deadline reached")
