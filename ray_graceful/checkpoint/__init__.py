"""The emergency-checkpoint protocol: shards land atomically, a manifest written last commits.

Layout under a checkpoint root::

    step-00000120/
        shard-<key>.pt          one per shard, each renamed into place only once complete
        MANIFEST.json           written last, by the coordinator: the checkpoint is committed

- ``records``: what a checkpoint is made of (``ShardRecord``, ``CommittedCheckpoint``, paths);
- ``files``: durable bytes (save, fsync, checksum, load; only plain files are ever opened);
- ``write``: a rank's shard lands atomically, the coordinator's manifest commits;
- ``read``: which committed checkpoint a restart loads (``latest_committed``), verified.

A checkpoint is either complete and listed, or not listed at all, and a committed one is never
touched again.
"""

from .files import fsync_path, load_state_dict, not_plain, save_state_dict, sync_and_checksum
from .read import latest_committed, load_committed_shard, scan_checkpoints
from .records import (
    FORMAT_VERSION,
    MANIFEST,
    CheckpointError,
    CommittedCheckpoint,
    ShardRecord,
    shard_file_name,
    shard_key,
    step_dir,
)
from .write import check_shard_set, commit, write_shard

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST",
    "CheckpointError",
    "CommittedCheckpoint",
    "ShardRecord",
    "check_shard_set",
    "commit",
    "fsync_path",
    "latest_committed",
    "load_committed_shard",
    "load_state_dict",
    "not_plain",
    "save_state_dict",
    "scan_checkpoints",
    "shard_file_name",
    "shard_key",
    "step_dir",
    "sync_and_checksum",
    "write_shard",
]
