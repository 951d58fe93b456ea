"""What each of the cycle machine's decisions does in the world: the coordinator's hands.

The machine (``machine.py``) decides and writes the coordinator's state; the actor
(``actor.py``) turns each call into an event and hands every decision that comes back here.
``Effects.carry_out`` does its I/O: an order to a held poll, a cycle's task or timer, a keeper
started, a record published, a counter counted. The decisions the caller itself reads (a reply,
a poll to hold, a saver to await) need nothing here.
"""

from __future__ import annotations

import logging

from ..config import GracefulConfig
from ..outcome import publish_record
from ..protocol import WarmResult
from . import events as ev
from .backups import BackupTurns
from .cycle_tasks import CycleTasks
from .fanout import Fanout
from .memory import MemoryTier
from .outcomes import OutcomeBoard
from .warm_waits import WarmWaits

logger = logging.getLogger(__name__)


class Effects:
    """The parts a decision acts on, and the one place that says which acts on which."""

    def __init__(
        self,
        config: GracefulConfig,
        job_id: str,
        fanout: Fanout,
        tasks: CycleTasks,
        backups: BackupTurns,
        memory: MemoryTier,
        warm_waits: WarmWaits,
        outcomes: OutcomeBoard,
    ) -> None:
        self.config, self.job_id = config, job_id
        self.fanout, self.tasks, self.backups = fanout, tasks, backups
        self.memory, self.warm_waits, self.outcomes = memory, warm_waits, outcomes

    def carry_out(self, decision: ev.Decision) -> None:
        """Do what ``decision`` says; the caller logs and records one that raises."""
        match decision:
            case ev.OrderOut(process_id, answer):
                self.fanout.answer(process_id, answer)
            case ev.CycleOpened(cycle):
                self.tasks.spawn(self.tasks.run_cycle(cycle))
            case ev.Gathered(cycle):
                self.tasks.event(cycle, "gathered").set()
            case ev.AllReported(cycle):
                self.tasks.event(cycle, "reported").set()
            case ev.SaveResolved():
                self.backups.resolved(decision)
            case ev.KeeperNeeded(node_id):
                self.memory.ensure_keeper(node_id)
            case ev.NodeLeaving(node_id, deadline):
                self.memory.node_leaving(node_id, deadline)
            case ev.SpareTold(spare_id):
                self.fanout.tell_spare(spare_id)
            case ev.Rejected(summary, reason):
                logger.warning("ray_graceful coordinator: rejected %s: %s", summary, reason)
                self.outcomes.count_rejected()
            case ev.NoticeAccepted(source):
                self.outcomes.count_notice(source)
            case ev.Concluded(warm=record):
                self.tasks.publish(decision)
                if record is not None:
                    self.warm_waits.answer_asks()
                if record is not None and record.result is WarmResult.REJOINING:
                    # its members have until join_by to say what they did
                    self.tasks.spawn(self.tasks.at(record.join_by, ev.JoinDeadline(record.cycle)))
            case ev.WarmFinished(cycle):
                self.warm_waits.finished(cycle).set()
            case ev.HeldChanged(cycle, record):
                publish_record(self.config.report_dir, self.job_id, f"held-cycle-{cycle}", record)
                self.outcomes.held(cycle, record)
            case ev.HeldTimer(cycle, until):
                self.tasks.spawn(self.tasks.at(until, ev.HeldDue(cycle)))
            case ev.CommitHeld(request):
                self.tasks.spawn(self.tasks.commit_held(request))
            case ev.MakeDurable(cycle, memory):
                self.memory.after_commit(cycle, memory)  # the disk copy, in the background
                self.tasks.spawn(self.tasks.when_durable(cycle))
            case ev.HeldLost(cycle, step, reason):
                logger.error("ray_graceful: held step %s of cycle %s lost: %s", step, cycle, reason)
                self.memory.after_commit(cycle, None)  # what the cycle handed to keepers goes
                self.memory.durable_failed(cycle, f"held step {step} lost: {reason}")
            case _:
                pass  # Replied, HoldPoll, HoldSparePoll, AwaitSaver, Commit: the caller's
