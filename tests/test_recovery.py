"""A restarted coordinator's reading of the disk (``coordinator/recovery.py``), without Ray.

The files are real: shards written by ``write_shard`` as a rank writes them, the in-flight
record as the shell writes it, manifests read back by ``latest_committed``. The restart itself,
with real ranks and a SIGKILLed coordinator, is ``tests/faults/test_coordinator_faults.py``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from pathlib import Path

import pytest

from ray_graceful import latest_committed
from ray_graceful.checkpoint import (
    ShardRecord,
    commit,
    save_state_dict,
    shard_file_name,
    write_shard,
)
from ray_graceful.coordinator import recovery
from ray_graceful.outcome import TerminationOutcome
from ray_graceful.protocol import Result

pytestmark = pytest.mark.unit

SHARDS = ("trainer/0", "trainer/1")


def save(root: str, step: int, shard: str) -> None:
    write_shard(root, step, shard, lambda path, s: save_state_dict({"step": s}, path))


def left(tmp_path, tier="disk", opened_at=None, **kw) -> recovery.InFlight:
    now = time.time()
    return recovery.InFlight(
        cycle=kw.pop("cycle", 3),
        job_id="job",
        opened_at=now - 1 if opened_at is None else opened_at,
        deadline=now,
        tier=tier,
        root=str(tmp_path / "ckpt"),
        expected=SHARDS,
        **kw,
    )


def test_every_shard_on_disk_at_one_step_is_committed_from_there(tmp_path):
    cycle = left(tmp_path)
    for shard in SHARDS:
        save(cycle.root, 7, shard)
    outcome = recovery.conclude_from_disk(cycle)
    assert outcome.result == Result.COMMITTED, outcome.reason
    assert "restarted during cycle 3" in outcome.reason
    latest = latest_committed(cycle.root, verify_checksums=True)
    assert latest is not None and latest.step == 7 and sorted(latest.shards) == list(SHARDS)
    assert outcome.committed == {"step": 7, "path": latest.path}
    assert outcome.resume_from == {"step": 7, "path": latest.path}


def test_a_missing_shard_abandons_and_names_it(tmp_path):
    cycle = left(tmp_path)
    save(cycle.root, 7, "trainer/0")
    outcome = recovery.conclude_from_disk(cycle)
    assert outcome.result == Result.ABANDONED
    assert "trainer/1" in outcome.reason
    assert latest_committed(cycle.root) is None, "nothing partial is ever committed"


def test_shards_of_different_steps_are_never_mixed(tmp_path):
    cycle = left(tmp_path)
    save(cycle.root, 7, "trainer/0")
    save(cycle.root, 8, "trainer/1")
    assert recovery.conclude_from_disk(cycle).result == Result.ABANDONED
    assert latest_committed(cycle.root) is None


def test_a_shard_older_than_the_cycle_is_not_proof(tmp_path):
    """A file left by an earlier, abandoned cycle at the same step is not this cycle's save."""
    root = str(tmp_path / "ckpt")
    for shard in SHARDS:
        save(root, 7, shard)
    cycle = left(tmp_path, opened_at=time.time() + 60)  # opened after the files were written
    assert recovery.conclude_from_disk(cycle).result == Result.ABANDONED
    assert latest_committed(root) is None


def test_a_committed_step_is_never_touched(tmp_path):
    root = str(tmp_path / "ckpt")
    for shard in SHARDS:
        save(root, 5, shard)
    records = [write_shard(root, 5, s, lambda p, st: save_state_dict({}, p)) for s in SHARDS]
    commit(root, 5, list(SHARDS), records)
    manifest = Path(root, "step-00000005", "MANIFEST.json")
    before = manifest.read_text()
    outcome = recovery.conclude_from_disk(left(tmp_path))
    assert outcome.result == Result.ABANDONED  # step 5 was already committed: not this cycle's
    assert manifest.read_text() == before
    assert outcome.resume_from["step"] == 5


def test_the_plan_own_verdict_is_kept(tmp_path):
    planned = recovery.conclude_from_disk(
        left(tmp_path, tier=None, reason="no replica of shard 1 is healthy")
    )
    assert (planned.result, planned.reason) == (
        Result.ABANDONED,
        "no replica of shard 1 is healthy",
    )


def test_next_cycle_and_open_cycles_come_from_the_records(tmp_path):
    report_dir = str(tmp_path / "reports")
    assert recovery.next_cycle(report_dir, "job") == 0  # a new job
    TerminationOutcome(cycle=0, job_id="job", result=Result.COMMITTED).publish(report_dir)
    TerminationOutcome(cycle=1, job_id="job", result=Result.ABANDONED).publish(report_dir)
    opened = left(tmp_path, cycle=2)
    recovery.record_in_flight(report_dir, opened)
    assert recovery.next_cycle(report_dir, "job") == 3
    assert recovery.left_open(report_dir, "job", str(tmp_path / "ckpt")) == [opened]
    assert recovery.read_outcome(report_dir, "job", 1).result == Result.ABANDONED
    recovery.clear_in_flight(report_dir, "job", 2)
    assert recovery.left_open(report_dir, "job", str(tmp_path / "ckpt")) == []
    assert recovery.next_cycle(report_dir, "other-job") == 0  # job-scoped


def test_a_record_naming_another_root_is_concluded_under_the_configured_one(tmp_path, caplog):
    """Anyone who can write the report directory could have steered the manifest of a cycle
    left open to any directory: the restarted coordinator commits only under its own root."""
    report_dir = str(tmp_path / "reports")
    steered = dataclasses.replace(left(tmp_path, cycle=2), root=str(tmp_path / "elsewhere"))
    recovery.record_in_flight(report_dir, steered)
    [cycle] = recovery.left_open(report_dir, "job", str(tmp_path / "ckpt"))
    assert cycle.root == str(tmp_path / "ckpt")
    assert "names checkpoint root" in caplog.text


def test_an_unreadable_record_is_reported_not_raised(tmp_path, caplog):
    report_dir = str(tmp_path / "reports")
    os.makedirs(os.path.join(report_dir, "job"))
    with open(os.path.join(report_dir, "job", "inflight-cycle-4.json"), "w") as f:
        f.write("{not json")
    assert recovery.left_open(report_dir, "job", str(tmp_path / "ckpt")) == []
    assert "unreadable record" in caplog.text
    assert recovery.next_cycle(report_dir, "job") == 5  # its number is still never reused


def held(shard: str, step: int, *holders: str) -> ShardRecord:
    name = shard_file_name(shard)
    return ShardRecord(shard, step, name, 10, 0, "trainer", 0, tier="memory", holders=holders)


def test_a_memory_cycle_held_whole_by_keepers_is_committed_in_memory(tmp_path):
    """Issue 22: the keepers outlived the coordinator; what they hold of the cycle decides."""
    records = [held("trainer/0", 7, "a"), held("trainer/1", 7, "b"), held("trainer/1", 5, "a")]
    outcome, memory = recovery.conclude_from_keepers(left(tmp_path, tier="memory"), records, 1)
    assert outcome.result == Result.COMMITTED and memory.step == 7, outcome.summary()
    assert outcome.committed["holders"] == {"trainer/0": ["a"], "trainer/1": ["b"]}
    assert outcome.resume_from == {"step": 7, "tier": "memory"}
    assert latest_committed(str(tmp_path / "ckpt")) is None, "durable only once copied"


def test_a_memory_cycle_missing_a_shard_or_a_replica_is_abandoned_and_says_which(tmp_path):
    cycle = left(tmp_path, tier="memory")
    outcome, memory = recovery.conclude_from_keepers(cycle, [held("trainer/0", 7, "a")], 1)
    assert outcome.result == Result.ABANDONED and memory is None
    assert "trainer/1" in outcome.reason and "restarted" in outcome.reason
    mixed = [held("trainer/0", 7, "a"), held("trainer/1", 6, "a")]
    outcome, _ = recovery.conclude_from_keepers(cycle, mixed, 1)
    assert outcome.result == Result.ABANDONED, "never two steps in one checkpoint"
    short = [held("trainer/0", 7, "a"), held("trainer/1", 7, "a")]
    outcome, _ = recovery.conclude_from_keepers(cycle, short, 2)
    assert outcome.result == Result.ABANDONED and "memory_replicas is 2" in outcome.reason
    outcome, _ = recovery.conclude_from_keepers(cycle, [], 1)
    assert outcome.result == Result.ABANDONED and "no keeper holds" in outcome.reason


def test_a_shard_that_went_to_disk_completes_a_memory_cycle_at_its_step(tmp_path):
    """A shard over its keeper's budget was saved to disk by its rank: it counts, at that step."""
    cycle = left(tmp_path, tier="memory")
    save(cycle.root, 7, "trainer/1")
    outcome, memory = recovery.conclude_from_keepers(cycle, [held("trainer/0", 7, "a")], 1)
    assert outcome.result == Result.COMMITTED, outcome.summary()
    assert memory.shards["trainer/1"].tier == "disk" and outcome.committed["on_disk"] == [
        "trainer/1"
    ]


class Keeper:
    def __init__(self, shards=None, dead=False):
        self.shards, self.dead = shards or [], dead

    async def stats(self):
        if self.dead:
            raise RuntimeError("keeper died")
        return {"shards": self.shards}


def test_what_the_keepers_hold_of_a_cycle_is_gathered_with_every_holder():
    one = {"step": 7, "shard": "trainer/0", "bytes": 10, "cycle": 3, "group": "trainer", "rank": 0}
    other_cycle = {**one, "cycle": 2, "step": 5}
    keepers = {"a": Keeper([one, other_cycle]), "b": Keeper([one]), "c": Keeper(dead=True)}
    records = asyncio.run(recovery.held_in_keepers(keepers, 3))
    assert [(r.shard, r.step, r.holders, r.tier) for r in records] == [
        ("trainer/0", 7, ("a", "b"), "memory")
    ]


def _logged_outcome(captured: str) -> dict:
    import json

    from ray_graceful.outcome import LOG_PREFIX

    (line,) = [ln for ln in captured.splitlines() if ln.startswith(LOG_PREFIX)]
    return json.loads(line[len(LOG_PREFIX) :])


def test_the_outcome_log_line_is_a_summary_naming_the_file_that_holds_the_record(tmp_path, capsys):
    """The log line is one short summary, however large the record (it was the whole record:
    10 kB for four ranks, up to 1 MiB), naming the file; a record whose file cannot be written
    is logged whole."""
    import json

    small = TerminationOutcome(cycle=0, job_id="job", result=Result.COMMITTED, missing=["p9"])
    path = small.publish(str(tmp_path))
    logged = _logged_outcome(capsys.readouterr().err)
    assert logged["record"] == path and logged["summary"] == small.summary()
    assert json.loads(Path(path).read_text()) == small.to_dict()

    reports = [{"pid": i, "phases": ["x" * 100] * 7} for i in range(2000)]
    missing = [f"p{i}" for i in range(30)]
    big = TerminationOutcome(
        cycle=1, job_id="job", result=Result.ABANDONED, reports=reports, missing=missing
    )
    path = big.publish(str(tmp_path))
    line = [ln for ln in capsys.readouterr().err.splitlines() if "outcome" in ln][-1]
    logged = json.loads(line[line.index("{") :])
    on_disk = json.loads(Path(path).read_text())
    assert len(on_disk["reports"]) == len(reports), "the file holds the whole record"
    assert len(line) < 2000 and logged["record_chars"] > 1_000_000
    assert (logged["result"], logged["reports"], logged["missing"]) == ("abandoned", 2000, 30)
    assert logged["missing_first"] == missing[:20]

    blocked = tmp_path / "not-a-dir"
    blocked.write_text("a file where the report directory should be")
    assert big.publish(str(blocked)) is None
    assert len(_logged_outcome(capsys.readouterr().err)["reports"]) == len(reports), "all logged"
