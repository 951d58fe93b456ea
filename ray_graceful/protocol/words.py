"""The closed sets of words the protocol speaks: each an enum that is also its plain string.

A ``Word`` compares equal to, prints as and serialises (JSON) as its value, so a record read
back from an outcome file or a log still matches ``Result.COMMITTED`` or ``"committed"``.
"""

from __future__ import annotations

from ..word import Word

__all__ = ["Word"]  # and the sets below


class Action(Word):
    """What the plan has one rank do (``plan.RankPlan.action``)."""

    SAVE = "save"  # save its shard, then leave
    BACKUP = "backup"  # save its shard only if the shard's saver cannot
    LEAVE = "leave"  # leave without saving


class PollKind(Word):
    """What a long poll's answer is."""

    ORDER = "order"  # a TeardownOrder: tear down
    IDLE = "idle"  # nothing within the poll's wait: poll again
    UNKNOWN = "unknown"  # this process is not registered
    STALE = "stale"  # the poll named a cycle that is not the current one
    AWAY = "away"  # (from a node agent) the coordinator is restarting or gone: register again


class PhaseStatus(Word):
    """How one teardown step went."""

    RUNNING = "running"
    RAN = "ran"
    SKIPPED = "skipped"  # with the reason in its detail
    FAILED = "failed"  # with the error in its detail
    INTERRUPTED = "interrupted"  # the deadline's watchdog ended the process during it


class Result(Word):
    """What a cycle came to (``TerminationOutcome.result``)."""

    COMMITTED = "committed"  # every shard of the plan at one step: a restart loads it
    # every shard of the plan at one step, a warm restart's survivors holding theirs in memory:
    # the group trains on from it; committed once their copies land (``Coordinator.durability``)
    HELD = "held"
    ABANDONED = "abandoned"  # nothing committed, with the reason
    NO_CHECKPOINT = "no-checkpoint"  # nowhere to write: no checkpoint_dir, no memory tier
    RAY_TRAIN = "ray-train"  # the savers reported to Ray Train (ray.train.get_checkpoint())
    FAILED = "failed"  # the coordinator could not conclude normally (the reason says why)


class Replacement(Word):
    """Who takes a rank's slot when its process leaves (``RankSpec.replaced_by``)."""

    SPARE = "spare"  # a waiting spare, if there is one (hand-built groups)
    TRAIN_SLOT = "ray-train-slot"  # the worker Ray Train starts in the slot (replica groups)
    # Ray Train restarts every worker of the group (a Ray without replica groups): no survivor
    # can keep its process, so none is chosen
    WHOLE_GROUP = "whole-group"


class SpareAction(Word):
    """What ends a spare's or standby's wait (``SpareAnswer.action``, ``SpareResult.action``)."""

    EXIT = "exit"  # the job is over, or this spare is leaving: exit
    ASSIGNED = "assigned"  # take the slot named in the order
    TIMEOUT = "timeout"  # (the worker side only) no word within the wait's timeout
    REGISTER = "register"  # this coordinator does not know the spare (it restarted): register


class RendezvousAction(Word):
    """A warm restart's answer to one member (``Rendezvous.action``)."""

    JOIN = "join"  # form the new group through the named store
    LEAVE = "leave"  # leave, as without a warm restart (the reason says why)


class WarmResult(Word):
    """How one warm restart went, as a whole (``WarmRecord.result``)."""

    REJOINING = "rejoining"  # decided: members are forming the new group
    REJOINED = "rejoined"  # every member said what it did, and the group formed
    FAILED = "failed"  # a member did not join (or said nothing by its time): the group leaves
    COLD = "cold"  # no warm restart: every rank leaves (the reason says why)


class JobState(Word):
    """Where the job is, as its coordinator knows it (``Coordinator.job_finished``)."""

    RUNNING = "running"
    SUCCEEDED = "succeeded"  # the driver said it succeeded: spares and standbys exit
    CLOSED = "closed"  # the driver closed it for good: spares and standbys exit


class RejoinResult(Word):
    """What one member of a warm restart did (``Rejoined.action``)."""

    JOINED = "joined"  # trains on in the new group
    LEFT = "left"  # is leaving (the reason says why)


class TeardownPhase(Word):
    """A step of one process's teardown, in the order it runs (``PhaseRecord.name``)."""

    STOP = "stop"  # should_stop() turns true
    QUIESCE = "quiesce"  # the training thread parks at a step boundary, or is released
    RELEASE_PEERS = "release_peers"  # every peer is released from its collectives
    DRAIN_DEVICE = "drain_device"  # the GPU's queued work finishes (or is abandoned)
    SAVE = "save"  # this rank's shard, if the plan has it save
    DESTROY_PROCESS_GROUP = "destroy_process_group"
    EXIT = "exit"  # the process leaves (the report is written just before)
