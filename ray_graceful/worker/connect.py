"""How a rank process connects: its job's coordinator, found by name; its node's agent, started
or found (``node/agent.py``); the control channel through one or the other.

``runtime`` is the process's ``ProcessRuntime`` (``process_runtime.py``): the channel is kept on it,
along with the agent's handle (Ray ends an actor once no handle to it is left).
"""

from __future__ import annotations

from typing import Any

from ..config import GracefulConfig
from ..node.agent import agent_wanted, ensure_agent, uses_agent
from .control import ControlChannel, find_coordinator


def connect(runtime: Any, config: GracefulConfig) -> str:
    """Register this process's ranks with the coordinator, if one runs; say what happened."""
    if runtime.control is None or not runtime.control.alive:
        handle = find_coordinator(config)
        if handle is None:
            runtime.watch_peers()
            return (
                "no coordinator runs for this job: on SIGTERM this rank tears itself down on "
                "its own"
            )
        world_size = max((spec.world_size for spec in runtime.rank_specs()), default=0)
        relayed = uses_agent(config, world_size)
        agent, note = _node_agent(runtime, config, handle, world_size)
        runtime.control = ControlChannel(
            handle,
            config,
            ranks=runtime.rank_specs,
            last_step=lambda: runtime.loop.last_step,
            on_order=runtime.on_order,
            done=lambda: runtime.teardown is not None,
            on_disconnect=runtime.watch_peers,
            relay=agent if relayed else None,
            on_link=runtime.on_link,
        )
    else:
        note = ""
    status = runtime.control.register() + note
    if not runtime.control.connected:
        runtime.watch_peers()
    return status


def _node_agent(runtime: Any, config: GracefulConfig, coordinator: Any, world_size: int) -> tuple:
    """This node's agent, if this process relays through it, or cloud notices or the host
    watch are on."""
    if not agent_wanted(config, world_size):
        return None, ""
    try:
        runtime.node_agent = ensure_agent(config, coordinator)
    except Exception as exc:  # an addition: never a reason to fail setup
        return None, f"; no node agent ({exc!r}): polling the coordinator directly"
    return runtime.node_agent, ""
