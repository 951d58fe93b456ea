"""A SkyRL-style hand-built worker group that adopts ray_graceful, end to end, and comes back warm.

The worker base class is undecorated (like SkyRL's ``DistributedTorchRayActor``); adopting the
plugin is two lines - the mixin on the base, and ``graceful_setup`` right after
``init_process_group`` - and a warm restart three more (``rejoin``). The driver starts one
coordinator with ``warm_restart=True`` and one spare. Then one rank gets SIGTERM while the others
are blocked in an all-reduce: every rank is released within a second, the chosen replica of each
shard saves, the checkpoint is committed, and - instead of a new group - the survivors keep
their processes, the spare takes the evicted slot, and the group re-forms in place at the
committed step.

    python examples/actor_group.py                 # on a local Ray instance
    python examples/actor_group.py --address auto  # on a running cluster
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import socket
import tempfile
import time

import ray
import torch
import torch.distributed as dist

import ray_graceful
from ray_graceful import Coordinator, GracefulConfig, GracefulWorkerMixin


class DistributedTorchRayActor(GracefulWorkerMixin):  # (1) the mixin, on the undecorated base
    def __init__(
        self, world_size: int = 0, rank: int = 0, master_addr: str = "", master_port: int = 0
    ) -> None:
        self._world_size, self._rank = world_size, rank
        self._master_addr, self._master_port = master_addr, master_port
        torch.manual_seed(0)
        self.model = torch.nn.Linear(32, 32)
        self.step = 0

    def init_worker_process_group(self, config: GracefulConfig) -> str:
        os.environ.update(MASTER_ADDR=self._master_addr, MASTER_PORT=str(self._master_port))
        dist.init_process_group(
            "gloo",
            rank=self._rank,
            world_size=self._world_size,
            timeout=datetime.timedelta(seconds=600),
        )
        # (2) one call right after init_process_group. Ranks r and r+2 hold the same shard.
        status = self.graceful_setup(
            "policy",
            shard=self._rank % 2,
            config=config,
            state_dict=self.model.state_dict,
            load_state_dict=self.model.load_state_dict,  # what a warm restart loads into
        )
        return str(status)

    def rejoin(self, config: GracefulConfig) -> ray_graceful.Rejoined:  # (3) the warm restart
        joined = self.graceful_rejoin(
            state_dict=self.model.state_dict,
            load_state_dict=self.model.load_state_dict,
            config=config,
        )
        self.step = joined.step if joined.joined else self.step
        return joined

    def train(self, steps: int, step_s: float = 0.2) -> int:
        for _ in range(steps):
            for p in self.model.parameters():
                grad = torch.ones_like(p)
                dist.all_reduce(grad)  # where a rank sits when a peer is gone
                p.data.sub_(1e-3 * grad)
            self.step += 1
            if self.should_stop(self.step):  # a flag read per step
                break
            time.sleep(step_s)
        return self.step

    def pid(self) -> int:
        return os.getpid()


@ray.remote(num_cpus=0)
class PolicyWorker(DistributedTorchRayActor):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_group(config: GracefulConfig, world: int) -> list:
    port = free_port()
    ranks = [PolicyWorker.remote(world, r, "127.0.0.1", port) for r in range(world)]
    statuses = ray.get([r.init_worker_process_group.remote(config) for r in ranks])
    print(statuses[0])
    return ranks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", default="local", help="Ray address (default: local)")
    parser.add_argument("--world", type=int, default=4)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="actor-group-") as work:  # removed at the end
        run(args, work)


def run(args: argparse.Namespace, work: str) -> None:
    config = GracefulConfig(
        checkpoint_dir=os.path.join(work, "ckpt"),
        report_dir=os.path.join(work, "reports"),
        coordinator_name=f"example-{os.getpid()}",
        warm_restart=True,
    )
    ray.init(address=args.address)
    coordinator = Coordinator.start(config)

    ranks = start_group(config, args.world)
    spare = PolicyWorker.remote()  # imports done, model built: waits for an evicted slot
    group = ray_graceful.WarmGroup(
        coordinator, ranks, spares=[spare], method="rejoin", args=(config,)
    )
    pids = ray.get([r.pid.remote() for r in ranks])  # asked now: a busy sync actor answers nothing
    ray.get([r.train.remote(3, 0.0) for r in ranks])  # three steps everywhere
    stuck = [r.train.remote(10_000) for r in ranks[:-1]]  # the last rank never joins:
    time.sleep(1.0)  # the others block in all_reduce
    assert not ray.wait(stuck, timeout=0)[0]

    print(f"SIGTERM to rank 0 (pid {pids[0]}) while ranks 0-{args.world - 2} sit in all_reduce")
    os.kill(pids[0], signal.SIGTERM)
    for i, ref in enumerate(stuck):  # each blocked all_reduce ended at once, with an error
        try:
            ray.get(ref, timeout=30)
        except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError) as exc:
            print(f"  rank {i}: train() ended with {type(exc).__name__}")

    restart = group.restart(timeout=60)  # the one call: survivors + spare, re-formed in place
    print(restart.outcome.plan_table)
    print(restart.outcome.summary())
    new_pids = ray.get([r.pid.remote() for r in group.workers])
    for member, pid in zip(restart.members, new_pids, strict=True):
        kept = "same process" if pid in pids else "new process"
        print(
            f"  rank {member.rank}: {member.was}, {kept} (pid {pid}), state from "
            f"{member.loaded_from} in {sum(member.seconds.values()):.2f}s"
        )
    steps = ray.get([r.train.remote(2, 0.0) for r in group.workers])
    print(f"warm restart from step {restart.step}; now at step {steps[0]}")
    coordinator.job_finished()
    for r in group.workers:
        ray.kill(r)
    coordinator.shutdown()


if __name__ == "__main__":
    main()
