"""The checkpoint protocol: shards land atomically, the manifest commits, torn ones never load."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from ray_graceful.checkpoint import (
    MANIFEST,
    CheckpointError,
    ShardRecord,
    commit,
    latest_committed,
    load_committed_shard,
    load_state_dict,
    save_state_dict,
    step_dir,
    write_shard,
)
from ray_graceful.checkpoint.files import file_checksum


def _saver(value):
    def save(path, step):
        return save_state_dict({"step": step, "w": torch.full((4,), float(value))}, path)

    return save


def _save_and_commit(root, step, shards=("a", "b")):
    records = [write_shard(root, step, s, _saver(step)) for s in shards]
    commit(root, step, list(shards), records, cycle=1)
    return records


def test_committed_checkpoint_round_trip(tmp_path):
    root = str(tmp_path)
    _save_and_commit(root, 10)
    ckpt = latest_committed(root, verify_checksums=True)
    assert ckpt is not None and ckpt.step == 10
    assert sorted(ckpt.shards) == ["a", "b"]
    loaded = load_state_dict(ckpt.shard_path("a"))
    assert loaded["step"] == 10 and torch.equal(loaded["w"], torch.full((4,), 10.0))
    with pytest.raises(CheckpointError, match="shard 'c' is not in the checkpoint at step 10"):
        ckpt.shard_path("c")


def test_latest_skips_uncommitted_and_torn(tmp_path):
    root = str(tmp_path)
    _save_and_commit(root, 10)
    write_shard(root, 20, "a", _saver(20))  # step 20: one shard, never committed
    _save_and_commit(root, 30)
    # step 30's shard 'b' is truncated after the commit: it must not be loaded
    path = os.path.join(step_dir(root, 30), "shard-b.pt")
    with open(path, "r+b") as f:
        f.truncate(10)
    assert latest_committed(root).step == 10
    # a manifest that is not JSON (torn write) is skipped too
    _save_and_commit(root, 40)
    with open(os.path.join(step_dir(root, 40), MANIFEST), "w") as f:
        f.write('{"format": 1, "st')
    assert latest_committed(root).step == 10


def test_checksum_catches_same_size_corruption(tmp_path):
    root = str(tmp_path)
    _save_and_commit(root, 5)
    path = os.path.join(step_dir(root, 5), "shard-a.pt")
    with open(path, "rb") as f:
        data = bytearray(f.read())
    data[-20] ^= 0xFF
    with open(path, "wb") as f:
        f.write(bytes(data))
    # sizes match: only the cheap check, asked for explicitly, passes
    assert latest_committed(root, verify_checksums=False).step == 5
    assert latest_committed(root) is None, "the default verifies checksums"


def test_commit_refuses_incomplete_or_mixed_steps(tmp_path):
    root = str(tmp_path)
    a = write_shard(root, 7, "a", _saver(7))
    with pytest.raises(CheckpointError, match=r"shards \['b'\] were not saved at step 7"):
        commit(root, 7, ["a", "b"], [a])
    b8 = write_shard(root, 8, "b", _saver(8))
    with pytest.raises(CheckpointError, match="saved at step 8, not 7"):
        commit(root, 7, ["a", "b"], [a, b8])
    neither = dataclasses.replace(a, crc32=a.crc32 ^ 1)
    with pytest.raises(CheckpointError, match=r"saved twice at step 7, and .* is neither save"):
        commit(root, 7, ["a"], [neither, neither])
    with pytest.raises(CheckpointError, match="no shards"):
        commit(root, 7, [], [])
    # A shard another writer may have renamed over (verify): its file is read back.
    with pytest.raises(CheckpointError, match="is not the save kept"):
        commit(root, 7, ["a"], [neither], verify={"a"})
    assert latest_committed(root) is None
    assert not os.path.exists(os.path.join(step_dir(root, 7), MANIFEST))
    assert latest_committed(root) is None


def test_a_shard_saved_twice_at_one_step_commits_the_save_whose_file_is_on_disk(tmp_path):
    """A rank that left alone and the replica the plan chose both saved shard "a" at step 7,
    each renaming a complete file into place: the record that is the file on disk is the one
    committed, and the shard loads. Records the file is neither of commit nothing."""
    root = str(tmp_path)
    alone = write_shard(root, 7, "a", _saver(7), group="g", rank=0)
    replica = write_shard(root, 7, "a", _saver(7), group="g", rank=1)
    on_disk = file_checksum(os.path.join(step_dir(root, 7), replica.file))
    assert (replica.bytes, replica.crc32) == on_disk, "the later rename is the file there"
    # (Two replicas of one step write the same bytes: either record may stand for the file.)

    other_bytes = dataclasses.replace(alone, crc32=alone.crc32 ^ 1)
    torn = dataclasses.replace(replica, bytes=replica.bytes - 1)
    with pytest.raises(CheckpointError, match="is neither save"):
        commit(root, 7, ["a"], [other_bytes, torn])
    assert latest_committed(root) is None

    # The lone rank's file was replaced by the replica's: the replica's record is committed.
    commit(root, 7, ["a"], [other_bytes, replica])
    committed = latest_committed(root)
    assert committed is not None and committed.step == 7
    entry = committed.manifest["shards"]["a"]
    assert entry["rank"] == 1 and (entry["bytes"], entry["crc32"]) == on_disk
    assert torch.equal(load_committed_shard(committed, "a")["w"], torch.full((4,), 7.0))


def test_directory_saver_and_failed_saver(tmp_path):
    root = str(tmp_path)

    def dcp_like(path, step):
        os.makedirs(path)
        for i in range(3):
            with open(os.path.join(path, f"part{i}"), "wb") as f:
                f.write(os.urandom(1000))

    record = write_shard(root, 3, "dcp", dcp_like)
    assert record.bytes == 3000
    commit(root, 3, ["dcp"], [record])
    assert os.path.isdir(latest_committed(root, verify_checksums=True).shard_path("dcp"))

    def broken(path, step):
        with open(path, "wb") as f:
            f.write(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_shard(root, 4, "x", broken)
    assert os.listdir(step_dir(root, 4)) == [], "a failed save leaves nothing behind"


def test_abandoned_save_is_not_renamed(tmp_path):
    abandoned = threading.Event()

    def slow(path, step):
        abandoned.set()  # the teardown gave up while the saver was still writing
        return _saver(1)(path, step)

    with pytest.raises(CheckpointError, match="abandoned"):
        write_shard(str(tmp_path), 1, "a", slow, abandoned=abandoned)
    assert os.listdir(step_dir(str(tmp_path), 1)) == []


def test_kill_during_save_keeps_previous_committed_loadable(tmp_path):
    """SIGKILL in the middle of a big shard write: the committed step 10 still loads."""
    root = str(tmp_path)
    _save_and_commit(root, 10)
    script = textwrap.dedent(f"""
        import os, sys, torch
        from ray_graceful.checkpoint import write_shard
        def save(path, step):
            with open(path, "wb") as f:
                f.write(b"x" * 1000)
                f.flush()
                print("writing", flush=True)
                sys.stdin.readline()  # wait here until killed
        write_shard({root!r}, 20, "a", save)
    """)
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "writing"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    leftovers = os.listdir(step_dir(root, 20))
    assert all(name.startswith(".tmp-") for name in leftovers), leftovers
    ckpt = latest_committed(root, verify_checksums=True)
    assert ckpt.step == 10
    with open(os.path.join(ckpt.path, MANIFEST)) as f:
        assert json.load(f)["cycle"] == 1


def _committed_files(root, step):
    directory = step_dir(root, step)
    return {
        name: os.stat(os.path.join(directory, name)).st_mtime_ns for name in os.listdir(directory)
    }


def test_a_save_at_a_committed_step_keeps_the_committed_shard(tmp_path):
    """A notice in the first step after a resume saves at the step already committed: the
    committed shard is kept (reported as reused), never rewritten in place."""
    root = str(tmp_path)
    _save_and_commit(root, 10)
    before = _committed_files(root, 10)
    again = write_shard(root, 10, "a", _saver(99))
    assert again.reused and again.step == 10
    assert _committed_files(root, 10) == before, "a committed file was touched"
    assert commit(root, 10, ["a", "b"], [again, write_shard(root, 10, "b", _saver(99))])
    assert _committed_files(root, 10) == before, "the manifest was rewritten"
    assert load_state_dict(latest_committed(root).shard_path("a"))["w"][0].item() == 10.0


def _read_json(path):
    with open(path) as f:
        return json.load(f)


def test_two_writers_committing_one_step_at_once_leave_one_manifest_never_replaced(tmp_path):
    """A held step's durable copy and the next cycle's commit of the same step can meet on
    disk (the group evicted again before it trained). Both see the step uncommitted; only one
    manifest may land, the other writer keeps it as it is, and neither fails."""
    root = str(tmp_path)
    records = [write_shard(root, 10, s, _saver(10)) for s in ("a", "b")]
    start, errors, paths = threading.Barrier(8), [], []

    def one(cycle):
        start.wait()
        try:
            paths.append(commit(root, 10, ["a", "b"], records, cycle=cycle))
        except Exception as exc:  # every failure is the finding
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(c,)) for c in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert errors == [] and len(set(paths)) == 1
    manifest = _read_json(paths[0])
    before = _committed_files(root, 10)
    assert commit(root, 10, ["a", "b"], records, cycle=99) == paths[0]
    assert _committed_files(root, 10) == before and _read_json(paths[0]) == manifest
    assert [f for f in os.listdir(step_dir(root, 10)) if ".tmp-" in f] == [], "no leftovers"


def test_a_manifest_that_lands_while_a_commit_writes_is_kept_and_a_different_one_refused(
    tmp_path, monkeypatch
):
    """The step is committed by another process between this writer's check and its write:
    with the same shards the landed manifest is kept; with others, refused - never replaced."""
    from ray_graceful.checkpoint import write as write_module

    root = str(tmp_path)
    records = [write_shard(root, 10, s, _saver(10)) for s in ("a", "b")]
    real = write_module.write_json_atomic
    theirs: dict = {}  # what the other writer's manifest lists, where not the same

    def the_other_writer_first(path, payload, exclusive=False):
        real(path, {**payload, "cycle": 7, **theirs}, exclusive=True)  # the other process's
        real(path, payload, exclusive=exclusive)

    monkeypatch.setattr(write_module, "write_json_atomic", the_other_writer_first)
    commit(root, 10, ["a", "b"], records, cycle=1)
    assert _read_json(os.path.join(step_dir(root, 10), MANIFEST))["cycle"] == 7
    records = [write_shard(root, 11, s, _saver(11)) for s in ("a", "b")]
    theirs["shards"] = {r.shard: r.to_dict() for r in records}
    with pytest.raises(CheckpointError, match="never modified"):
        commit(root, 11, ["a"], records[:1], cycle=1)  # theirs lists shards a and b


def test_a_committed_directory_shard_is_never_removed(tmp_path):
    root = str(tmp_path)

    def dir_saver(path, step):
        os.makedirs(path)
        with open(os.path.join(path, "part"), "w") as f:
            f.write(f"step {step}")

    record = write_shard(root, 3, "d", dir_saver)
    commit(root, 3, ["d"], [record])
    assert write_shard(root, 3, "d", dir_saver).reused
    assert latest_committed(root).step == 3


def test_a_committed_step_without_the_shard_is_not_modified(tmp_path):
    root = str(tmp_path)
    _save_and_commit(root, 4, shards=("a",))
    with pytest.raises(CheckpointError, match="committed without shard 'z'"):
        write_shard(root, 4, "z", _saver(4))
    assert sorted(os.listdir(step_dir(root, 4))) == sorted([MANIFEST, "shard-a.pt"])


def test_an_uncommitted_directory_shard_is_replaced_without_a_gap(tmp_path):
    root = str(tmp_path)

    def dir_saver(value):
        def save(path, step):
            os.makedirs(path)
            with open(os.path.join(path, "part"), "w") as f:
                f.write(value)

        return save

    write_shard(root, 5, "d", dir_saver("old"))
    record = write_shard(root, 5, "d", dir_saver("new"))
    commit(root, 5, ["d"], [record])
    with open(os.path.join(latest_committed(root).shard_path("d"), "part")) as f:
        assert f.read() == "new"
    assert not [n for n in os.listdir(step_dir(root, 5)) if ".old-" in n or n.startswith(".tmp")]


@pytest.mark.parametrize("file", ["../../../etc/hostname", "/etc/hostname", "shard-b.pt"])
def test_a_manifest_entry_names_its_own_file_inside_the_step(tmp_path, file):
    root = str(tmp_path)
    (a,) = [write_shard(root, 6, "a", _saver(6))]
    forged = type(a)(**{**a.to_dict(), "file": file})
    with pytest.raises(CheckpointError, match=r"its file is|not its own"):
        commit(root, 6, ["a"], [type(a).from_dict(forged.to_dict())])
    assert latest_committed(root) is None
    # and a manifest written by someone else that points outside is not loaded either
    _save_and_commit(root, 7, shards=("a",))
    path = os.path.join(step_dir(root, 7), MANIFEST)
    with open(path) as f:
        manifest = json.load(f)
    manifest["shards"]["a"]["file"] = file
    with open(path, "w") as f:
        json.dump(manifest, f)
    assert latest_committed(root) is None


@pytest.mark.parametrize("body", ["[]", '{"format": 1, "step": 8, "shards": []}', '"x"', "7"])
def test_a_manifest_of_the_wrong_shape_is_skipped_with_a_reason(tmp_path, body, caplog):
    root = str(tmp_path)
    _save_and_commit(root, 2, shards=("a",))
    _save_and_commit(root, 8, shards=("a",))
    with open(os.path.join(step_dir(root, 8), MANIFEST), "w") as f:
        f.write(body)
    assert latest_committed(root).step == 2
    assert "skipped checkpoint step 8" in caplog.text


def test_load_state_dict_refuses_code(tmp_path):
    """weights_only=True: a checkpoint cannot run code when loaded."""
    path = str(tmp_path / "evil.pt")
    torch.save({"f": print}, path)  # an arbitrary callable: not a weight
    with pytest.raises(Exception, match=r"[Ww]eights only"):
        load_state_dict(path)
    save_state_dict({"step": 3, "state": {"w": torch.ones(2), "lr": 0.1, "n": [1, 2]}}, path)
    assert load_state_dict(path)["state"]["n"] == [1, 2]


def test_a_restarted_rank_verifies_the_shard_it_loads_and_refuses_a_torn_one(tmp_path):
    """Loading one shard checks that shard only; a torn one is refused with the way out,
    never silently replaced by an older step (the group's other ranks load this one)."""
    root = str(tmp_path)
    _save_and_commit(root, 1)
    _save_and_commit(root, 2)
    latest = latest_committed(root, verify_checksums=False)
    with open(latest.shard_path("b"), "r+b") as f:  # same size, one byte flipped
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    assert load_committed_shard(latest, "a")["w"].tolist() == [2.0] * 4
    with pytest.raises(CheckpointError, match=r"shard 'b' .* step 2 .* does not match"):
        load_committed_shard(latest, "b")
    assert latest_committed(root, verify_checksums=True).step == 1


def test_a_shard_is_never_written_without_a_directory(tmp_path, monkeypatch):
    """An empty root would be the working directory: refused, nothing written (defect 4)."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match="no checkpoint directory given"):
        write_shard("", 3, "g/0", lambda p, s: save_state_dict({"s": s}, p))
    assert os.listdir(tmp_path) == []


def _forge_step(root: str, step: int, make_shard) -> None:
    """A step directory with a well-formed manifest whose shard ``make_shard(path)`` creates,
    as a hostile or broken writer could leave one (commit() itself refuses such shards)."""
    good = latest_committed(root)
    directory = step_dir(root, step)
    os.makedirs(directory)
    with open(os.path.join(good.path, MANIFEST)) as f:
        manifest = json.load(f)
    record = dict(manifest["shards"]["a"], step=step)
    size = make_shard(os.path.join(directory, record["file"]))
    if size is not None:
        record["bytes"], record["crc32"] = size
    manifest.update(step=step, shards={"a": record})
    with open(os.path.join(directory, MANIFEST), "w") as f:
        json.dump(manifest, f)


def _latest_within(root: str, seconds: float = 10.0):
    box: dict = {}
    reader = threading.Thread(target=lambda: box.setdefault("c", latest_committed(root)))
    reader.daemon = True
    reader.start()
    reader.join(seconds)
    assert not reader.is_alive(), "latest_committed hangs"
    return box["c"]


@pytest.mark.parametrize("where", ["shard", "inside-a-directory-shard"])
def test_a_fifo_shard_is_refused_not_read(tmp_path, caplog, where):
    """Review defect 10: a shard that is a FIFO (or a directory holding one), with a manifest
    saying 0 bytes, made latest_committed hang forever."""
    root = str(tmp_path / "ckpt")
    _save_and_commit(root, 10, shards=("a",))

    def fifo(path):
        if where == "shard":
            os.mkfifo(path)
        else:
            os.makedirs(path)
            os.mkfifo(os.path.join(path, "data"))
        return (0, 0)

    _forge_step(root, 20, fifo)
    assert _latest_within(root).step == 10
    assert "is a FIFO, not a plain file or directory" in caplog.text


def test_shards_and_steps_behind_symbolic_links_are_not_followed(tmp_path, caplog):
    """Review defect 10: a shard file or a step directory symlinked outside the root was
    followed and loaded."""
    root, outside = str(tmp_path / "ckpt"), str(tmp_path / "outside")
    _save_and_commit(root, 10, shards=("a",))
    _save_and_commit(outside, 30, shards=("a",))  # a valid checkpoint, elsewhere
    elsewhere = latest_committed(outside).shard_path("a")

    def link(path):
        os.symlink(elsewhere, path)
        return None  # the manifest keeps the real bytes and checksum of what it points to

    _forge_step(root, 20, link)
    os.symlink(step_dir(outside, 30), step_dir(root, 40))
    latest = _latest_within(root)
    assert latest.step == 10, latest
    assert "is a symbolic link" in caplog.text
    assert "step directory is not a plain directory" in caplog.text
    # commit() itself refuses such a shard (a report naming a link is never committed).
    record = ShardRecord.from_dict(latest_committed(outside).manifest["shards"]["a"])
    os.makedirs(step_dir(root, 30))
    os.symlink(elsewhere, os.path.join(step_dir(root, 30), record.file))
    with pytest.raises(CheckpointError, match="is a symbolic link"):
        commit(root, 30, ["a"], [record], cycle=2)
    assert not os.path.exists(os.path.join(step_dir(root, 30), MANIFEST))


# --- names and writers the checkpoint module itself refuses or serialises ----------------------


def test_the_checkpoint_api_refuses_a_group_named_with_a_slash(tmp_path):
    """Setup refuses "team/actor"; the module's own API used to take it, and ``commit`` then
    assembled "team/actor" and "team/critic" into one DCP checkpoint "team"."""
    root = str(tmp_path)
    with pytest.raises(CheckpointError, match=r"group 'team/actor' is not allowed: a name without"):
        write_shard(root, 1, "team/actor/0", _saver(1), group="team/actor", rank=0)
    assert not os.path.exists(step_dir(root, 1)) or os.listdir(step_dir(root, 1)) == []
    record = write_shard(root, 1, "a", _saver(1))
    with pytest.raises(CheckpointError, match=r"group 'team/critic' is not allowed"):
        commit(root, 1, ["a"], [dataclasses.replace(record, group="team/critic")])
    assert latest_committed(root) is None


def test_a_shard_named_at_the_setup_limits_saves_and_stays_apart_from_its_neighbours(tmp_path):
    """A 200-character group and a 58-character shard label (both allowed at setup) made a
    277-character file name: the emergency save failed with "File name too long" at the
    eviction. Long names keep a readable prefix and a digest of the whole."""
    root = str(tmp_path)
    group = "g" * 200
    keys = [f"{group}/{'s' * 57}{end}" for end in "ab"]
    records = [write_shard(root, 3, key, _saver(3), group=group, rank=0) for key in keys]
    assert len({r.file for r in records}) == 2, "two long names, two files"
    assert all(len(r.file) <= 255 and len(r.file.encode()) <= 255 for r in records)
    commit(root, 3, keys, records)
    ckpt = latest_committed(root, verify_checksums=True)
    assert ckpt.step == 3 and sorted(ckpt.shards) == sorted(keys)
    assert load_committed_shard(ckpt, keys[1])["w"][0].item() == 3.0


def test_two_commits_of_one_dcp_step_at_once_both_succeed_and_never_touch_it_after(tmp_path):
    """The coordinator commits on threads: two commits of one DCP step shared
    ``dcp-<group>/.metadata.tmp`` (10 of 24 raised FileNotFoundError), and the one that lost
    rewrote ``.metadata`` behind the committed manifest."""
    from ray_graceful import dcp_saver

    root = str(tmp_path)
    model = torch.nn.Linear(4, 3)
    errors: list[str] = []
    for step in range(12):
        saver = dcp_saver(lambda: {"model": model.state_dict()})
        record = write_shard(root, step, "policy/0", saver, group="policy", rank=0)

        def one_commit(step=step, record=record):
            try:
                commit(root, step, ["policy/0"], [record], cycle=step)
            except Exception as exc:
                errors.append(f"step {step}: {exc!r}")

        threads = [threading.Thread(target=one_commit) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        directory = step_dir(root, step)
        metadata = os.stat(os.path.join(directory, "dcp-policy", ".metadata"))
        manifest = os.stat(os.path.join(directory, MANIFEST))
        assert metadata.st_mtime_ns <= manifest.st_mtime_ns, f"step {step}: rewritten after"
        assert sorted(os.listdir(os.path.join(directory, "dcp-policy"))) == [".metadata"]
    assert errors == []


def test_a_files_checksum_is_the_crc32_of_its_bytes_empty_or_not(tmp_path):
    import zlib

    empty, full = tmp_path / "empty", tmp_path / "full"
    empty.write_bytes(b"")
    data = os.urandom(3 << 20) + b"tail"
    full.write_bytes(data)
    assert file_checksum(str(empty)) == (0, 0)
    assert file_checksum(str(full)) == (len(data), zlib.crc32(data))
