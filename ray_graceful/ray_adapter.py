"""Every Ray-private call ray_graceful makes, in one place.

Ray offers no public API for what the plugin needs at a node's end: the drain state with its
deadline, the GCS actor table, an intended exit from a worker thread, the job-wide setup-hook
variable, the point where a worker installs its SIGTERM handler, and Ray Train V2's worker
callbacks. Each is reached here and nowhere else, so that when Ray moves one the failure is a
``RayInternalsMoved`` naming the internal and the versions it was checked against - not an
``AttributeError`` deep in a teardown.

Checked against Ray 2.51 - 2.60 (the range ``pyproject.toml`` allows): CI runs on both ends
(``.ci/versions.sh``); measured on 2.60.0.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

CHECKED_RAY_VERSIONS = "2.51 - 2.60"

# Ray reads this variable (``ray/_private/worker.py``) for the job-wide worker setup hook; it is
# what an Anyscale job can set through env_vars (its JobConfig has no runtime_env).
SETUP_HOOK_ENV_VAR = "__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR"


class RayInternalsMoved(RuntimeError):
    """A Ray internal this plugin relies on is missing or changed in the installed Ray."""


def _moved(what: str, exc: BaseException | None = None) -> RayInternalsMoved:
    import ray

    detail = f" ({type(exc).__name__}: {exc})" if exc is not None else ""
    return RayInternalsMoved(
        f"ray_graceful needs Ray's {what}, which Ray {ray.__version__} does not offer{detail}; "
        f"it was checked against Ray {CHECKED_RAY_VERSIONS}."
    )


# --- drain state -----------------------------------------------------------------------------


def draining_nodes(timeout_s: float = 5.0) -> dict[str, int]:
    """``{node_id_hex: deadline_ms}`` for every node the GCS is draining (0 = no deadline).

    The dependable notice on Ray (measured, 2.60): a worker's own SIGTERM comes in the same
    millisecond as its SIGKILL. Ray Train's preemption watcher reads the same state.
    """
    import ray

    gcs_client: Any = getattr(ray._private.worker.global_worker, "gcs_client", None)
    if gcs_client is not None and hasattr(gcs_client, "get_draining_nodes"):
        return _normalise_drains(gcs_client.get_draining_nodes(timeout=timeout_s))
    state = getattr(getattr(ray._private, "state", None), "state", None)
    if state is not None and hasattr(state, "get_draining_nodes"):
        return _normalise_drains(state.get_draining_nodes())
    raise _moved("drain state (GcsClient.get_draining_nodes)")


def _normalise_drains(raw: Any) -> dict[str, int]:
    out = {}
    for node, deadline in dict(raw).items():
        key = node.hex() if isinstance(node, bytes) else str(node)
        out[key] = int(deadline)
    return out


def drain_node(node_id: str, deadline_s: float, reason: str = "ray_graceful") -> None:
    """Ask the GCS to drain ``node_id`` with reason PREEMPTION (the demo, benchmarks, tests)."""
    import ray

    try:
        from ray.core.generated import autoscaler_pb2

        gcs_address = ray._private.worker.global_worker.gcs_client.address  # type: ignore[attr-defined]
        client = ray._raylet.GcsClient(address=gcs_address)  # type: ignore[attr-defined]
        preemption = autoscaler_pb2.DrainNodeReason.Value(  # type: ignore[attr-defined]
            "DRAIN_NODE_REASON_PREEMPTION"
        )
    except (AttributeError, ImportError, ValueError) as exc:
        raise _moved("GcsClient.drain_node", exc) from exc
    accepted, message = client.drain_node(node_id, preemption, reason, int(deadline_s * 1000))
    if not accepted:
        raise RuntimeError(f"the GCS refused to drain {node_id}: {message}")


def raylet_address(node_id: str) -> tuple[str, int] | None:
    """The address and port of ``node_id``'s raylet while Ray lists it alive (``ray.nodes()``)."""
    import ray

    for node in ray.nodes():
        if node.get("NodeID") == node_id and node.get("Alive"):
            return str(node["NodeManagerAddress"]), int(node["NodeManagerPort"])
    return None


def node_ip_address() -> str:
    """This node's IP address as Ray knows it (where a listener other nodes reach binds)."""
    import ray

    return ray.util.get_node_ip_address()


def current_node_id() -> str:
    """This process's Ray node id ("" outside Ray)."""
    try:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
    except Exception:
        return ""


def current_actor_id() -> str:
    """This actor's Ray id, hex ("" outside an actor): a restart of the actor keeps it."""
    try:
        import ray

        return (ray.get_runtime_context().get_actor_id() or "") if ray.is_initialized() else ""
    except Exception:
        return ""


def actor_id_of(handle: Any) -> str:
    """The Ray id (hex) of the actor behind ``handle``: ``ActorHandle._actor_id``, a property
    Ray keeps private (no public accessor in 2.60). A handle without one raises
    ``RayInternalsMoved``."""
    try:
        return str(handle._actor_id.hex())
    except AttributeError as exc:
        raise _moved("ActorHandle._actor_id", exc) from exc


def actor_was_restarted() -> bool:
    """Whether this actor is a restart of one whose process died (``max_restarts``).

    ``RuntimeContext.was_current_actor_reconstructed`` is public, but reads a deprecated
    property inside (a warning on every call, Ray 2.60): silenced here.
    """
    import warnings

    try:
        import ray

        if not ray.is_initialized():
            return False
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return bool(ray.get_runtime_context().was_current_actor_reconstructed)
    except Exception:
        return False


def call_self(method: str) -> None:
    """From inside an actor (its ``__init__``, or a thread of its own): queue a call of its own
    ``method``, which runs as any call does - on the actor's executor, not the caller's thread."""
    import ray

    getattr(ray.get_runtime_context().current_actor, method).remote()


# --- the actor table -------------------------------------------------------------------------


# Up to this many actors, one GCS lookup each; more, one call per Ray job for its DEAD actors.
ONE_CALL_ABOVE = 64


def _actor_table() -> Callable[..., dict[str, Any]]:
    """``ray._private.state.state.actor_table``: one actor's record by id, or every actor's
    (filtered by job and state) with None."""
    import ray

    state = getattr(getattr(ray._private, "state", None), "state", None)
    if state is None or not hasattr(state, "actor_table"):
        raise _moved("GCS actor table (ray._private.state.state.actor_table)")
    return state.actor_table


def dead_actors(actor_ids: set[str], one_call_above: int = ONE_CALL_ABOVE) -> set[str]:
    """Which of ``actor_ids`` the GCS lists as DEAD (the state API needs the dashboard).

    A coordinator asks this for every rank actor of its job every ``drain_poll_interval_s``: one
    lookup per actor was 16,384 GCS calls a round at 16,384 ranks. Past ``one_call_above`` ids it
    asks once per Ray job the ids belong to (an actor id carries its job's id) for that job's
    DEAD actors - filtered by the GCS, so the answer is only what died in those jobs."""
    import ray

    actor_table = _actor_table()
    if len(actor_ids) <= one_call_above:
        dead = set()
        for actor_id in actor_ids:
            info = actor_table(actor_id)
            if info and info.get("State") == "DEAD":
                dead.add(actor_id)
        return dead
    by_job: dict[Any, set[str]] = {}
    for actor_id in actor_ids:
        by_job.setdefault(ray.ActorID.from_hex(actor_id).job_id, set()).add(actor_id)
    found: set[str] = set()
    for job_id, ids in by_job.items():
        found |= ids & set(actor_table(None, job_id=job_id, actor_state_name="DEAD"))
    return found


def live_actors() -> int:
    """Diagnostics: how many actors the GCS lists as ALIVE (what a soak watches for leaks)."""
    return sum(info.get("State") == "ALIVE" for info in _actor_table()(None).values())


def live_actor_pids(class_name: str) -> list[int]:
    """Diagnostics: the processes of the live actors of class ``class_name`` (tests find Ray
    Train's controller with it; the state API needs the dashboard)."""
    return [
        int(info["Pid"])
        for info in _actor_table()(None).values()
        if info.get("State") == "ALIVE" and info.get("ActorClassName") == class_name
    ]


# --- diagnostics: how worker processes ended (tests and benchmarks count crashes with it) -----


def worker_exits(pids: set[int]) -> dict[int, str]:
    """Diagnostics: how Ray recorded the end of each dead worker in ``pids`` (its exit type).

    "INTENDED_SYSTEM_EXIT", "INTENDED_USER_EXIT", "USER_ERROR", "SYSTEM_ERROR", ... from the
    GCS worker table; a pid not there (or still alive) is left out.
    """
    return {pid: kind for pid, (kind, _detail) in worker_exit_details(pids).items() if kind}


def worker_exit_details(pids: set[int]) -> dict[int, tuple[str | None, str]]:
    """(exit type or None, exit detail) that the GCS recorded for each dead worker in ``pids``."""
    import ray

    try:
        from ray.core.generated import common_pb2, gcs_pb2

        rows = _gcs_state_accessor(ray._private.state.state).get_worker_table()
    except Exception as exc:
        raise _moved("GCS worker table (ray._private.state's accessor)", exc) from exc
    out: dict[int, tuple[str | None, str]] = {}
    for raw in rows:
        worker = gcs_pb2.WorkerTableData.FromString(raw)  # type: ignore[attr-defined]
        if worker.pid in pids and not worker.is_alive:
            kind = (
                common_pb2.WorkerExitType.Name(worker.exit_type)  # type: ignore[attr-defined]
                if worker.HasField("exit_type")
                else None
            )
            out[worker.pid] = (kind, worker.exit_detail)
    return out


def _gcs_state_accessor(state: Any) -> Any:
    """The GCS accessor of ``ray._private.state.state``: ``_connect_and_get_accessor()`` in
    Ray 2.60, ``_check_connected()`` then ``global_state_accessor`` in Ray 2.51 - 2.5x."""
    connect = getattr(state, "_connect_and_get_accessor", None)
    if callable(connect):
        return connect()
    state._check_connected()
    return state.global_state_accessor


def available_resources_per_node() -> dict[str, dict[str, float]]:
    """node id -> the resources free on it now (what is taken tells where work runs)."""
    import ray

    state = getattr(ray._private, "state", None)
    if state is None or not hasattr(state, "available_resources_per_node"):
        raise _moved("available resources (ray._private.state.available_resources_per_node)")
    return state.available_resources_per_node()


# --- leaving a worker ------------------------------------------------------------------------


def _worker_core() -> Any | None:
    """This process's Ray core worker where it is a Ray worker process, else None."""
    try:
        import ray

        worker = ray._private.worker.global_worker
        if not ray.is_initialized() or worker.mode != ray.WORKER_MODE:
            return None
        return worker.core_worker  # type: ignore[attr-defined]
    except Exception:
        return None


def intended_exit() -> Callable[[str], None] | None:
    """Ray's way to end this worker as an intended exit, or None outside a Ray worker.

    Calling it makes Ray end the process with status 0, recorded INTENDED_SYSTEM_EXIT, once the
    running task returned. Nothing may use Ray after calling it.
    """
    drain = getattr(_worker_core(), "drain_and_exit_worker", None)
    if drain is None:
        return None
    return lambda detail: drain("intentional_system_exit", detail.encode())


# The thread Ray's core worker runs its main io service on (``core_worker_process.cc``). It
# stops after the worker told the raylet its exit is intended and flushed its task events.
_CORE_WORKER_IO_THREAD = "worker.io"


def core_worker_stopped_check() -> Callable[[], bool] | None:
    """A check that turns true once this process's Ray core worker has shut down; None where
    that cannot be seen (no such thread: another Ray, not Linux, not a Ray worker).

    Take it before requesting the intended exit. Seen on Ray 2.60: after the io thread stops,
    the core worker's destructor joins gRPC's client poll threads, and one with a call still in
    flight (seen once the worker has called another actor) leaves only at its next 250 ms
    deadline - 0.25 s of a rank's exit, with nothing of Ray's record left to make: the raylet
    already holds the intended exit, the task events are flushed.
    """
    tasks = "/proc/self/task"
    try:
        tids = [
            tid for tid in os.listdir(tasks) if _thread_name(tasks, tid) == _CORE_WORKER_IO_THREAD
        ]
    except OSError:
        return None
    if not tids:
        return None
    return lambda: not any(os.path.exists(os.path.join(tasks, tid)) for tid in tids)


def _thread_name(tasks: str, tid: str) -> str:
    try:
        with open(os.path.join(tasks, tid, "comm")) as f:
            return f.read().strip()
    except OSError:
        return ""


def forced_intended_exit() -> Callable[[], None] | None:
    """Ray's way to end this actor at once, recorded as an intended exit; None where none.

    ``intended_exit`` needs the running task to return; this does not. It is what
    ``ray.kill(self)`` does: the GCS tells this worker's core worker - on its own IO thread -
    to disconnect as INTENDED_SYSTEM_EXIT and quit (status 1: Ray's ``QuickExit``). No restart.
    Only an actor has it (a task worker has no actor id to kill).
    """
    core = _worker_core()
    try:
        actor_id = core.get_actor_id() if core is not None else None
    except Exception:
        return None
    if core is None or actor_id is None or actor_id.is_nil():
        return None
    return lambda: core.kill_actor(actor_id, True)


def is_ray_worker_sigterm_handler(handler: Any) -> bool:
    """Ray's worker SIGTERM handler: raises SystemExit(1), recorded as a SYSTEM_ERROR exit."""
    return (
        callable(handler)
        and getattr(handler, "__module__", "") == "ray._private.worker"
        and "sigterm_handler" in getattr(handler, "__qualname__", "")
    )


def route_worker_sigterm_handler(adopt: Callable[[Any], bool]) -> None:
    """Offer the SIGTERM handler Ray's worker loop installs to ``adopt`` first.

    Ray's ``Worker.main_loop`` installs its handler right after the job's setup hook ran; left
    alone it would replace the plugin's. ``adopt(handler)`` returns True when it took the handler
    (to chain it); otherwise Ray installs it as usual.
    """
    try:
        import ray._private.utils as ray_utils

        original = ray_utils.set_sigterm_handler
    except (ImportError, AttributeError) as exc:
        raise _moved("ray._private.utils.set_sigterm_handler", exc) from exc
    if getattr(original, "_ray_graceful", False):
        return

    def set_sigterm_handler(handler):  # type: ignore[no-untyped-def]
        if threading.current_thread() is threading.main_thread() and adopt(handler):
            return
        original(handler)

    set_sigterm_handler._ray_graceful = True  # type: ignore[attr-defined]
    ray_utils.set_sigterm_handler = set_sigterm_handler


# --- Ray Train V2 ------------------------------------------------------------------------------


def train_callback_bases() -> tuple[type, ...]:
    """Ray Train V2's (DeveloperAPI) callback classes the plugin's callback subclasses."""
    try:
        from ray.train.v2._internal.execution.callback import (
            ControllerCallback,
            WorkerCallback,
            WorkerGroupCallback,
        )
    except ImportError as exc:
        what = "Ray Train V2 callbacks (ray.train.v2._internal.execution.callback)"
        raise _moved(what, exc) from exc
    return (WorkerGroupCallback, WorkerCallback, ControllerCallback)


def train_worker_nodes(workers: list[Any]) -> tuple[set[str], int]:
    """The nodes of Ray Train V2's ``Worker``s (``before_init_train_context``'s, DeveloperAPI:
    ``metadata.node_id``, ``distributed_context.world_size``) and their group's world size."""
    nodes = {str(w.metadata.node_id) for w in workers}
    sizes = [w.distributed_context.world_size for w in workers if w.distributed_context]
    return nodes, max(sizes, default=len(workers))


def train_torch_backend() -> tuple[type, type | None]:
    """Ray Train's torch backend (``_TorchBackend``, private: what ``TorchConfig`` forms the
    process group with) and V2's ``ReplicaGroup`` - the worker group a replacement's
    ``on_start`` is given - or None where Ray has no replica groups (before 2.56)."""
    try:
        from ray.train.torch.config import _TorchBackend
    except ImportError as exc:
        raise _moved("ray.train.torch.config._TorchBackend", exc) from exc
    try:
        from ray.train.v2._internal.execution.worker_group import ReplicaGroup
    except ImportError:
        return _TorchBackend, None
    return _TorchBackend, ReplicaGroup


def wait_train_reports_collected(timeout_s: float) -> bool:
    """Wait until Ray Train's controller has taken this worker's reports; False if not in time.

    A worker's ``ray.train.report`` only queues the report; the controller takes it at its
    next poll of the worker. A rank that raises and exits before that poll loses it - and
    with it the emergency checkpoint, which Ray Train registers only once every rank's report
    arrived. Ray Train 2.60 marks a report taken with ``task_done`` on the worker's result
    queue (``worker.py: poll_status``); where that queue is not found, False at once.
    """
    import time

    try:
        from ray.train.v2._internal.execution.context import get_train_context

        queue = get_train_context().execution_context.result_queue
    except Exception:
        return False
    deadline = time.monotonic() + max(timeout_s, 0.0)
    while queue.unfinished_tasks:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True
