"""ray_graceful: bounded, clean, reported endings for distributed PyTorch training on Ray.

Worker side::

    class MyWorker(GracefulWorkerMixin, BaseWorker):      # the undecorated base class
        def init(self):
            torch.distributed.init_process_group(...)
            self.graceful_setup("policy", shard="model")  # one call, right after

Driver side::

    coordinator = ray_graceful.Coordinator.start(GracefulConfig(checkpoint_dir=...))
    ...
    outcome = coordinator.wait_outcome(timeout=60)

See README.md and docs/ for Ray Train, Anyscale, Kubernetes, SLURM and the CLI.
"""

import logging

from .checkpoint import (
    CheckpointError,
    CommittedCheckpoint,
    ShardRecord,
    latest_committed,
    load_state_dict,
    save_state_dict,
)
from .config import ConfigError, GracefulConfig
from .coordinator import Coordinator
from .dcp import dcp_saver
from .health import DEGRADED, FAULTY, HEALTHY, UNKNOWN, HealthProbe, HealthReport, Reason
from .memory.handoff import LoadedShard, MemoryTierError
from .notices import EvictionNotice, NoticeError
from .outcome import TerminationOutcome
from .plan import RankInfo, RankPlan, TerminationPlan, TopologyError, plan_termination
from .protocol import Rejoined
from .warm_group import WarmGroup, WarmRestart, WarmRestartFailed, WarmRestartInProgress
from .worker.mixin import GracefulWorkerMixin
from .worker.process_groups import SetupError
from .worker.rejoin import rejoin
from .worker.report_file import PhaseRecord, TeardownReport, read_reports
from .worker.restore import load_latest
from .worker.setup import (
    GracefulSetupWarning,
    SetupStatus,
    add_process_group,
    after_init_process_group,
    install_signal_handling,
    should_stop,
    teardown_now,
)
from .worker.spare_wait import SpareResult, wait_as_spare

# The one place the version is written: pyproject.toml reads it, and so do the Anyscale option's
# pin, the dashboard and `ray-graceful --version` (tests/test_layout.py holds CHANGELOG.md and the
# examples to it).
__version__ = "0.3.0"


def _default_logging() -> None:
    """Give the package's loggers a stderr handler, as Ray does for its own "ray" logger.

    Ray's worker processes configure no root handler, so without this the coordinator's plan
    and the workers' warnings would be dropped. A program that configures "ray_graceful" (or
    the root logger) itself keeps its own.
    """
    logger = logging.getLogger("ray_graceful")
    if logger.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)


_default_logging()

__all__ = [
    "DEGRADED",
    "FAULTY",
    "HEALTHY",
    "UNKNOWN",
    "CheckpointError",
    "CommittedCheckpoint",
    "ConfigError",
    "Coordinator",
    "EvictionNotice",
    "GracefulConfig",
    "GracefulSetupWarning",
    "GracefulWorkerMixin",
    "HealthProbe",
    "HealthReport",
    "LoadedShard",
    "MemoryTierError",
    "NoticeError",
    "PhaseRecord",
    "RankInfo",
    "RankPlan",
    "Reason",
    "Rejoined",
    "SetupError",
    "SetupStatus",
    "ShardRecord",
    "SpareResult",
    "TeardownReport",
    "TerminationOutcome",
    "TerminationPlan",
    "TopologyError",
    "WarmGroup",
    "WarmRestart",
    "WarmRestartFailed",
    "WarmRestartInProgress",
    "__version__",
    "add_process_group",
    "after_init_process_group",
    "dcp_saver",
    "install_signal_handling",
    "latest_committed",
    "load_latest",
    "load_state_dict",
    "plan_termination",
    "read_reports",
    "rejoin",
    "save_state_dict",
    "should_stop",
    "teardown_now",
    "wait_as_spare",
]
