"""One node agent per node, on two raylets: each relays its own node's ranks, and one notice
for one node orders every rank of the group through both agents.

With ``node_group_size=1`` the coordinator answers the first node's agent itself and the
second's through a group agent (``node/group.py``): both levels of the tree carry the orders,
and a group agent killed is replaced when its node agent asks again."""

from __future__ import annotations

import os
import signal
import time

import pytest
import ray

from ray_graceful import latest_committed
from ray_graceful.coordinator import Coordinator
from ray_graceful.node.agent import agent_name
from ray_graceful.ray_adapter import actor_id_of
from tests import actors
from tests.helpers import fast_config, free_port, kill_actors, wait_for


def relaying(agent, processes: int) -> dict | None:
    """The agent's own account once it relays ``processes`` rank processes."""
    described = ray.get(agent.describe.remote(), timeout=10)
    return described if described["processes"] == processes else None


def group_agents(coordinator) -> dict[str, int]:
    """The coordinator's group agents: key -> nodes placed in it."""
    return coordinator.status()["group_agents"]["groups"]


def polling(coordinator, key: str, processes: int) -> bool:
    """Whether ``key`` (a node agent or group agent) polls the coordinator for ``processes``."""
    relayed = coordinator.status()["node_agents"].get(key)
    return relayed is not None and relayed["processes"] == processes


def test_each_node_has_its_agent_and_an_order_reaches_every_rank_through_them(
    nodes, tmp_path, exit_recorder
):
    config = fast_config(
        tmp_path,
        node_agent="on",
        node_group_size=1,
        teardown_timeout_s=15.0,
        save_budget_s=8.0,
    )
    coordinator = Coordinator.start(config)
    actor = ray.remote(actors.GracefulTrainer)
    where = ["a", "a", "b", "b"]
    ranks = [
        actor.options(
            num_cpus=0, resources={f"node_{n}": 1}, runtime_env=exit_recorder.runtime_env()
        ).remote()
        for n in where
    ]
    try:
        port = free_port()
        statuses = ray.get(
            [
                r.setup.remote(i, 4, "127.0.0.1", port, config, shard=str(i % 2))
                for i, r in enumerate(ranks)
            ],
            timeout=120,
        )
        assert all("orders arrive through a long poll" in s for s in statuses), statuses
        pids = ray.get([r.pid.remote() for r in ranks], timeout=30)
        job = ray.get_runtime_context().get_job_id()
        agents = {
            n: ray.get_actor(
                agent_name(job, actor_id_of(coordinator.handle), nodes[n]),
                namespace=config.coordinator_namespace,
            )
            for n in ("a", "b")
        }
        for n, agent in agents.items():
            described = wait_for(lambda a=agent: relaying(a, 2), 20, f"node {n}'s agent")
            assert described["node_id"] == nodes[n], "pinned to its own node"

        # one node agent polls the coordinator itself, the other through the group agent
        groups = wait_for(lambda: group_agents(coordinator), 20, "a group agent")
        assert list(groups.values()) == [1], groups
        first_group = next(iter(groups))
        relayed = wait_for(lambda: coordinator.status()["node_agents"], 10, "the agents' polls")
        assert sorted(relayed) == sorted([first_group, *set(relayed) - {first_group}])
        wait_for(lambda: polling(coordinator, first_group, 2), 10, "the group agent's poll")

        # the group agent dies: its node agent asks again, and a new one takes its place
        places = ray.get([coordinator.handle.join_group.remote(nodes[n]) for n in "ab"], timeout=10)
        (key, group), *_ = [place for place in places if place is not None]
        assert key == first_group and places.count(None) == 1, "each node keeps its place"
        os.kill(ray.get(group.describe.remote(), timeout=10)["pid"], signal.SIGKILL)
        replaced = wait_for(
            lambda: [k for k in group_agents(coordinator) if k != first_group], 30, "a new group"
        )
        wait_for(lambda: polling(coordinator, replaced[0], 2), 30, "the node's processes back")
        assert len(coordinator.status()["ranks"]) == 4, "every rank registered, once"

        assert ray.get([r.train.remote(3) for r in ranks], timeout=60) == [3] * 4
        training = [r.train.remote(10**6, 0.01) for r in ranks]
        reply = coordinator.notify(
            node_id=nodes["a"], reason="test: node a evicted", deadline=time.time() + 15
        )
        assert reply.accepted, reply.reason
        outcome = coordinator.wait_outcome(timeout=40, cycle=0)
        assert outcome is not None and outcome.result == "committed", outcome
        # the agents outlive the ranks that started them: every report came through them
        relayed = coordinator.stats()["reports_relayed"]
        assert relayed == 4, f"{relayed} of 4 reports came through the agents"
        codes = [exit_recorder.wait(pid, 20) for pid in pids]
        assert None not in codes, "every rank of the group left through its node's agent"
        ray.wait(training, num_returns=4, timeout=10)
        latest = latest_committed(config.checkpoint_dir)
        assert latest is not None and sorted(latest.shards) == ["trainer/0", "trainer/1"]
    finally:
        kill_actors(*ranks)
        coordinator.shutdown()


def test_ray_trains_callback_starts_each_workers_node_agent_before_the_workers_set_up(
    nodes, tmp_path
):
    """Under Ray Train the run's callback starts the agents as Train creates the workers
    (``before_init_train_context``, for the whole group and for each replacement), so a worker's
    ``setup`` finds its node's agent up instead of waiting for its new process; with nothing
    for an agent to do, none is started."""
    from types import SimpleNamespace

    from ray_graceful.train import GracefulTrainCallback

    def worker(node: str) -> SimpleNamespace:
        return SimpleNamespace(
            metadata=SimpleNamespace(node_id=nodes[node]),
            distributed_context=SimpleNamespace(world_size=3),
        )

    job = ray.get_runtime_context().get_job_id()
    quiet = dict(host_watch=False, node_agent="off", cloud_notices="off")
    for settings, started in (({}, True), (quiet, False)):
        callback = GracefulTrainCallback(fast_config(tmp_path, **settings))
        callback.after_controller_start(SimpleNamespace(backend_config=None))
        try:
            assert callback.before_init_train_context([worker("a"), worker("b"), worker("a")]) == {}
            coordinator_id = actor_id_of(callback._coordinator.handle)
            for n in ("a", "b"):
                name = agent_name(job, coordinator_id, nodes[n])
                if not started:
                    with pytest.raises(ValueError):
                        ray.get_actor(name, namespace=callback.config.coordinator_namespace)
                    continue
                agent = ray.get_actor(name, namespace=callback.config.coordinator_namespace)
                described = ray.get(agent.describe.remote(), timeout=60)
                assert described["node_id"] == nodes[n], "pinned to the worker's node"
        finally:
            callback.after_controller_finish(SimpleNamespace(error=None))
