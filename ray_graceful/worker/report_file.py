"""What a rank's teardown did: the ``TeardownReport``, and where it is written.

One report per process: each step with its status (ran / skipped with the reason / failed with
the error / interrupted by the watchdog), its start and duration; the shards it saved; how the
process left. It is written as JSON under ``report_dir/<job id>/`` with os-level calls only
(the watchdog writes it too, from a thread that must not take ``logging``'s lock), printed as
one log line, and sent to the coordinator, which puts every rank's report in the outcome.
"""

from __future__ import annotations

import json
import logging
import os

from ..checkpoint import CheckpointError
from ..protocol import ExitPath, PhaseRecord, TeardownReport

logger = logging.getLogger(__name__)

__all__ = ["ExitPath", "PhaseRecord", "Skip", "TeardownReport", "read_reports", "write_report_file"]

LOG_PREFIX = "ray_graceful teardown "


class Skip(Exception):
    """Raised by a teardown step to record itself as skipped, with the reason."""


def write_report_file(report: TeardownReport, report_dir: str) -> str | None:
    """Write the report JSON with os-level calls only (the watchdog uses this too)."""
    try:
        directory = os.path.join(report_dir, report.job_id or "no-job")
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"teardown-{report.hostname}-{report.pid}.json")
        tmp = f"{path}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, report.to_json().encode())
        finally:
            os.close(fd)
        os.replace(tmp, path)
        return path
    except OSError:
        return None


def read_reports(report_dir: str, job_id: str | None = None) -> list[TeardownReport]:
    """Every TeardownReport under ``report_dir`` (for one job, if given), oldest first.

    A file that is not a report (torn, edited, another version) is skipped with a warning.
    """
    reports = []
    roots = (
        [os.path.join(report_dir, job_id)]
        if job_id
        else [os.path.join(report_dir, d) for d in sorted(os.listdir(report_dir))]
        if os.path.isdir(report_dir)
        else []
    )
    for root in roots:
        if not os.path.isdir(root):
            continue
        for name in sorted(os.listdir(root)):
            if name.startswith("teardown-") and name.endswith(".json"):
                path = os.path.join(root, name)
                try:
                    with open(path) as f:
                        reports.append(TeardownReport.from_dict(json.load(f)))
                except (OSError, ValueError, TypeError, KeyError, CheckpointError) as exc:
                    logger.warning(
                        "ray_graceful: skipped report %s: not a teardown report (%s: %s)",
                        path,
                        type(exc).__name__,
                        str(exc)[:200],
                    )
    return sorted(reports, key=lambda r: r.started_at)


def ray_identity() -> dict[str, str]:
    """Job id and node id when running inside Ray, else empty strings."""
    try:
        import ray

        if ray.is_initialized():
            ctx = ray.get_runtime_context()
            return {"job_id": ctx.get_job_id() or "", "node_id": ctx.get_node_id() or ""}
    except Exception:
        pass
    return {"job_id": "", "node_id": ""}
