"""The stop step a group's ranks agree on before any is released (``worker/stop_step.py``).

Pure logic over a real ``torch.distributed.HashStore`` (the store API the group's own
``TCPStore`` has), shared by threads that play the ranks; the group is a seam: an object whose
``get_group_store()`` gives that store, as a process group's does. The whole path - real gloo
ranks, one parked at k and one inside step k+1 - is ``test_warm_restart``'s
``test_a_survivor_inside_the_next_step_when_the_order_came_still_holds_its_shard``.
"""

from __future__ import annotations

import threading

import pytest

pytestmark = pytest.mark.unit


class _Group:
    def __init__(self, store) -> None:
        self.store = store

    def get_group_store(self):
        return self.store


def _handles(world: int):
    import torch.distributed as dist

    from ray_graceful.worker.process_groups import GroupHandle

    group = _Group(dist.HashStore())
    return [GroupHandle("trainer", rank, world, group) for rank in range(world)]


def _agree_all(positions, timeout_s: float = 5.0, cycle: int = 3):
    from ray_graceful.worker.stop_step import agree

    handles = _handles(len(positions))
    results: list = [None] * len(positions)

    def rank(i: int) -> None:
        results[i] = agree([handles[i]], cycle, positions[i], timeout_s)

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(len(positions))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s + 5)
    return results


def test_ranks_parked_at_k_and_inside_step_k_plus_1_agree_on_k_plus_1():
    from ray_graceful.worker.stop_step import Position

    results = _agree_all([Position(7, True), Position(8, True), Position(8, True)])
    assert [step for step, _ in results] == [8, 8, 8]
    assert "stop step 8 agreed (this rank was at 7)" in results[0][1]


def test_ranks_all_parked_at_one_step_stop_there():
    from ray_graceful.worker.stop_step import Position

    results = _agree_all([Position(7, True)] * 4)
    assert [step for step, _ in results] == [7, 7, 7, 7]


def test_a_rank_out_of_its_loop_below_the_step_its_peers_need_ends_the_agreement():
    """It cannot train on: every rank is told there is no stop step, and all are released as
    before (none waits for a rank that will never reach the step)."""
    from ray_graceful.worker.stop_step import Position

    results = _agree_all([Position(7, False), Position(8, True)])
    assert [step for step, _ in results] == [None, None]
    assert "left its loop at step 7" in results[0][1]
    assert "left its loop at step 7, below the stop step 8" in results[1][1]


def test_a_rank_out_of_its_loop_at_the_step_everyone_stops_at_is_no_obstacle():
    from ray_graceful.worker.stop_step import Position

    results = _agree_all([Position(7, False), Position(7, True)])
    assert [step for step, _ in results] == [7, 7]


def test_a_rank_that_never_says_where_ends_the_wait_within_the_timeout():
    import time

    from ray_graceful.worker.stop_step import Position, agree

    handles = _handles(2)
    started = time.monotonic()
    step, why = agree([handles[0]], 1, Position(4, True), timeout_s=0.3)
    assert step is None
    assert time.monotonic() - started < 3
    assert why == "1 of 2 ranks of group 'trainer' said where they stop within 0.30s"


def test_cycles_do_not_mix_in_one_store():
    """A group's store outlives a cycle: the next cycle's agreement counts afresh."""
    from ray_graceful.worker.stop_step import Position, agree

    handles = _handles(1)
    assert agree([handles[0]], 1, Position(4, True), 1.0)[0] == 4
    assert agree([handles[0]], 2, Position(9, True), 1.0)[0] == 9


def test_every_rank_parked_is_waited_for_and_a_missing_one_is_named():
    from ray_graceful.worker.stop_step import all_parked

    handles = _handles(2)
    said: list[str] = []
    other = threading.Thread(target=lambda: said.append(all_parked([handles[1]], 5, 5.0)))
    other.start()
    assert all_parked([handles[0]], 5, 5.0) == "every rank parked at it"
    other.join(5)
    assert said == ["every rank parked at it"]
    alone = _handles(2)
    assert all_parked([alone[0]], 5, 0.2) == "1 of 2 ranks of group 'trainer' parked"


def test_a_group_without_a_store_agrees_on_nothing():
    from ray_graceful.worker.process_groups import GroupHandle
    from ray_graceful.worker.stop_step import Position, agree

    class _Gone:
        def get_group_store(self):
            raise RuntimeError("the group was destroyed")

    step, why = agree([GroupHandle("trainer", 0, 2, _Gone())], 1, Position(3, True), 1.0)
    assert step is None and why == "group 'trainer' has no store to agree in"
