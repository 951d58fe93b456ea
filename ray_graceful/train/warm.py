"""Ray Train's warm path, in the training function: ``setup`` once, ``carry_on`` at a stop.

::

    from ray_graceful.train import carry_on, setup, should_stop, step_guard

    def train_func(config):
        model, opt = build()
        step = setup(state_dict=state, load_state_dict=load) or 0  # a new worker: its step
        while step < total:
            with step_guard():  # a peer lost mid-step ends the step here, not the function
                train_one_step(model, opt)  # gradients all-reduced on the default group
                step += 1
            if should_stop(step):
                step = carry_on(step)  # a survivor: back in the group, at this step

    TorchTrainer(train_func, torch_config=GracefulTorchConfig(),
                 run_config=RunConfig(callbacks=[GracefulTrainCallback()]))

What happens at a notice: every rank agrees on the stop step (``should_stop``); the evicted
workers park there, save what the plan gives them and leave through Ray's intended exit; Train
sees their groups fail and starts a new worker in each slot. The survivors park in
``carry_on``, are released from their collectives, destroy their process group and keep their
process; ``carry_on`` then re-forms the group with the new workers (``worker/rejoin.py``) and
returns the step every member holds. A new worker's ``setup`` joins at the evicted rank and
loads that step: from a survivor over the new group, a keeper or disk.

A worker that crashes, or whose host is lost without a word, gives no notice first: its peers'
collectives fail inside their step. ``step_guard`` holds such a failure until the coordinator's
order (it noticed the loss) and ends the step there; the step's update never applied, so the
next ``should_stop(step)`` stops at the last step and ``carry_on`` goes on as above. Without the
guard the error leaves the training function and Train restarts every worker.

Where the warm restart does not go ahead (no committed step, the new worker is not placed in
time, every worker was evicted...), the survivors leave too, and Train restarts the whole group:
``setup`` then loads the newest committed step in every worker, the cold ending of before.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from ..config import GracefulConfig
from ..protocol import Replacement, WarmResult
from ..worker.process_groups import SetupError
from ..worker.process_runtime import ProcessRuntime, process_runtime
from ..worker.rejoin import join_train_slot, rejoin
from ..worker.restore import load_latest
from ..worker.setup import after_init_process_group
from ..worker.setup import should_stop as rank_should_stop
from .backend import ray_has_replica_groups
from .loop import GROUP, EmergencyStop, ordered_after_failure, train_shard
from .reports import report_joined

logger = logging.getLogger(__name__)

JOINED_POLL_S = 0.25  # each ask for the new group's record: an order meanwhile is seen this soon


def setup(
    *,
    state_dict: Callable[[], Any],
    load_state_dict: Callable[[Any], Any],
    shard: str | None = None,
) -> int | None:
    """Register this Train worker on the warm path; the step it holds, or None.

    Call it once, after the model and optimizer exist. ``state_dict()`` returns what a save
    writes and a new worker receives (model and optimizer); ``load_state_dict(state)`` puts it
    back. ``shard``: this rank's shard label (default: "model" for every rank when
    ``train_shards="replicated"``, DDP; else the rank).

    - A worker of the first start (Train formed the process group): registers, and loads the
      newest committed step if there is one (a full restart after a fallback) - its step;
      None when nothing was committed yet (start from 0, or from Train's own checkpoint).
    - A worker Train started in an evicted slot: joins the survivors' new group as that rank
      and loads the committed step - its step. If the warm restart failed meanwhile, raises
      ``EmergencyStop`` (Train then restarts the whole group).
    """
    import ray.train
    import torch.distributed as dist

    for label, fn in (("state_dict", state_dict), ("load_state_dict", load_state_dict)):
        if not callable(fn):
            raise SetupError(f"setup: {label}={fn!r} is not callable")
    runtime = process_runtime()
    config = runtime.config_or_default()
    if not config.warm_restart:
        raise SetupError(
            "ray_graceful.train.setup is the warm path: run the trainer with "
            "torch_config=GracefulTorchConfig() and GracefulTrainCallback in its callbacks"
        )
    context = ray.train.get_context()
    rank = context.get_world_rank()
    label = shard if shard is not None else train_shard(config, rank)
    _use_assigned_gpu()
    # Every rank agrees on the stop step before any parks (``loop.should_stop``); and where
    # Ray keeps survivors, this rank's slot is refilled by Train if it leaves
    runtime.loop.peers_reach_boundary = True
    replica_groups = ray_has_replica_groups()
    runtime.replaced_by = Replacement.TRAIN_SLOT if replica_groups else Replacement.WHOLE_GROUP
    if not replica_groups:
        logger.warning(
            "ray_graceful: this Ray has no replica groups (Ray >= 2.56 has them): Ray Train "
            "restarts its whole worker group at an eviction, from the committed step"
        )
    if dist.is_initialized():  # the first start, or Train's full restart
        after_init_process_group(
            GROUP, shard=label, state_dict=state_dict, load_state_dict=load_state_dict
        )
        loaded = load_latest(GROUP, label, config)
        if loaded is None:
            return None
        load_state_dict(loaded.state)
        return int(loaded.step)
    joined = join_train_slot(
        GROUP, rank, state_dict=state_dict, load_state_dict=load_state_dict, config=config
    )
    if not joined.joined:
        raise EmergencyStop(f"ray_graceful: this new worker did not join: {joined.reason}")
    report_joined(joined.step, joined.cycle, config.checkpoint_dir)
    return joined.step


def _use_assigned_gpu() -> None:
    """On GPUs: make Ray's assignment this thread's current device before any NCCL group forms
    (the plugin's rendezvous builds the communicator on the current device). Ray Train's
    ``get_device`` maps Ray's GPU ids through ``CUDA_VISIBLE_DEVICES``; ``local_rank`` would
    not do: under replica groups it is 0 in every worker."""
    import ray.train.torch
    import torch

    device = ray.train.torch.get_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)


def carry_on(step: int) -> int:
    """After ``should_stop(step)`` said True: the step to train on from, in the new group.

    A survivor parks here until its part of the teardown is done, then re-forms the group in
    this process with Train's new workers and returns the step every member holds (``step``
    itself where this rank can prove it parked there). An evicted worker waits here for its
    teardown, then raises ``EmergencyStop``: Train replaces its group and ends its process. If
    the warm restart does not go ahead, a survivor raises it too, and Train restarts the whole
    group from the committed step.
    """
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise SetupError(f"carry_on: step={step!r} must be an int >= 0")
    runtime = process_runtime()
    config = runtime.config_or_default()
    # A peer saw the stop first (should_stop agreed on it): this rank's order is on its way.
    runtime.stop_event.wait(config.order_wait_s)
    while True:
        rank_should_stop(step)  # parks at the boundary until this rank's save is done
        order, teardown = runtime.order, runtime.teardown
        if order is None or not order.rejoin:
            break
        joined = rejoin(config=config)
        if not joined.joined:
            raise EmergencyStop(f"ray_graceful: the warm restart did not go ahead: {joined.reason}")
        if _every_member_joined(runtime, joined.cycle, config):
            report_joined(joined.step, joined.cycle, config.checkpoint_dir)
            return joined.step
        # A member died on its way in, and its death ended the new group's cycle: this
        # survivor's order for it came instead. It parks at the step it holds, and re-forms
        # with the worker Train puts in that slot next.
        step = joined.step
    if teardown is not None:  # evicted: once its teardown is done, Train ends this process
        teardown.done.wait(max(teardown.remaining(), 0.0) + config.watchdog_margin_s)
        teardown.train_fn_raised.set()  # raised just below: Train replaces this worker's group
    raise EmergencyStop(f"ray_graceful: this worker was evicted at step {step}")


@contextmanager
def step_guard() -> Iterator[None]:
    """Around one training step: a failure because a peer is gone ends the step, not the run.

    ::

        with step_guard():
            train_one_step(model, opt)
            step += 1
        if should_stop(step):
            step = carry_on(step)

    A peer that crashed, or whose host was lost, gives no notice before its peers' collectives
    fail. The guard holds the ``RuntimeError`` until the coordinator's order for this rank
    comes (``loop.ordered_after_failure``: at most ``FAILED_STEP_ORDER_WAIT_S``) and swallows
    it then: ``step`` still counts the completed steps, so ``should_stop(step)`` stops there and
    ``carry_on`` re-forms the group with the worker Train starts in the lost one's slot. Any
    other error, or no order, goes on out of the training function as before. Keep every
    collective of the step before ``optimizer.step()`` (docs/worker.md, "Step boundaries and
    saving"): the step's update then never applied when the guard swallows its failure.
    """
    try:
        yield
    except RuntimeError as exc:
        if not ordered_after_failure(exc):
            raise
        logger.warning(
            "ray_graceful: the step ended in a failed collective (%s); the coordinator's order "
            "came, so this rank stops at its last completed step",
            str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__,
        )


def _every_member_joined(runtime: ProcessRuntime, cycle: int, config: GracefulConfig) -> bool:
    """Whether every member of the new group (``cycle``) joined: asked before this survivor
    trains in it, and True once the coordinator's record says so.

    Trained in at once, its first collective could meet a member that died on its way in (Ray
    Train's new worker, killed while it loaded the step): gloo raises out of the training
    function, and Train restarts every worker. Such a death is a notice of the new group's own
    cycle: this survivor's order for it comes instead, and the answer is False. A coordinator
    that cannot be asked, or no word by the join's own bound: True (the survivor trains on, and
    its collective tells). Where every member joined, the ask costs one round trip: the
    survivor's first collective would have waited for the last member's load all the same."""
    control = runtime.control
    until = time.monotonic() + 2 * config.rejoin_timeout_s
    while control is not None and time.monotonic() < until:
        if runtime.stop_event.is_set():
            return False
        result = control.wait_rejoined(cycle, JOINED_POLL_S)
        if result is WarmResult.REJOINED or not isinstance(result, WarmResult):
            return True
        # REJOINING: not every member yet. FAILED: the coordinator ends the members that
        # joined (``rejoin`` notices), so this one's order is on its way.
    return not runtime.stop_event.is_set()
