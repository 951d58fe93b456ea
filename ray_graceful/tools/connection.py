"""How a CLI command reaches a cluster and a job's coordinator, failing fast and plainly.

A HOST:PORT nobody listens on is refused at once (``ray.init`` would retry for a minute), and
every failure is a ``CliError`` with its exit status: 3 no Ray cluster, 4 no coordinator.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from ..config import GracefulConfig
from .arguments import EXIT_NO_CLUSTER, EXIT_NO_COORDINATOR, EXIT_USAGE, CliError


def job_config(args: argparse.Namespace) -> GracefulConfig:
    overrides = {}
    if getattr(args, "coordinator", None):
        overrides["coordinator_name"] = args.coordinator
    if getattr(args, "namespace", None):
        overrides["coordinator_namespace"] = args.namespace
    return GracefulConfig.from_env(**overrides)


def init_ray(args: argparse.Namespace) -> None:
    import ray

    check_reachable(args.address, args.timeout)
    try:
        ray.init(address=args.address, log_to_driver=False, logging_level=logging.ERROR)
    except Exception as exc:  # ConnectionError, a missing cluster, auth: all the same here
        raise CliError(
            f"no Ray cluster reachable at {args.address!r}: {exc}", EXIT_NO_CLUSTER
        ) from exc


def connect_coordinator(args: argparse.Namespace, config: GracefulConfig) -> Any:
    from ..coordinator import Coordinator

    init_ray(args)
    try:
        return Coordinator.connect(config, timeout=args.timeout, job_id=args.job)
    except ValueError as exc:
        raise CliError(
            f"no coordinator to talk to in namespace {config.coordinator_namespace!r}: {exc}. "
            "Is a job with ray_graceful running? (--job, --coordinator, --namespace pick one)",
            EXIT_NO_COORDINATOR,
        ) from exc
    except Exception as exc:  # it died, or timed out answering
        raise CliError(f"the coordinator did not answer: {exc}", EXIT_NO_COORDINATOR) from exc


def check_reachable(address: str, timeout: float) -> None:
    """Fail fast on a HOST:PORT nobody listens on (ray.init would retry for a minute).

    Only "auto", "local" and ``ray://`` addresses skip it; ``localhost:6379`` is a HOST:PORT
    like any other (it once skipped the check and hung).
    """
    import socket

    host, sep, port = address.rpartition(":")
    if address in ("auto", "local") or address.startswith("ray://"):
        return
    if not sep or not host or not port.isdigit():
        raise CliError(
            f"--address {address!r}: give HOST:PORT (the GCS address), auto, local or "
            "ray://HOST:PORT",
            EXIT_USAGE,
        )
    try:
        with socket.create_connection((host, int(port)), timeout=max(timeout, 0.5)):
            pass
    except OSError as exc:
        raise CliError(f"no Ray cluster reachable at {address!r}: {exc}", EXIT_NO_CLUSTER) from exc


def connect_every_coordinator(args: argparse.Namespace, config: GracefulConfig) -> list[Any]:
    """Every job's coordinator in the namespace (a node notice concerns them all)."""
    from ..coordinator import Coordinator

    init_ray(args)
    coordinators = Coordinator.connect_all(config)
    if not coordinators:
        raise CliError(
            f"no coordinator to talk to in namespace {config.coordinator_namespace!r}. Is a "
            "job with ray_graceful running? (--job, --coordinator, --namespace pick one)",
            EXIT_NO_COORDINATOR,
        )
    return coordinators
