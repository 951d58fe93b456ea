"""Warm restart, on a rank's side: keep this process, re-form the group, hold the committed step.

A survivor's order says ``rejoin``: its teardown releases its peers, saves as planned and
destroys its process group, and then ends *without* an exit. From there one of two things
happens, whichever comes first:

- the driver calls ``rejoin()`` (through the worker's ``graceful_rejoin``): the coordinator
  answers with a ``Rendezvous``, the process joins the next cycle's group through the job's
  long-lived store (``rendezvous.py``), registers its rank again, and holds the committed step -
  its own state when it can prove it is that step (it parked at that boundary before any
  release), else loaded from the memory tier or disk - and returns a ``Rejoined``;
- nothing calls it within ``rejoin_timeout_s``, or a SIGTERM arrives, or the coordinator says
  "leave": the process leaves through Ray's intended exit, as it would have without a warm
  restart.

A spare calls ``rejoin()`` at once: it waits as a spare (``wait_as_spare``) until the
coordinator hands it an evicted rank's slot, then does the same, always loading.

Every failure on the way (the group does not form in time, the load fails, the registration is
refused) is reported to the coordinator - which then ends the other members cleanly - and the
process leaves. A rank never trains on after a rejoin unless it holds the committed step.

A SIGTERM while ``rejoin()`` runs is claimed and held (the rank's machine, ``lifecycle.py``): a
member without its answer yet leaves; one with its answer finishes joining - the group forms as
soon as every member is there, where leaving would hold the others in the rendezvous until its
timeout - and the held signal is then the first notice of the new group's cycle, its deadline
counted from the signal.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from .. import rendezvous as store
from ..bounded import NoAnswer, call
from ..config import GracefulConfig
from ..memory.handoff import LoadedShard, load_shard
from ..protocol import (
    LoadedFrom,
    Rejoined,
    RejoinResult,
    Rendezvous,
    RendezvousAction,
    SpareAction,
    shard_key,
    train_slot_member,
)
from . import peer_transfer
from .control import REPORT_TIMEOUT_S, find_coordinator
from .exit_path import write_stderr
from .late_copy import HeldShard
from .process_groups import SetupError, resolve_group
from .process_runtime import ProcessRuntime, Registration, process_runtime
from .rank_events import RankPhase, RejoinBegun, RejoinEnded
from .restore import coordinator_checkpoint_dir
from .setup import after_init_process_group
from .spare_wait import wait_in_rejoin

RENDEZVOUS_POLL_S = 1.0  # an ask's long poll: a SIGTERM meanwhile is seen within it


def rejoin(
    *,
    state_dict: Callable[[], Any] | None = None,
    load_state_dict: Callable[[Any], Any] | None = None,
    config: GracefulConfig | None = None,
    backend: str | None = None,
) -> Rejoined:
    """Join the next cycle's group in this process; the new rank, world size and resume step.

    - A survivor (its order said ``rejoin``) keeps what it registered; the arguments are only
      needed where it registered none (``load_state_dict``).
    - A spare (nothing registered yet) waits here until it is handed a slot, or the job ends
      (then ``action == "left"`` and the process exits 0 once the call returned). It takes
      the evicted rank's group and shard; its ``state_dict``/``load_state_dict`` are
      registered as ``graceful_setup`` would.
    - ``backend``: of the new group; default the survivor's old one, else "nccl" where CUDA
      is available and "gloo" elsewhere.

    ``Rejoined.action`` is "joined" (train on from ``step`` as ``rank`` of ``world_size``) or
    "left" (the process is leaving; ``reason`` says why).
    """
    runtime = process_runtime()
    config = runtime.adopt_config(config)
    survivor = _survivor_registration(runtime)
    control = runtime.control
    coordinator = (
        control.handle if survivor is not None and control is not None else find_coordinator(config)
    )
    if coordinator is None:
        raise SetupError("rejoin(): no coordinator runs for this job; start one on the driver")
    if runtime.registrations and survivor is None:
        raise SetupError(
            "rejoin(): this process holds ranks but was not ordered to rejoin (warm_restart "
            "is off, or its rank is being evicted): nothing to rejoin"
        )
    return _as_the_machine_says(
        runtime,
        lambda: _rejoin(
            runtime, config, coordinator, survivor, state_dict, load_state_dict, backend
        ),
    )


def join_train_slot(
    group: str,
    rank: int,
    *,
    state_dict: Callable[[], Any] | None,
    load_state_dict: Callable[[Any], Any] | None,
    config: GracefulConfig | None = None,
    backend: str | None = None,
) -> Rejoined:
    """Ray Train's new worker in an evicted rank's slot joins the warm restart as that rank.

    Train started this process in the slot of world rank ``rank`` (its replica groups,
    ``ray_graceful/train/warm.py``): the coordinator handed the slot out before the process
    existed, under the slot's name (``train_slot_member``). From here it is a spare that was
    handed that slot: it joins the new group, loads the committed step and registers.
    """
    runtime = process_runtime()
    config = runtime.adopt_config(config)
    coordinator = find_coordinator(config)
    if coordinator is None:
        raise SetupError("no coordinator runs for this job: the Ray Train callback starts it")
    if runtime.registrations:
        raise SetupError("this process holds ranks already: it is no new worker for a slot")
    member = train_slot_member(group, rank)

    def join() -> Rejoined:
        answer = _ask(coordinator, member, config, runtime.machine.held_signal)
        if answer.action != RendezvousAction.JOIN:
            return Rejoined(RejoinResult.LEFT, member, reason=answer.reason, pid=os.getpid())
        backend_ = backend or _default_backend()
        return _join_or_report(
            coordinator, member, answer,
            lambda: _join(runtime, config, coordinator, member, answer, backend_, None,
                          state_dict, load_state_dict),
        )  # fmt: skip

    return _as_the_machine_says(runtime, join)


def _as_the_machine_says(runtime: ProcessRuntime, rejoin_: Callable[[], Rejoined]) -> Rejoined:
    """Run ``rejoin_`` inside the rank machine's REJOINING phase: a SIGTERM meanwhile is held
    or ends it (``lifecycle.py``), and its end is the machine's ``RejoinEnded``."""
    runtime.step(RejoinBegun(time.time()))
    with runtime.lock:  # the phase and its data together, as another thread may step it
        phase, data = runtime.machine.phase, runtime.machine.data
    if phase is not RankPhase.REJOINING:
        # A SIGTERM came first, and the process is already leaving.
        reason = getattr(data, "reason", "this process is leaving")
        return Rejoined(RejoinResult.LEFT, "", reason=reason, pid=os.getpid())
    result = Rejoined(RejoinResult.LEFT, "", reason="rejoin() raised", pid=os.getpid())
    try:
        result = rejoin_()
    finally:
        # Joined with a SIGTERM held: the machine has it reported as the new group's first
        # notice, once the others have joined too (``ProcessRuntime._notice_again``).
        # Joined: what this survivor holds goes to the keepers after the group's first step
        # (``should_stop``); leaving: the machine's Leave finishes it first.
        runtime.step(RejoinEnded(result.joined, time.time(), result.cycle, result.reason))
    return result


def _rejoin(
    runtime: ProcessRuntime,
    config: GracefulConfig,
    coordinator: Any,
    survivor: Registration | None,
    state_dict: Callable[[], Any] | None,
    load_state_dict: Callable[[Any], Any] | None,
    backend: str | None,
) -> Rejoined:
    """``rejoin()`` from its first word to the coordinator to its result."""
    if survivor is not None:
        member = runtime.control.process_id  # type: ignore[union-attr]
        teardown = runtime.teardown
        assert teardown is not None
        teardown.done.wait(max(teardown.remaining(), 0.0) + config.watchdog_margin_s)
        backend = backend or _backend_of(survivor)
    else:
        waited = wait_in_rejoin(config)
        if waited.action != SpareAction.ASSIGNED:
            return Rejoined(
                RejoinResult.LEFT, waited.spare_id, reason=waited.reason, pid=os.getpid()
            )
        member = waited.spare_id
        backend = backend or _default_backend()
    answer = runtime.rendezvous if survivor is not None else None
    answer = answer or _ask(coordinator, member, config, runtime.machine.held_signal)
    if isinstance(answer, Unanswered):
        runtime.left_unanswered(answer.reason)  # a survivor's slot must not wait for it
    if answer.action != RendezvousAction.JOIN:
        return Rejoined(RejoinResult.LEFT, member, reason=answer.reason, pid=os.getpid())
    return _join_or_report(
        coordinator, member, answer,
        lambda: _join(runtime, config, coordinator, member, answer, backend, survivor,
                      state_dict, load_state_dict),
    )  # fmt: skip


def _join_or_report(
    coordinator: Any, member: str, answer: Rendezvous, join: Callable[[], Rejoined]
) -> Rejoined:
    """``join()`` (``_join``); a failure on the way is told to the coordinator, which then ends
    the other members cleanly, and this process leaves."""
    try:
        return join()
    except Exception as exc:
        reason = f"{type(exc).__name__}: {exc}"[:400]
        result = _result(answer, member, RejoinResult.LEFT, reason=reason)
        _tell(coordinator, result)
        _destroy_quietly()
        return result  # the rank's machine has it leave (``RejoinEnded``)


def _survivor_registration(runtime: ProcessRuntime) -> Registration | None:
    order = runtime.order
    if order is None or not order.rejoin or runtime.control is None:
        return None
    ranks = [r for r in runtime.registrations.values() if not r.release_only]
    return ranks[0] if len(ranks) == 1 else None


def _backend_of(registration: Registration) -> str:
    backends = registration.group.backends
    return "nccl" if "nccl" in backends else (backends[0] if backends else _default_backend())


def _default_backend() -> str:
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


class Unanswered(Rendezvous):
    """A leave decided here before the coordinator answered: a SIGTERM, or no answer in time."""


def _ask(
    coordinator: Any, member: str, config: GracefulConfig, signalled: Callable[[], object]
) -> Rendezvous:
    """The coordinator's answer for ``member``, asked until it has one, the time is up or a
    SIGTERM came (each ask is a long poll of at most ``RENDEZVOUS_POLL_S``)."""
    until = time.monotonic() + config.rejoin_timeout_s
    while time.monotonic() < until:
        # Signalled: asked once more, not held - a warm restart already decided for this member
        # is its answer (it finishes joining, and the signal is the new group's first notice:
        # the others wait for it, and under Ray Train nobody else could take its slot).
        last = signalled()
        wait_s = 0.1 if last else min(RENDEZVOUS_POLL_S, max(until - time.monotonic(), 0.1))
        answer = call(coordinator.rendezvous, member, wait_s, timeout=wait_s + 30)
        if isinstance(answer, NoAnswer):
            return Rendezvous(
                RendezvousAction.LEAVE, f"the coordinator could not be asked ({answer})"
            )
        if isinstance(answer, Rendezvous):
            return answer
        if last:
            return Unanswered(RendezvousAction.LEAVE, "SIGTERM while it waited for its rendezvous")
    return Unanswered(
        RendezvousAction.LEAVE, f"no rendezvous within rejoin_timeout_s={config.rejoin_timeout_s}"
    )


def _join(
    runtime: ProcessRuntime,
    config: GracefulConfig,
    coordinator: Any,
    member: str,
    answer: Rendezvous,
    backend: str,
    survivor: Registration | None,
    state_dict: Callable[[], Any] | None,
    load_state_dict: Callable[[Any], Any] | None,
) -> Rejoined:
    started, started_at = time.monotonic(), time.time()
    clean_step = runtime.teardown.clean_step if runtime.teardown is not None else None
    own_state = (
        survivor is not None and clean_step == answer.step and survivor.shard == answer.shard
    )
    loader = (load_state_dict or survivor.load_state) if survivor is not None else load_state_dict
    # The committed shard is fetched while the group forms: on NCCL the communicator is built
    # inside the rendezvous (``eager_device``), and neither waits for the other. A shard a
    # survivor holds comes from that survivor once the group formed.
    from_peer = answer.peer >= 0
    fetch = (
        None if own_state or loader is None or from_peer else _fetch(config, coordinator, answer)
    )
    held = list(runtime.teardown.saving.held) if runtime.teardown is not None else []
    store.form_group(answer, backend)
    formed = time.monotonic()
    if survivor is not None:
        _register_again(runtime, survivor, answer, state_dict, loader)
    else:
        after_init_process_group(
            answer.group,
            shard=answer.shard,
            state_dict=state_dict,
            load_state_dict=load_state_dict,
            config=config,
        )
    registered = time.monotonic()
    control = runtime.control
    if control is None or control.cycle != answer.cycle:
        raise SetupError(
            f"the coordinator did not take this rank into cycle {answer.cycle} "
            f"({control.describe() if control else 'no coordinator'})"
        )
    seconds = {"rendezvous": formed - started, "register": registered - formed}
    if own_state and answer.peer < 0:
        loaded_from = LoadedFrom.OWN_STATE
        if answer.send_to:
            peer_transfer.send(held, answer)  # from the live state if the copy is not done
            seconds["sent"] = time.monotonic() - registered
        _settle(held, seconds)  # the live state may move from here on
    else:
        _settle(held, seconds)
        loaded_from = _load(answer, loader, fetch, started, seconds)
    seconds["load"] = time.monotonic() - registered  # what was left of the fetch, and the load
    runtime.loop.last_step = answer.step
    result = _result(
        answer,
        member,
        RejoinResult.JOINED,
        loaded_from=loaded_from,
        started_at=started_at,
        seconds=seconds,
    )
    _tell(coordinator, result)
    return result


def _settle(held: list[HeldShard], seconds: dict[str, float]) -> None:
    """Every snapshot this survivor reported held is copied out of the live state (the copies
    run in the background from the teardown on: ``memory.handoff.take_snapshot``). One that
    could not be made ends the rejoin: the held step would have no copy to commit from."""
    started = time.monotonic()
    for shard in held:
        why = shard.snapshot.settle(shard.budget_s)
        if why is not None:
            record = shard.record
            raise SetupError(f"shard {record.shard!r} held at step {record.step}: {why}")
    if held:
        seconds["snapshot_wait"] = time.monotonic() - started


def _register_again(
    runtime: ProcessRuntime,
    survivor: Registration,
    answer: Rendezvous,
    state_dict: Callable[[], Any] | None,
    loader: Callable[[Any], Any] | None,
) -> None:
    """The survivor's rank, as the new group has it; the runtime ready for the next cycle."""
    handle = resolve_group(answer.group, None, answer.rank, answer.world_size)
    with runtime.lock:
        # Extra groups were destroyed with the default one: the user forms them again.
        runtime.registrations = {
            handle.key: Registration(
                handle,
                answer.shard,
                survivor.saver,
                state=state_dict or survivor.state,
                load_state=loader,
            )
        }
        runtime.teardown, runtime.order, runtime.rendezvous = None, None, None
        runtime.stop_event.clear()
    control = runtime.control
    assert control is not None
    control.cycle = None
    control.order_received.clear()
    control.register()


def _fetch(config: GracefulConfig, coordinator: Any, answer: Rendezvous) -> Future:
    """Start fetching shard ``answer.shard``'s newest committed copy, on a thread of its own."""
    checkpoint_dir = config.checkpoint_dir or coordinator_checkpoint_dir(coordinator)
    key = shard_key(answer.group, answer.shard)

    def fetch() -> tuple[LoadedShard | None, float, float]:
        began = time.monotonic()
        loaded = load_shard(
            key, coordinator, checkpoint_dir, config.coordinator_namespace, step=answer.step
        )
        return loaded, began, time.monotonic()

    pool = ThreadPoolExecutor(1, thread_name_prefix="ray_graceful-fetch")
    try:
        return pool.submit(fetch)
    finally:
        pool.shutdown(wait=False)  # the fetch runs on; the thread ends with it


def _load(
    answer: Rendezvous,
    loader: Callable[[Any], Any] | None,
    fetch: Future | None,
    started: float,
    seconds: dict[str, float],
) -> LoadedFrom:
    """Load the shard of step ``answer.step`` into this rank - from the survivor that holds it
    (``answer.peer``), else the fetch begun before the group formed (its span goes into
    ``seconds``, counted from ``started``); where it came from."""
    if loader is None:
        raise SetupError(
            "this rank must load the committed step but registered no load_state_dict=: pass "
            "load_state_dict= to graceful_setup (or to graceful_rejoin)"
        )
    if answer.peer >= 0:
        return peer_transfer.receive(answer, loader)
    assert fetch is not None  # begun wherever there is a loader and no peer
    key = shard_key(answer.group, answer.shard)
    loaded, began, ended = fetch.result()
    # The fetch's own span, from this call's start: it began before the group formed.
    seconds.update(fetch_began=began - started, fetch_ended=ended - started)
    if loaded is None:
        raise RuntimeError(f"no committed copy of shard {key!r} to load")
    if loaded.step != answer.step:
        raise RuntimeError(
            f"shard {key!r} was found at step {loaded.step}, not the committed step "
            f"{answer.step}: training on would mix steps"
        )
    loader(loaded.state)
    return loaded.tier


def _result(answer: Rendezvous, member: str, action: RejoinResult, **fields: Any) -> Rejoined:
    import ray

    return Rejoined(
        action,
        member,
        group=answer.group,
        rank=answer.rank,
        world_size=answer.world_size,
        step=answer.step,
        cycle=answer.cycle,
        was=answer.was,
        pid=os.getpid(),
        node_id=ray.get_runtime_context().get_node_id(),
        **fields,
    )


def _tell(coordinator: Any, result: Rejoined) -> None:
    if isinstance(failed := call(coordinator.rejoined, result, timeout=REPORT_TIMEOUT_S), NoAnswer):
        write_stderr(f"ray_graceful: could not tell the coordinator the rejoin result: {failed}\n")


def _destroy_quietly() -> None:
    import torch.distributed as dist

    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass
