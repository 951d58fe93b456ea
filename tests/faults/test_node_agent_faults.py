"""The node agent on real ranks: orders through it, and its loss.

The four gloo ranks of ``test_faults.py`` with ``node_agent='on'``: they register, poll,
acknowledge and report through their node's agent (one actor per job and node,
``node/agent.py``). A SIGTERM still ends in a committed checkpoint; an agent killed with SIGKILL
is noticed by its ranks, which register with the coordinator directly, and the next eviction
ends as cleanly.
Same bookkeeping (docs/reliability.md).
"""

from __future__ import annotations

import os
import signal

import pytest
import ray

from ray_graceful.coordinator import Coordinator
from ray_graceful.node.agent import agent_name
from ray_graceful.ray_adapter import actor_id_of
from tests.faults.test_faults import fault_config, run_and_record, start
from tests.helpers import wait_for


@pytest.fixture
def config(tmp_path):
    return fault_config(tmp_path).replace(node_agent="on")


@pytest.fixture
def coordinator(ray_cluster, config):
    coord = Coordinator.start(config)
    yield coord
    coord.shutdown()


def node_agent(config, coordinator, rank):
    """The agent of ``rank``'s node (``rank`` not inside a call: rank 3 of ``start``)."""
    job = ray.get_runtime_context().get_job_id()
    node = ray.get(rank.node.remote(), timeout=30)
    name = agent_name(job, actor_id_of(coordinator.handle), node)
    return ray.get_actor(name, namespace=config.coordinator_namespace)


def relayed(coordinator) -> dict:
    return coordinator.status()["node_agents"]


def evict_one_and_record(name, fault_log, config, coordinator, exit_recorder, pids, ranks):
    """SIGTERM to rank 1; every rank out by its deadline and the checkpoint committed."""
    os.kill(pids[1], signal.SIGTERM)
    outcome = run_and_record(name, fault_log, config, coordinator, exit_recorder, pids, ranks)
    assert outcome.result == "committed", outcome.reason
    assert outcome.missing == [] and len(outcome.reports) == 4, "every rank's report arrived"


def test_sigterm_through_the_node_agent(rep, fault_log, config, coordinator, exit_recorder):
    scene = (fault_log, config, coordinator, exit_recorder)
    ranks, pids = start(config, exit_recorder)
    agents = wait_for(lambda: relayed(coordinator), 10, "the node agent's first poll")
    assert [a["processes"] for a in agents.values()] == [4], "four ranks, one node, one agent"
    agent = node_agent(config, coordinator, ranks[-1])
    described = ray.get(agent.describe.remote(), timeout=10)
    assert described["processes"] == 4 and described["upstream_polls"] >= 1, described
    evict_one_and_record("SIGTERM, ranks relayed by their node agent", *scene, pids, ranks)
    # The agent outlives the rank that started it: the last rank out still reports through it.
    through_agent = coordinator.stats()["reports_relayed"]
    assert through_agent == 4, f"{through_agent} of 4 reports came through the agent"
    assert ray.get(agent.describe.remote(), timeout=10)["pid"] == described["pid"], "still up"
    coordinator.shutdown()  # the job's coordinator gone for good: the agent leaves with it
    wait_for(lambda: gone(agent), 30, "the node agent to leave with its coordinator")


def gone(actor) -> bool:
    try:
        ray.get(actor.describe.remote(), timeout=5)
    except ray.exceptions.RayActorError:
        return True
    return False


def test_node_agent_killed(rep, fault_log, config, coordinator, exit_recorder):
    scene = (fault_log, config, coordinator, exit_recorder)
    ranks, pids = start(config, exit_recorder)
    wait_for(lambda: relayed(coordinator), 10, "the node agent's first poll")
    agent = node_agent(config, coordinator, ranks[-1])
    agent_pid = ray.get(agent.describe.remote(), timeout=10)["pid"]
    os.kill(agent_pid, signal.SIGKILL)  # a crash of the agent's process
    wait_for(lambda: not relayed(coordinator), 20, "the ranks to poll the coordinator directly")
    assert len(coordinator.status()["ranks"]) == 4, "every rank registered again, directly"
    evict_one_and_record("a node agent killed (SIGKILL), then SIGTERM", *scene, pids, ranks)
