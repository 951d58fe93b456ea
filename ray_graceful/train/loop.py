"""The training function's step boundary under Ray Train: ``should_stop``, agreed by all ranks.

Both of the plugin's ways through a Train run use it: the cold one (``emergency.py``: save,
report, and Train restarts the whole group) and the warm one (``warm.py``: the survivors keep
their processes and Train replaces only the evicted workers).
"""

from __future__ import annotations

from ..config import GracefulConfig
from ..worker.process_groups import SetupError
from ..worker.process_runtime import process_runtime
from ..worker.setup import should_stop as rank_should_stop
from .reports import NOT_YET, held_report

GROUP = "train"  # the group name every Train worker registers under

# How long a warm-path rank whose step raised waits for the coordinator's order before the
# error goes on to Ray Train: the lost-rank watch sees a dead worker within a poll (0.25 s) and
# the host watch a silent host within about a second; the plan and its order follow at once.
FAILED_STEP_ORDER_WAIT_S = 10.0


class EmergencyStop(RuntimeError):
    """Raised once this worker's part of an eviction is done: its checkpoint was reported to
    Ray Train (the cold path), or its process is leaving (an evicted worker on the warm path)."""


def should_stop(step: int, every: int = 1) -> bool:
    """Whether the training function should stop at this step - agreed by all ranks.

    Orders reach ranks a few milliseconds apart; a rank that stopped at step 8 while its peer
    went on to step 9 would leave both stuck (the peer's all-reduce waits for it, it waits in
    ``ray.train.report`` for the peer). So the ranks agree: one all-reduce of a flag on the
    run's process group, every ``every`` steps (all ranks must pass the same ``step`` and
    ``every``). On GPUs that is one tiny NCCL all-reduce and a sync; raise ``every`` if a step
    is short.

    On the warm path (``warm.setup``) the ranks agree before any of them parks, so no rank
    waits in the agreement for a peer that is parked: ``carry_on`` parks afterwards.
    """
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise SetupError(f"should_stop: every={every!r} must be an int >= 1")
    runtime = process_runtime()
    warm = runtime.loop.peers_reach_boundary
    if warm:
        runtime.loop.mark(step)
        local = rank_should_stop()  # the flag alone: carry_on parks once all agreed
    else:
        local = rank_should_stop(step)
    if step % every:
        return False
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return local
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    if not warm:
        flag = torch.tensor([1 if local else 0], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
    # The warm path's agreement carries a held step found on disk too (``reports.py``)
    rank = dist.get_rank()
    agreed = torch.tensor(
        [1 if local else 0, held_report.on_disk(rank)], dtype=torch.int64, device=device
    )
    try:
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    except RuntimeError as exc:  # a peer is gone: its eviction's order says stop here
        if ordered_after_failure(exc):
            return True
        raise
    stop, on_disk = (int(v) for v in agreed.tolist())
    if on_disk != NOT_YET and not stop:
        held_report.report(on_disk, rank)
    return bool(stop)


def ordered_after_failure(exc: BaseException) -> bool:
    """Whether a warm-path step that raised ``exc`` was ended by an eviction, not a bug.

    A collective fails when a peer is gone: it crashed (gloo: "Connection closed by peer"), or
    its host was lost and the plugin released this rank from the hung collective. Either is a
    notice: the coordinator's order for this rank follows, and the rank then stops at its last
    step (``should_stop`` says so, ``carry_on`` re-forms the group) instead of raising out of the
    training function, which would make Ray Train restart every worker. True once that order
    came (within ``FAILED_STEP_ORDER_WAIT_S``); False - the error goes on - for anything that is
    not a ``RuntimeError`` (torch's collective errors are), for ``EmergencyStop`` (an evicted
    worker leaving: a guard around ``carry_on`` must not keep it), off the warm path, or with
    no order.
    The step's update never applied where every collective precedes ``optimizer.step()``, the
    rule ``should_stop`` already relies on (docs/worker.md, "Step boundaries and saving").
    """
    runtime = process_runtime()
    if not isinstance(exc, RuntimeError) or isinstance(exc, EmergencyStop):
        return False  # not a collective's error, or the plugin's own word to leave
    if not runtime.loop.peers_reach_boundary:
        return False
    if runtime.control is None:
        return False
    return runtime.stop_event.wait(FAILED_STEP_ORDER_WAIT_S)


def train_shard(config: GracefulConfig, rank: int) -> str:
    """The shard label of a Train worker: one for all (``train_shards="replicated"``, DDP),
    else its rank (FSDP, sharded)."""
    return "model" if config.train_shards == "replicated" else str(rank)
