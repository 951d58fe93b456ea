"""Ray Train's warm path: a real TorchTrainer (three CPU workers, gloo) with GracefulTorchConfig.

One worker is SIGTERMed mid-run. Train replaces that worker alone; the two others keep their
processes and their training functions (never started again), park at the agreed step, and
re-form the group with the new worker, which joins at the evicted rank and loads the committed
step. No step is lost or run twice, and every rank ends with the same model and optimizer.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

from benchmarks.train_job import warm_train_func
from ray_graceful import Coordinator, GracefulConfig
from ray_graceful.ray_adapter import live_actor_pids, worker_exits
from ray_graceful.train import GracefulTorchConfig, GracefulTrainCallback
from ray_graceful.train.backend import ray_has_replica_groups

needs_replica_groups = pytest.mark.skipif(
    not ray_has_replica_groups(), reason="this Ray has no replica groups (Ray >= 2.56)"
)


@pytest.fixture(scope="module")
def three_nodes(ray_cluster):
    """Three worker nodes, one Train slot each, shared by this module's runs (each run's
    placement group is gone when its trainer returns)."""
    added = [ray_cluster.add_node(num_cpus=2, resources={"train_slot": 1}) for _ in range(3)]
    ray_cluster.wait_for_nodes()
    yield added
    for node in added:
        ray_cluster.remove_node(node)


def _lines(path):
    try:
        with open(path) as f:
            return [line.split() for line in f if line.strip()]
    except FileNotFoundError:
        return []


def _start(tmp_path, config, total=30, worker_env=None, **job):
    files = {name: str(tmp_path / name) for name in ("progress", "attempts", "final", "began")}
    trainer = TorchTrainer(
        warm_train_func,
        train_loop_config={
            "total": total,
            "step_s": 0.2,
            "progress": files["progress"],
            "attempt_file": files["attempts"],
            "final": files["final"],
            "began_file": files["began"],
            **job,
        },
        scaling_config=ScalingConfig(
            num_workers=3, resources_per_worker={"train_slot": 1, "CPU": 0}
        ),
        torch_config=GracefulTorchConfig(),
        run_config=RunConfig(
            storage_path=str(tmp_path / "storage"),
            name="warm",
            callbacks=[GracefulTrainCallback(config)],
            failure_config=FailureConfig(max_failures=2),
            **({"worker_runtime_env": {"env_vars": worker_env}} if worker_env else {}),
        ),
    )
    box: dict = {}
    fit = threading.Thread(target=lambda: box.setdefault("result", trainer.fit()))
    fit.start()
    return fit, box, files


def _wait_until(what, condition, fit, timeout):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout}s: {what}"
        assert fit.is_alive(), f"the run ended before {what}"
        time.sleep(0.1)


def _config(tmp_path, **settings) -> GracefulConfig:
    return GracefulConfig(
        report_dir=str(tmp_path / "reports"),
        checkpoint_dir=str(tmp_path / "ckpt"),
        health_interval_s=0.5,
        train_shards="replicated",
        expected_save_s=1.0,
        **settings,
    )


def _first_pids_past_step_5(files, fit) -> dict[int, int]:
    """Once every rank is past step 5 (a step committed by then is not step 0): rank -> pid."""
    _wait_until(
        "every rank past step 5",
        lambda: sum(1 for r in _lines(files["progress"]) if int(r[1]) >= 5) >= 3,
        fit,
        180,
    )
    return {int(a[0]): int(a[4]) for a in _lines(files["attempts"])}


def _each_rank_ran_every_step_once(files, total: int) -> None:
    """No step lost, none run twice; every rank ends with the same model and optimizer."""
    progress = _lines(files["progress"])
    for rank in (0, 1, 2):
        steps = sorted(int(p[1]) for p in progress if int(p[0]) == rank)
        assert steps == list(range(1, total + 1)), (rank, steps)
    final = _lines(files["final"])
    assert sorted(int(f[0]) for f in final) == [0, 1, 2]
    assert {(int(f[1]), f[2]) for f in final} == {(total, final[0][2])}, final


def _ranks_1_and_2_replaced_and_rank_0_kept(files, first: dict[int, int]) -> None:
    """Train started new workers for ranks 1 and 2 alone; rank 0 trained in its first process
    throughout; no step lost or run twice (40 steps)."""
    attempts = _lines(files["attempts"])
    assert sorted(int(a[0]) for a in attempts[3:]) == [1, 2], attempts
    assert all(int(a[4]) not in first.values() for a in attempts[3:])
    progress = _lines(files["progress"])
    assert {int(p[3]) for p in progress if int(p[0]) == 0} == {first[0]}, "rank 0 was kept"
    _each_rank_ran_every_step_once(files, 40)


@needs_replica_groups
@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    "memory_replicas",
    # held is the default with warm_restart; disk (memory_replicas=0) is a fault-row run
    [pytest.param(0, marks=pytest.mark.long, id="disk"), pytest.param(1, id="held")],
)
def test_a_sigtermed_worker_is_replaced_alone_and_the_survivors_train_on(
    three_nodes, tmp_path, memory_replicas
):
    """``disk``: the plan's saver writes the step, the new worker loads it. ``held``: with the
    memory tier the survivors hold the step, and the new worker receives it from one of them
    over the new group; the step reaches disk behind the training."""
    config = _config(tmp_path, memory_replicas=memory_replicas)
    fit, box, files = _start(tmp_path, config)
    first = _first_pids_past_step_5(files, fit)
    assert sorted(first) == [0, 1, 2]
    coordinator = Coordinator.connect(config)  # the run's: the callback started it
    os.kill(first[1], signal.SIGTERM)
    signalled_at = time.time()
    assert coordinator.wait_outcome(timeout=60, cycle=0) is not None
    rejoined = coordinator.wait_rejoined(1, timeout=120)
    fit.join(240)
    assert not fit.is_alive(), "the run did not finish"
    result = box["result"]
    assert result.error is None, result.error

    attempts = _lines(files["attempts"])
    # Train started a new worker in rank 1's slot alone; ranks 0 and 2 never started again
    assert [int(a[0]) for a in attempts[3:]] == [1], attempts
    again = attempts[3]
    assert int(again[4]) != first[1]
    joined_at_step = int(again[2])
    assert joined_at_step >= 5, "the new worker joined at the committed step, not from 0"
    assert float(again[3]) > signalled_at
    # No step lost, none run twice; every rank ends with the same model and optimizer
    _each_rank_ran_every_step_once(files, 30)
    progress = _lines(files["progress"])
    # The SIGTERMed worker left through Ray's intended exit: no crash in Ray's records
    assert worker_exits({first[1]}) == {first[1]: "INTENDED_SYSTEM_EXIT"}
    # The survivors did all their steps in the process they started in
    for rank in (0, 2):
        assert {int(p[3]) for p in progress if int(p[0]) == rank} == {first[rank]}
    # Rank 1's steps after the join ran in the new process
    new_pid = int(again[4])
    assert all(
        int(p[3]) == new_pid for p in progress if int(p[0]) == 1 and int(p[1]) > joined_at_step
    )
    # Where each member's step came from: the survivors' own state, the new worker's from
    # disk, or - held - from a surviving replica over the new group
    loaded = {m["member"]: m["loaded_from"] for m in rejoined["members"]}
    assert rejoined["result"] == "rejoined", rejoined
    assert loaded.pop("ray-train:train/1") == ("disk" if memory_replicas == 0 else "group-peer")
    assert set(loaded.values()) == {"own state"}, rejoined
    # Train's records: every member reported the step it joined at, with the committed step
    # where it was on disk by then; a held step reaches disk behind the training, and is
    # reported again then, with its directory - Train's checkpoint is the step either way
    committed = tmp_path / "ckpt" / f"step-{joined_at_step:08d}"
    reported = {"step": joined_at_step, "ray_graceful_warm_restart": 1}
    if memory_replicas == 1:
        reported["ray_graceful_durable"] = 1
    assert result.metrics == reported
    with result.checkpoint.as_directory() as d:
        assert sorted(os.listdir(d)) == sorted(os.listdir(committed))
    # One eviction, warm (the outcome is written as the warm restart begins); the run's own
    # end is no eviction
    outcomes = [json.loads(p.read_text()) for p in (tmp_path / "reports").rglob("outcome-*.json")]
    result_word = "committed" if memory_replicas == 0 else "held"
    assert [(o["result"], o["warm"]["result"]) for o in outcomes] == [(result_word, "rejoining")]
    assert (committed / "MANIFEST.json").exists(), "the held step reached disk behind the training"
    members = {m["member"]: m["was"] for m in outcomes[0]["warm"]["members"]}
    assert members["ray-train:train/1"] == "Ray Train's new worker for rank 1"


@needs_replica_groups
@pytest.mark.timeout(400)
def test_a_worker_that_crashes_is_replaced_alone_and_the_survivors_train_on(three_nodes, tmp_path):
    """Rank 1's process is SIGKILLed mid-run: no notice. The survivors' all-reduce fails inside
    their step; ``step_guard`` holds the error until the coordinator's order (its lost-rank
    watch saw the worker die) and ends the step there. The survivors stop at their last
    completed step and keep their processes; Train replaces the crashed worker alone, and it
    joins at rank 1 with the committed step. Without the guard, the survivors' error ends their
    training functions and Train restarts every worker."""
    config = _config(tmp_path)
    fit, box, files = _start(tmp_path, config, total=40)
    first = _first_pids_past_step_5(files, fit)
    coordinator = Coordinator.connect(config)
    os.kill(first[1], signal.SIGKILL)
    outcome = coordinator.wait_outcome(timeout=60, cycle=0)
    rejoined = coordinator.wait_rejoined(1, timeout=120)
    fit.join(300)
    assert not fit.is_alive(), "the run did not finish"
    assert box["result"].error is None, box["result"].error

    assert outcome is not None and {n["source"] for n in outcome.notices} == {"lost"}, outcome
    assert rejoined is not None and rejoined["result"] == "rejoined", rejoined
    committed = rejoined["resume_step"]
    attempts = _lines(files["attempts"])
    assert [(int(a[0]), int(a[2])) for a in attempts[3:]] == [(1, committed)], attempts
    progress = _lines(files["progress"])
    for rank in (0, 2):  # kept, and every step once
        assert {int(p[3]) for p in progress if int(p[0]) == rank} == {first[rank]}
        assert sorted(int(p[1]) for p in progress if int(p[0]) == rank) == list(range(1, 41))
    # The crashed process's steps, then the new worker's from the committed step on: at most
    # the step it died in is run again (the group had not completed it)
    old = [int(p[1]) for p in progress if int(p[0]) == 1 and int(p[3]) == first[1]]
    new = [int(p[1]) for p in progress if int(p[0]) == 1 and int(p[3]) != first[1]]
    assert old in (list(range(1, committed + 1)), list(range(1, committed + 2))), (old, committed)
    assert new == list(range(committed + 1, 41)), new
    final = _lines(files["final"])
    assert {(int(f[1]), f[2]) for f in final} == {(40, final[0][2])}, final


@needs_replica_groups
@pytest.mark.timeout(400)
def test_every_worker_evicted_at_once_falls_back_to_trains_full_restart(three_nodes, tmp_path):
    """With the memory tier: the signals reach the coordinator one after the other, so the
    first one's survivors may hold the step, then leave on their own signals, copying it to
    keepers on nodes that all have workers leaving. That step is written through to disk by
    those keepers, never lost, and Train's new workers all load it (or a later one)."""
    config = _config(tmp_path, memory_replicas=1)
    fit, box, files = _start(tmp_path, config)
    first = _first_pids_past_step_5(files, fit)
    for pid in first.values():
        os.kill(pid, signal.SIGTERM)
    fit.join(300)
    assert not fit.is_alive(), "the run did not finish"
    result = box["result"]
    assert result.error is None, result.error

    attempts = _lines(files["attempts"])
    assert worker_exits(set(first.values())) == dict.fromkeys(
        first.values(), "INTENDED_SYSTEM_EXIT"
    )
    restarted = {int(a[0]): int(a[2]) for a in attempts[3:] if int(a[4]) not in first.values()}
    # No survivor: Train restarted every worker, each from the step committed as they left
    assert sorted(restarted) == [0, 1, 2], attempts
    assert len(set(restarted.values())) == 1 and min(restarted.values()) >= 5, attempts
    _each_rank_ran_every_step_once(files, 30)
    held = [json.loads(p.read_text()) for p in (tmp_path / "reports").rglob("held-cycle-*.json")]
    assert all(h["stage"] == "on-disk" for h in held), held  # never lost with its holders


@needs_replica_groups
@pytest.mark.long
@pytest.mark.timeout(400)
def test_every_worker_evicted_and_replaced_one_by_one_forms_the_group_anew(three_nodes, tmp_path):
    """Every worker SIGTERMed at once, rank 0's save slow (three seconds): ranks 1 and 2 leave
    first, so Train sees their failures apart from rank 0's and replaces the workers one by
    one instead of restarting the group. Its new workers join a record that names every slot,
    form the group anew and load the committed step; the run finishes. (Before, each found no
    warm restart to join - "not a member" - and failed until ``max_failures`` was spent; and
    rank 0's own exit while Train replaced the others' groups failed Train's controller: the
    evicted worker's process is now Train's to end.)"""
    config = _config(tmp_path, memory_replicas=0).replace(train_shards="per_rank")
    slow = str(tmp_path / "slow-save")
    fit, box, files = _start(tmp_path, config, slow_save=slow)
    first = _first_pids_past_step_5(files, fit)
    coordinator = Coordinator.connect(config)
    with open(slow, "w") as f:
        f.write("0")  # rank 0's save takes three seconds: it leaves last
    for pid in first.values():
        os.kill(pid, signal.SIGTERM)
    outcome = coordinator.wait_outcome(timeout=60, cycle=0)
    fit.join(300)
    assert not fit.is_alive(), "the run did not finish"
    assert box["result"].error is None, box["result"].error

    assert outcome is not None and outcome.warm is not None, outcome
    members = {m["member"]: m["was"] for m in outcome.warm["members"]}
    assert sorted(members) == [f"ray-train:train/{r}" for r in range(3)], members
    assert all("every worker of the group left" in was for was in members.values()), members
    committed = outcome.warm["resume_step"]
    attempts = _lines(files["attempts"])
    assert sorted((int(a[0]), int(a[2])) for a in attempts[3:]) == [
        (r, committed) for r in range(3)
    ]
    assert all(int(a[4]) not in first.values() for a in attempts[3:])
    _each_rank_ran_every_step_once(files, 30)


@needs_replica_groups
@pytest.mark.timeout(400)
def test_a_second_notice_during_the_replacement_is_the_next_warm_restart(three_nodes, tmp_path):
    """Rank 1 is SIGTERMed; while Train starts its new worker, survivor rank 2 is SIGTERMed too.
    Rank 2 already has its answer: it finishes joining (the others would wait for it), and its
    held signal is the new group's first notice - a second warm restart replaces it. Rank 0
    keeps its process through both; no step is lost or run twice."""
    config = _config(tmp_path)
    fit, box, files = _start(tmp_path, config, total=40)
    first = _first_pids_past_step_5(files, fit)
    coordinator = Coordinator.connect(config)
    os.kill(first[1], signal.SIGTERM)
    assert coordinator.wait_outcome(timeout=60, cycle=0) is not None
    assert len(_lines(files["attempts"])) == 3, "rank 1's new worker has not joined yet"
    os.kill(first[2], signal.SIGTERM)  # during the replacement
    fit.join(300)
    assert not fit.is_alive(), "the run did not finish"
    assert box["result"].error is None, box["result"].error

    _ranks_1_and_2_replaced_and_rank_0_kept(files, first)


@needs_replica_groups
@pytest.mark.long
@pytest.mark.timeout(400)
@pytest.mark.parametrize("memory_replicas", [0, 1], ids=["disk", "held"])
def test_a_survivor_signalled_before_the_warm_restart_is_decided_gives_its_slot_to_train(
    three_nodes, tmp_path, memory_replicas
):
    """Rank 1 is SIGTERMed, and its save of its own shard is slow (three seconds), which holds
    the cycle open. Inside that time survivor rank 2, its own teardown done, is SIGTERMed while
    it waits for its rendezvous: it has no answer yet, so it leaves - and says so, and the
    decision counts it out. Train replaces both slots; rank 0 keeps its process, and no step is
    lost or run twice. (Unsaid, the decision named the gone survivor, and Train's next worker
    in its slot was "not a member" until ``max_failures`` was spent.) ``held``: rank 2 held its
    own shard, and copied it to the keepers as it left - before the cycle concluded; that early
    copy counts, and Train's new worker in its slot loads it from there."""
    # Each rank's own shard: on disk, or held by the survivors (the memory tier)
    config = _config(tmp_path, memory_replicas=memory_replicas).replace(train_shards="per_rank")
    slow = str(tmp_path / "slow-save")
    fit, box, files = _start(tmp_path, config, total=40, slow_save=slow)
    first = _first_pids_past_step_5(files, fit)
    coordinator = Coordinator.connect(config)
    with open(slow, "w") as f:
        f.write("1")  # rank 1's next save takes it and holds the cycle open
    os.kill(first[1], signal.SIGTERM)
    _wait_until("rank 1's slow save began", lambda: os.path.exists(slow + ".who"), fit, 60)
    _wait_until(  # its report written: it waits to rejoin, the cycle held open by rank 1
        "rank 2's teardown ended",
        lambda: any((tmp_path / "reports").rglob(f"teardown-*-{first[2]}.json")),
        fit,
        30,
    )
    assert not os.path.exists(slow + ".taken") or _lines(slow + ".who")[0][0] == "1"
    os.kill(first[2], signal.SIGTERM)
    outcome = coordinator.wait_outcome(timeout=60, cycle=0)
    rejoined = coordinator.wait_rejoined(1, timeout=180)
    if memory_replicas:  # every held shard's copy landed - rank 2's before the step was expected
        _wait_until(
            "the held step committed in the keepers",
            lambda: (coordinator.durability(0) or {}).get("stage") in ("in-keepers", "on-disk"),
            fit,
            60,
        )
    fit.join(300)
    assert not fit.is_alive(), "the run did not finish"
    assert box["result"].error is None, box["result"].error

    assert outcome is not None and outcome.warm is not None, outcome
    told = outcome.warm["told_to_leave"]
    assert "left before it had its rendezvous" in " ".join(told.values()), told
    members = {m["member"]: m["was"] for m in outcome.warm["members"]}
    assert members["ray-train:train/2"] == "Ray Train's new worker for rank 2", members
    _ranks_1_and_2_replaced_and_rank_0_kept(files, first)
    loaded = {m["member"]: m["loaded_from"] for m in rejoined["members"]}
    assert rejoined["result"] == "rejoined" and "own state" in loaded.values(), rejoined
    if memory_replicas:  # rank 2's copy, landed before the step was expected, is the one loaded
        assert loaded["ray-train:train/2"] in ("memory-local", "memory-peer"), rejoined


@needs_replica_groups
@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    "dies",
    [
        # make test walks the death while it receives: in its load, the step received
        pytest.param("as-it-begins", marks=pytest.mark.long),
        "in-its-load",
    ],
)
def test_a_new_worker_that_dies_while_it_joins_is_replaced_again(three_nodes, tmp_path, dies):
    """Rank 1 is SIGTERMed, and Train's new worker for its slot dies on its way in:
    ``as-it-begins``, SIGKILLed as its training function begins; ``in-its-load``, held path,
    it SIGKILLs itself in its ``load_state_dict``, the step received over the new group from
    a survivor. Train replaces that one too; the survivors keep their processes and take the
    next new worker in, and no step is lost or run twice. As it begins, the next worker joins
    the same warm restart; in its load, the dead worker had joined the new group: the survivors
    wait in ``carry_on`` until every member loaded, its death ends that group's cycle, and a
    second warm restart takes the next worker in."""
    config = _config(tmp_path, memory_replicas=1 if dies == "in-its-load" else 0)
    die_in_load = str(tmp_path / "die-in-load")
    fit, box, files = _start(tmp_path, config, die_in_load=die_in_load)
    first = _first_pids_past_step_5(files, fit)
    coordinator = Coordinator.connect(config)
    if dies == "in-its-load":
        open(die_in_load, "w").close()  # the next process to load a step takes it and dies
    os.kill(first[1], signal.SIGTERM)

    def new_workers() -> list[int]:
        return [int(b[1]) for b in _lines(files["began"]) if int(b[0]) == 1][1:]

    _wait_until("rank 1's new worker began", lambda: bool(new_workers()), fit, 120)
    if dies == "as-it-begins":
        os.kill(new_workers()[0], signal.SIGKILL)
    _wait_until("a second new worker began", lambda: len(new_workers()) >= 2, fit, 180)
    killed = new_workers()[0]
    into = 1 if dies == "as-it-begins" else 2
    rejoined = coordinator.wait_rejoined(into, timeout=180)
    superseded = coordinator.wait_rejoined(1, timeout=5) if into == 2 else None
    fit.join(240)
    assert not fit.is_alive(), "the run did not finish"
    assert box["result"].error is None, box["result"].error

    if dies == "in-its-load":
        assert not os.path.exists(die_in_load), "the new worker never loaded"
    joined = _lines(files["attempts"])[3:]
    assert [int(a[0]) for a in joined] == [1], joined
    assert int(joined[0][4]) not in (first[1], killed), "a third process for rank 1 joined"
    # The warm restart the slot's next process joined
    assert rejoined is not None and rejoined["result"] == "rejoined", rejoined
    if superseded is not None:  # the warm restart the dead worker joined: ended with its cycle
        assert superseded["result"] == "failed", superseded
        assert "ended before 1 member(s) joined" in superseded["reason"], superseded
    pids = {m["member"]: m["pid"] for m in rejoined["members"]}
    assert pids["ray-train:train/1"] == int(joined[0][4]), rejoined
    progress = _lines(files["progress"])
    for rank in (0, 2):
        assert {int(p[3]) for p in progress if int(p[0]) == rank} == {first[rank]}
    _each_rank_ran_every_step_once(files, 30)


def _remove_train_placement_groups() -> None:
    """Every placement group still created that reserves a ``train_slot`` (Ray Train's)."""
    import ray
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    for pg_id, info in ray.util.placement_group_table().items():
        bundles = info.get("bundles", {}).values()
        if info.get("state") == "CREATED" and any("train_slot" in b for b in bundles):
            remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg_id))))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@needs_replica_groups
@pytest.mark.timeout(400)
def test_the_train_controller_killed_ends_the_run_and_the_next_fit_resumes_committed(
    three_nodes, tmp_path
):
    """Ray Train's controller is not restarted by Ray (2.60 starts it without
    ``max_restarts``), and the run's coordinator and workers share its fate. After a warm
    restart (step S committed), the controller is SIGKILLed: ``fit`` raises, every worker
    process is gone within the teardown's bound, and nothing hangs. The user's next ``fit`` of
    the same run starts from S - the committed step, not a later step any worker had reached -
    and every rank ends with the same model and optimizer."""
    config = _config(tmp_path, memory_replicas=0)
    fit, box, files = _start(tmp_path, config, total=60)
    first = _first_pids_past_step_5(files, fit)
    coordinator = Coordinator.connect(config)
    os.kill(first[1], signal.SIGTERM)
    outcome = coordinator.wait_outcome(timeout=60, cycle=0)
    assert outcome is not None and outcome.result == "committed", outcome
    committed = int(outcome.committed["step"])
    rejoined = coordinator.wait_rejoined(1, timeout=120)
    assert rejoined is not None and rejoined["result"] == "rejoined", rejoined
    _wait_until(
        "every rank 3 steps past the committed one",
        lambda: (
            {int(p[0]) for p in _lines(files["progress"]) if int(p[1]) >= committed + 3}
            == {0, 1, 2}
        ),
        fit,
        120,
    )
    workers = {int(a[4]) for a in _lines(files["attempts"])}
    (controller,) = live_actor_pids("TrainController")
    os.kill(controller, signal.SIGKILL)
    fit.join(120)
    assert not fit.is_alive(), "fit() did not return after its controller died"
    assert "result" not in box, "fit() returned as if the run had finished"
    deadline = time.monotonic() + config.teardown_timeout_s + 30
    while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in workers if _alive(pid)], "a worker outlived its run"

    # Train's PlacementGroupCleaner removes a dead controller's placement group, but it asks
    # the state API, which needs the dashboard: this cluster has none, so the group would hold
    # every train_slot and the next fit would wait forever. Removed here, as the cleaner would.
    _remove_train_placement_groups()
    reached = max(int(p[1]) for p in _lines(files["progress"]))
    assert reached > committed
    before = len(_lines(files["attempts"]))
    progress_before = len(_lines(files["progress"]))
    again, box_again, _ = _start(tmp_path, config, total=60)
    again.join(300)
    assert not again.is_alive(), "the second fit did not finish"
    assert box_again["result"].error is None, box_again["result"].error
    starts = _lines(files["attempts"])[before:]
    assert sorted((int(a[0]), int(a[2])) for a in starts) == [(r, committed) for r in (0, 1, 2)]
    resumed = _lines(files["progress"])[progress_before:]
    for rank in (0, 1, 2):
        steps = sorted(int(p[1]) for p in resumed if int(p[0]) == rank)
        assert steps == list(range(committed + 1, 61)), (rank, steps)
    final = _lines(files["final"])
    assert sorted(int(f[0]) for f in final) == [0, 1, 2]
    assert {(int(f[1]), f[2]) for f in final} == {(60, final[0][2])}, final


@pytest.mark.long
@pytest.mark.skipif(ray_has_replica_groups(), reason="the fallback of a Ray without replica groups")
@pytest.mark.timeout(400)
def test_without_replica_groups_train_restarts_the_group_from_the_committed_step(
    three_nodes, tmp_path
):
    """Ray < 2.56 (``.ci/versions.sh`` runs this on the oldest Ray): the same job and switch,
    one worker SIGTERMed. Train restarts every worker; nobody was kept to rejoin (it would be
    killed in its rejoin), and every worker resumes from the step committed as it left."""
    config = _config(tmp_path)
    fit, box, files = _start(tmp_path, config)
    first = _first_pids_past_step_5(files, fit)
    os.kill(first[1], signal.SIGTERM)
    fit.join(300)
    assert not fit.is_alive(), "the run did not finish"
    assert box["result"].error is None, box["result"].error
    restarted = {int(a[0]): int(a[2]) for a in _lines(files["attempts"])[3:]}
    assert sorted(restarted) == [0, 1, 2] and len(set(restarted.values())) == 1, restarted
    _each_rank_ran_every_step_once(files, 30)
    outcomes = [json.loads(p.read_text()) for p in (tmp_path / "reports").rglob("outcome-*.json")]
    assert [(o["result"], o["warm"]) for o in outcomes] == [("committed", None)], outcomes
