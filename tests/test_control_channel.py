"""The worker's control channel against a stand-in coordinator: a real Ray actor speaking the
coordinator's protocol, so one rule can be held fixed while the channel runs for real."""

from __future__ import annotations

import asyncio
import queue
import time

import ray

from ray_graceful import GracefulConfig
from ray_graceful.protocol import PollAnswer, PollKind, RankSpec, Reply, TeardownOrder
from ray_graceful.worker import control
from ray_graceful.worker.control import ControlChannel
from tests.helpers import wait_for


@ray.remote(num_cpus=0)
class AcksHeld:
    """Accepts the registration, answers the first poll with an order, and holds every
    acknowledgement unanswered until ``answer_acks``."""

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        self.answering = asyncio.Event()
        self.acks_in = self.acks_answered = 0

    async def register(self, message) -> Reply:
        return Reply.ok(0)

    async def poll(self, process_id, cycle, state, wait_s) -> PollAnswer:
        order = TeardownOrder(self.job_id, 0, "o-0", time.time() + 60, "test: held acks")
        return PollAnswer(PollKind.ORDER, order)

    async def ack(self, message) -> Reply:
        self.acks_in += 1
        await self.answering.wait()
        self.acks_answered += 1
        return Reply.ok(0)

    async def answer_acks(self) -> None:
        self.answering.set()

    async def acks(self) -> tuple[int, int]:
        return self.acks_in, self.acks_answered


def test_an_order_is_carried_out_before_its_acknowledgement_is_answered(
    ray_cluster, tmp_path, monkeypatch
):
    """Waiting for the acknowledgement's answer held every rank's teardown up by a round trip
    to a coordinator answering all of them at once (or a node agent's batch); the order is
    carried out at once, and the acknowledgement still reaches the coordinator."""
    # A channel that waited for the answer would wait this long here: far past the test's wait.
    monkeypatch.setattr(control, "REPORT_TIMEOUT_S", 600.0)
    job_id = ray.get_runtime_context().get_job_id()
    coordinator = AcksHeld.remote(job_id)
    orders: queue.Queue[TeardownOrder] = queue.Queue()
    channel = ControlChannel(
        coordinator,
        GracefulConfig(report_dir=str(tmp_path), health_probe="none"),
        ranks=lambda: (RankSpec("g", 0, 1, "0", True),),
        last_step=lambda: None,
        on_order=orders.put,
        done=lambda: False,
    )
    try:
        assert "orders arrive through a long poll" in channel.register()
        order = orders.get(timeout=30)  # the acknowledgement is still unanswered here
        assert order.order_id == "o-0" and channel.order_received.is_set()
        wait_for(
            lambda: ray.get(coordinator.acks.remote(), timeout=10) == (1, 0),
            timeout=30,
            what="the acknowledgement in, unanswered, with the order already carried out",
        )
        ray.get(coordinator.answer_acks.remote(), timeout=10)
        wait_for(
            lambda: ray.get(coordinator.acks.remote(), timeout=10) == (1, 1),
            timeout=30,
            what="the acknowledgement answered",
        )
    finally:
        channel.alive = False
        ray.kill(coordinator)


@ray.remote(num_cpus=0)
class Refuses:
    """Refuses every registration for good (another job's coordinator, say)."""

    async def register(self, message) -> Reply:
        return Reply.refused("this coordinator belongs to job 07")


def test_the_channel_says_where_its_link_is_and_why(ray_cluster, tmp_path):
    """A refused registration and a coordinator that cannot be reached are each a state of
    the link with its reason - what a rank's setup status and a failed rejoin show."""
    from ray_graceful.worker.control import Channel

    def channel_to(handle) -> ControlChannel:
        return ControlChannel(
            handle,
            GracefulConfig(report_dir=str(tmp_path), health_probe="none"),
            ranks=lambda: (RankSpec("g", 0, 1, "0", True),),
            last_step=lambda: None,
            on_order=lambda order: None,
            done=lambda: False,
        )

    refusing = Refuses.remote()
    refused = channel_to(refusing)
    assert "refused the registration" in refused.register()
    assert (refused.state, refused.why) == (Channel.REFUSED, "this coordinator belongs to job 07")
    assert refused.describe() == "registration refused: this coordinator belongs to job 07"
    assert not refused.connected

    ray.kill(refusing, no_restart=True)
    from ray_graceful.bounded import NoAnswer, call

    wait_for(
        lambda: isinstance(call(refusing.register, None, timeout=5), NoAnswer),
        timeout=30,
        what="the stand-in coordinator gone",
    )
    gone = channel_to(refusing)
    assert "unreachable" in gone.register()
    assert gone.state is Channel.UNREACHABLE and "ActorDiedError" in gone.why, gone.describe()
