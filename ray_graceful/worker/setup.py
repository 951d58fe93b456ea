"""The rank's setup API: register after ``init_process_group``, ask ``should_stop``.

``after_init_process_group`` (and the mixin's ``graceful_setup``, ``mixin.py``) register a rank
in this process's ``ProcessRuntime`` (``process_runtime.py``), install the SIGTERM listener and
connect the rank's control channel. ``register_rank`` is the one registration path every
adopter takes: the mixin, Ray Train's callback (``train.py``) and extra groups.
"""

from __future__ import annotations

import inspect
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..checkpoint import save_state_dict
from ..config import ConfigError, GracefulConfig
from ..dcp import DcpSaver
from .connect import connect
from .process_groups import SetupError, resolve_group
from .process_runtime import Registration, process_runtime, route_signals
from .rank_events import Registered, TeardownRequested
from .save_ways import Saver
from .signals import current_listener, install_listener
from .teardown import Teardown


class GracefulSetupWarning(RuntimeWarning):
    """graceful_setup could not install everything; the message names the fix."""


@dataclass(frozen=True)
class SetupStatus:
    """What ``graceful_setup`` installed for one rank, and why."""

    group: str
    rank: int
    world_size: int
    backends: tuple[str, ...]
    rank_source: str
    shard: str
    can_save: bool
    listener_installed: bool
    listener: str
    control: str
    notes: tuple[str, ...] = ()

    def __str__(self) -> str:
        lines = [
            f"ray_graceful: group {self.group!r} rank {self.rank}/{self.world_size} "
            f"({', '.join(self.backends) or '?'}; from {self.rank_source})",
            f"  shard: {self.shard!r}; emergency save: {'yes' if self.can_save else 'no saver'}",
            f"  SIGTERM listener: {self.listener}",
            f"  control: {self.control}",
        ]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def listener_status(
    config: GracefulConfig, where: str = "graceful_setup on the main thread", warn: bool = True
) -> tuple[bool, str]:
    """Install the listener where possible; say what happened."""
    on_main = threading.current_thread() is threading.main_thread()
    listener = current_listener()
    if on_main:
        listener = install_listener(listener.installed_from if listener else where)
    if listener is None:
        message = (
            f"not installed: graceful_setup runs on thread {threading.current_thread().name!r}, "
            "not the main thread (threaded, async or concurrency-group actor). Fix: call "
            "ray_graceful.install_signal_handling() in the actor's __init__, or start the job "
            "with runtime_env={'worker_process_setup_hook': 'ray_graceful.hooks.setup'}."
        )
        if config.strict and warn:
            raise SetupError("SIGTERM listener " + message)
        if not warn:
            return False, message
        warnings.warn(
            "ray_graceful: SIGTERM listener " + message, GracefulSetupWarning, stacklevel=4
        )
        return False, message
    route_signals(listener)
    how = f"installed ({listener.installed_from})"
    if not listener.handler_in_place():
        how += (
            "; another SIGTERM handler replaced ours on the main thread, so it runs too (the "
            "listener still sees every SIGTERM)"
        )
    return True, how


def install_signal_handling(config: GracefulConfig | None = None) -> str:
    """Install the SIGTERM listener now, from the main thread (an actor's ``__init__``).

    For actors whose methods do not run on the main thread (threaded, async, concurrency
    groups): ``__init__`` still does, so call this there; ``graceful_setup`` later finds it.
    """
    cfg = process_runtime().adopt_config(config)
    if threading.current_thread() is not threading.main_thread():
        raise SetupError(
            "install_signal_handling() must run on the main thread: call it from the actor's "
            "__init__ (async actors run __init__ off the main thread too: use the setup hook "
            "ray_graceful.hooks.setup instead)."
        )
    return listener_status(cfg, "install_signal_handling() on the main thread")[1]


def after_init_process_group(
    name: str = "default",
    *,
    process_group: Any = None,
    rank: int | None = None,
    world_size: int | None = None,
    shard: str | int | None = None,
    saver: Saver | None = None,
    state_dict: Callable[[], Any] | None = None,
    config: GracefulConfig | None = None,
    load_state_dict: Callable[[Any], Any] | None = None,
) -> SetupStatus:
    """Register this rank, right after ``init_process_group``; idempotent, any thread.

    - ``name``: the group's label ("policy", "critic"); ranks are keyed by (name, rank).
    - ``process_group``: the group to release on teardown (default: the world group).
    - ``rank``/``world_size``: optional, checked against torch.distributed.
    - ``shard``: which part of the state this rank holds; ranks with the same shard are
      replicas of each other and only one of them saves it. Default: the rank itself (every
      rank saves its own state - always correct, never the cheapest; pure data parallel
      training should pass one shard for all, e.g. ``shard="model"``).
    - ``saver(path, step)``: writes this rank's state at ``path``; or ``state_dict``: a callable
      returning what the default saver (``torch.save``) writes.
    - ``load_state_dict(state)``: puts a loaded ``state_dict()`` back (a warm restart's rank
      that does not hold the committed step itself; docs/worker.md, "Warm restart").
    """
    if saver is not None and state_dict is not None:
        raise SetupError("pass saver= or state_dict=, not both")
    for label, fn in (
        ("saver", saver),
        ("state_dict", state_dict),
        ("load_state_dict", load_state_dict),
    ):
        if fn is not None and not callable(fn):
            raise SetupError(f"{label}={fn!r} is not callable")
        if fn is not None and inspect.iscoroutinefunction(fn):
            raise SetupError(f"{label} must be a plain function, not 'async def'")
    if state_dict is not None:
        provider = state_dict

        def saver(path: str, step: int) -> tuple[int, int]:
            return save_state_dict({"step": step, "state": provider()}, path)

    elif isinstance(saver, DcpSaver):  # its files serve the memory tier and a warm restart
        state_dict = saver.in_memory
        load_state_dict = load_state_dict or saver.restore

    return register_rank(
        name,
        process_group,
        rank,
        world_size,
        shard,
        saver,
        config,
        state=state_dict,
        load_state=load_state_dict,
    )


def register_rank(
    name: str,
    process_group: Any,
    rank: int | None,
    world_size: int | None,
    shard: str | int | None,
    saver: Saver | None,
    config: GracefulConfig | None,
    release_only: bool = False,
    train_fn_saves: bool = False,
    state: Callable[[], Any] | None = None,
    load_state: Callable[[Any], Any] | None = None,
) -> SetupStatus:
    """Register one (group, rank) of this process; the one path every adopter takes.

    ``release_only``: an extra group (weight sync), released on teardown but not planned for.
    ``train_fn_saves``: the training function saves at its step boundary (Ray Train,
    ``train.py``), so an order stops the loop instead of starting a save here.
    """
    runtime = process_runtime()
    cfg = runtime.adopt_config(config)
    try:
        cfg.check_checkpoint_dir("graceful_setup")  # at setup, not at the eviction
    except ConfigError as exc:
        raise SetupError(str(exc)) from None
    if shard is not None and (not isinstance(shard, (str, int)) or isinstance(shard, bool)):
        raise SetupError(f"shard={shard!r} is not allowed: give a str or an int.")
    handle = resolve_group(name, process_group, rank, world_size)
    shard_key = str(handle.rank) if shard is None else str(shard)
    with runtime.lock:
        existing = runtime.registrations.get(handle.key)
        if existing is not None and existing.group.process_group is not handle.process_group:
            raise SetupError(
                f"group {name!r} rank {handle.rank} is already registered with another process "
                "group; give each group its own name."
            )
        if existing is None:
            runtime.registrations[handle.key] = Registration(
                handle, shard_key, saver, release_only, train_fn_saves, state, load_state
            )
        else:
            existing.saver = saver or existing.saver
            existing.state = state if saver is not None else existing.state
            existing.shard = shard_key
            existing.train_fn_saves = train_fn_saves
            existing.load_state = load_state or existing.load_state
    runtime.step(Registered(train_fn_saves))
    installed, listener = listener_status(cfg)
    control = connect(runtime, cfg) if not release_only else "extra group: released only"
    return SetupStatus(
        group=handle.name,
        rank=handle.rank,
        world_size=handle.world_size,
        backends=handle.backends,
        rank_source=handle.source,
        shard=shard_key,
        can_save=saver is not None or train_fn_saves,
        listener_installed=installed,
        listener=listener,
        control=control,
        notes=tuple(handle.notes),
    )


def should_stop(step: int | None = None) -> bool:
    """True once a teardown began: leave the training loop at this step boundary.

    Pass the number of completed steps, right after the optimizer step. Once a teardown began,
    the call parks here until this rank's emergency save is done (bounded by the deadline) and
    then returns True: the save holds exactly the state after ``step`` and is labelled with it.
    Until then it costs a flag read (and two stores when ``step`` is given).

    It returns False once after a teardown began where the group agreed to stop one step later
    (a peer was already inside that step when the order came): train that step, and the next
    call parks (``stop_step.py``).
    """
    runtime = process_runtime()
    if step is not None:
        runtime.loop.mark(step)
    if runtime.late.waiting:  # a held step's copy waits for the group's first step: this one
        runtime.late.go()
    if not runtime.stop_event.is_set():
        return False
    if step is not None:
        return runtime.loop.park(step, runtime.teardown)
    return True


def add_process_group(process_group: Any, name: str) -> None:
    """Register an extra group (weight sync, a second role) to release on teardown."""
    if process_group is None:
        raise SetupError("add_process_group needs a process group, got None")
    register_rank(name, process_group, None, None, None, None, None, release_only=True)


def teardown_now(trigger: str = "requested", exit_process: bool = True) -> Teardown:
    """Start this process's teardown as if it had been signalled (tests, custom notices)."""
    runtime = process_runtime()
    if not runtime.registrations:
        raise SetupError("teardown_now(): nothing is registered in this process")
    runtime.step(TeardownRequested(trigger, time.time(), exit_process))
    if runtime.teardown is None:
        raise SetupError(
            f"teardown_now(): this process is {runtime.phase()}, not training: its "
            "ending is already decided (a Ray Train stop, or a rejoin under way)"
        )
    return runtime.teardown
