"""ray_graceful: bounded, clean, reported endings for distributed PyTorch training on Ray.

Worker side (this module's most used names)::

    class MyWorker(GracefulWorkerMixin, BaseWorker):      # the undecorated base class
        def init(self):
            torch.distributed.init_process_group(...)
            self.graceful_setup("policy", shard="model")  # one call, right after

See README.md and docs/ for the coordinator, Ray Train, Anyscale and the CLI.
"""

from .checkpoint import (
    CheckpointError,
    CommittedCheckpoint,
    ShardRecord,
    latest_committed,
    load_state_dict,
    save_state_dict,
)
from .config import ConfigError, GracefulConfig
from .process_groups import SetupError
from .teardown import StepRecord, TeardownReport, read_reports
from .worker import (
    GracefulSetupWarning,
    GracefulWorkerMixin,
    SetupStatus,
    add_process_group,
    after_init_process_group,
    install_signal_handling,
    should_stop,
    teardown_now,
)

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "CommittedCheckpoint",
    "ConfigError",
    "GracefulConfig",
    "GracefulSetupWarning",
    "GracefulWorkerMixin",
    "SetupError",
    "SetupStatus",
    "ShardRecord",
    "StepRecord",
    "TeardownReport",
    "__version__",
    "add_process_group",
    "after_init_process_group",
    "install_signal_handling",
    "latest_committed",
    "load_state_dict",
    "read_reports",
    "save_state_dict",
    "should_stop",
    "teardown_now",
]
