"""The one place that reads Ray's drain state (private API: RAY_FACTS).

A node being drained (``ray start --block`` on SIGTERM, the autoscaler, KubeRay) is listed by
the GCS with its deadline: ``{node_id_hex: deadline_ms}``, 0 meaning no deadline. It is the
dependable notice on Ray - the worker's own SIGTERM comes in the same millisecond as SIGKILL.
Ray Train's preemption watcher reads the same state.
"""

from __future__ import annotations

from typing import Any


class DrainStateUnavailable(RuntimeError):
    """This Ray offers no way to read the drain state."""


def draining_nodes(timeout_s: float = 5.0) -> dict[str, int]:
    """``{node_id_hex: deadline_ms}`` for every node the GCS is draining (0 = no deadline)."""
    import ray

    errors: list[str] = []
    gcs_client: Any = getattr(ray._private.worker.global_worker, "gcs_client", None)
    if gcs_client is not None:
        try:
            return _normalise(gcs_client.get_draining_nodes(timeout=timeout_s))
        except (AttributeError, TypeError) as exc:
            errors.append(f"GcsClient.get_draining_nodes: {exc}")
    state = getattr(getattr(ray._private, "state", None), "state", None)
    if state is not None and hasattr(state, "get_draining_nodes"):
        return _normalise(state.get_draining_nodes())
    raise DrainStateUnavailable("cannot read Ray's drain state: " + "; ".join(errors or ["no API"]))


def _normalise(raw: Any) -> dict[str, int]:
    out = {}
    for node, deadline in dict(raw).items():
        key = node.hex() if isinstance(node, bytes) else str(node)
        out[key] = int(deadline)
    return out


def drain_node(node_id: str, deadline_s: float, reason: str = "ray_graceful test") -> bool:
    """Ask the GCS to drain ``node_id`` with reason PREEMPTION (tests, the demo, benchmarks)."""
    import ray
    from ray.core.generated import autoscaler_pb2

    gcs_address = ray._private.worker.global_worker.gcs_client.address
    client = ray._raylet.GcsClient(address=gcs_address)
    accepted, message = client.drain_node(
        node_id,
        autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
        reason,
        int(deadline_s * 1000),
    )
    if not accepted:
        raise RuntimeError(f"the GCS refused to drain {node_id}: {message}")
    return True
