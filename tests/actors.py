"""Worker classes shaped like the frameworks the mixin must fit (RAY_FACTS' table).

Each is an *undecorated* base with the mixin, as a user would write it; tests decorate them
with ``ray.remote(...)`` in the shape under test (plain, concurrency groups, threaded, async).
Training is a loop of gloo all-reduces; a rank that does not call ``train`` leaves its peers
blocked in the first one, which is how the tests hold a training thread inside a collective.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import threading
import time

import ray
import torch
import torch.distributed as dist

import ray_graceful
from ray_graceful import GracefulConfig, GracefulWorkerMixin
from tests.helpers import mark_collective, saving_path


def all_reduce_seen(tensor: torch.Tensor, group: object = None) -> None:
    """``dist.all_reduce``, marked in and out where the test sees it (``wait_in_collective``)."""
    mark_collective(os.getpid(), "in")
    dist.all_reduce(tensor, group=group)
    mark_collective(os.getpid(), "out")


def init_gloo(rank: int, world: int, addr: str, port: int, timeout_s: float = 120.0) -> None:
    os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port))
    mark_collective(os.getpid(), "out")  # a file left by an earlier process of this pid
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s)
    )


def thread_info() -> dict:
    return {
        "thread": threading.current_thread().name,
        "main": threading.current_thread() is threading.main_thread(),
    }


class Trainer:
    """The user's own worker base, before adopting ray_graceful (no mixin)."""

    def __init__(self, marker: str | None = None, install_in_init: bool = False) -> None:
        self.model = torch.nn.Linear(4, 4)
        self.step = 0
        if marker is not None:  # a handler the user (or a framework) had already installed

            def user_handler(signum, frame):
                with open(marker, "a") as f:
                    f.write(f"user handler ran in {os.getpid()}\n")

            signal.signal(signal.SIGTERM, user_handler)
        if install_in_init:
            ray_graceful.install_signal_handling()

    def pid(self) -> int:
        return os.getpid()

    def cwd(self) -> str:
        return os.getcwd()

    def where(self) -> dict:
        return thread_info()

    def init(self, rank: int, world: int, addr: str, port: int) -> None:
        init_gloo(rank, world, addr, port)

    def load(self, path: str) -> int:
        """Resume from an emergency checkpoint shard written by the default saver."""
        saved = ray_graceful.load_state_dict(path)
        self.model.load_state_dict(saved["state"]["model"])
        self.step = saved["step"]
        return self.step

    def restore(self, shard: str, config) -> dict:
        """Resume from the newest committed checkpoint, whichever tier holds it."""
        loaded = ray_graceful.load_latest("trainer", shard, config)
        if loaded is None:
            return {"step": None, "tier": None}
        self.model.load_state_dict(loaded.state["model"])
        self.step = loaded.step
        return {"step": loaded.step, "tier": loaded.tier, "source": loaded.source}

    def weights_sum(self) -> float:
        return float(sum(p.sum() for p in self.model.parameters()))

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def train(self, steps: int, sleep_s: float = 0.0) -> int:
        for step in range(self.step, self.step + steps):
            grad = torch.ones(1024)
            all_reduce_seen(grad)
            with torch.no_grad():
                for p in self.model.parameters():
                    p.add_(0.001)
            self.step = step + 1
            if self.should_stop(self.step):
                break
            if sleep_s:
                time.sleep(sleep_s)
        return self.step

    def should_stop(self, step: int | None = None) -> bool:
        return False  # the user's own loop control, before adopting the mixin

    def make_extra_group(self) -> None:
        """A second gloo group (collective: every rank calls it), never registered for abort."""
        self.extra_group = dist.new_group(backend="gloo")

    def all_reduce_on_extra_group(self) -> bool:
        all_reduce_seen(torch.ones(8), group=self.extra_group)
        return True

    def fork_sleeper(self) -> int:
        """Fork a child (as a DataLoader does) that sleeps; returns once the child runs."""
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.write(write_fd, b"r")
                time.sleep(60)
            finally:
                os._exit(0)
        os.close(write_fd)
        os.read(read_fd, 1)
        os.close(read_fd)
        self._child = pid
        return pid

    def reap_child(self, timeout: float = 10.0) -> int | None:
        """The forked child's exit status (waitpid), or None if it is still alive."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            pid, status = os.waitpid(self._child, os.WNOHANG)
            if pid:
                return status
            time.sleep(0.02)
        return None

    def alive(self) -> bool:
        return True


class GracefulTrainer(GracefulWorkerMixin, Trainer):
    """The same worker after adopting the mixin: one base more, one call after init."""

    def setup(
        self,
        rank: int,
        world: int,
        addr: str,
        port: int,
        config: GracefulConfig,
        shard: str | None = None,
        hang_save: str | None = None,
        save_seconds: float = 0.0,
        fail_save: bool = False,
        ballast_mb: int = 0,
    ) -> str:
        self.init(rank, world, addr, port)
        self._ballast = torch.zeros(ballast_mb << 18)  # float32: ballast_mb MiB more to save
        self._hang_save = hang_save
        self._save_seconds = save_seconds
        with contextlib.suppress(FileNotFoundError):  # left by an earlier process of this pid
            os.remove(saving_path(os.getpid()))
        self._fail_save = fail_save
        status = self.graceful_setup("trainer", shard=shard, config=config, state_dict=self._state)
        return str(status)

    def _state(self) -> dict:
        if getattr(self, "_hang_save", None):
            with open(self._hang_save, "w"):
                pass  # tell the test the save has started ...
            threading.Event().wait()  # ... and never return
        if getattr(self, "_save_seconds", 0.0):
            with open(saving_path(os.getpid()), "w"):
                pass  # tell the test the save has begun
        time.sleep(getattr(self, "_save_seconds", 0.0))  # a save of a realistic size
        if getattr(self, "_fail_save", False):
            raise OSError(28, "No space left on device (injected)")
        return {"model": self.model.state_dict(), "step": self.step, "ballast": self._ballast}

    def setup_before_init(self, config: GracefulConfig) -> str:
        return str(self.graceful_setup("trainer", config=config))


class AsyncGracefulTrainer(GracefulTrainer):
    """One ``async def`` turns the actor async: every method runs on the event loop thread."""

    async def ping(self) -> str:
        return "pong"


class ShadowingTrainer(GracefulTrainer):
    """A worker with an attribute named like the mixin's method (a real clash)."""

    def __init__(self) -> None:
        super().__init__()
        self.should_stop = False  # type: ignore[assignment,method-assign]


# --- SkyRL: DistributedTorchRayActor is an undecorated, async base; rank from constructor. ---


class DistributedTorchRayActor(GracefulWorkerMixin):
    def __init__(self, world_size: int, rank: int, master_addr: str, master_port: int) -> None:
        self._world_size, self._rank = world_size, rank
        self._master_addr, self._master_port = master_addr, master_port
        self.step = 0

    def init_worker_process_group(self, config: GracefulConfig) -> str:
        init_gloo(self._rank, self._world_size, self._master_addr, self._master_port)
        return str(
            self.graceful_setup(
                "policy", rank=self._rank, world_size=self._world_size, config=config
            )
        )

    async def get_node_local_rank(self) -> int:
        return self._rank

    def register_as(self, rank: int) -> str:
        return str(self.graceful_setup("policy", rank=rank))

    async def train_batch(self, steps: int) -> int:  # blocking torch calls inside async, as SkyRL
        for _ in range(steps):
            all_reduce_seen(torch.ones(1024))
            self.step += 1
            if self.should_stop(self.step):
                break
        return self.step

    def pid(self) -> int:
        return os.getpid()

    def where(self) -> dict:
        return thread_info()


class PolicyWorker(DistributedTorchRayActor):
    pass


# --- OpenRLHF: a sync base; the concrete class is @ray.remote-decorated (cannot be subclassed).


class BaseDistributedActor(GracefulWorkerMixin):
    def __init__(self, world_size: int, rank: int, master_addr: str, master_port: int) -> None:
        os.environ.update(
            WORLD_SIZE=str(world_size),
            RANK=str(rank),
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(master_port),
        )
        self.step = 0

    def pid(self) -> int:
        return os.getpid()

    def where(self) -> dict:
        return thread_info()


@ray.remote(num_cpus=0)
class ActorModelRayActor(BaseDistributedActor):
    def init_model_from_pretrained(self, config: GracefulConfig) -> str:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
        return str(self.graceful_setup("actor", config=config))

    def fit(self, steps: int) -> int:
        for _ in range(steps):
            all_reduce_seen(torch.ones(1024))
            self.step += 1
            if self.should_stop(self.step):
                break
        return self.step


# --- verl: Worker reads rank and rendezvous from the environment; the main role is async. ----


class Worker(GracefulWorkerMixin):
    def __init__(self) -> None:
        self._rank = int(os.environ["RANK"])
        self._world_size = int(os.environ["WORLD_SIZE"])
        self.step = 0

    def pid(self) -> int:
        return os.getpid()

    def where(self) -> dict:
        return thread_info()


class ActorRolloutRefWorker(Worker):
    def init_model(self, config: GracefulConfig) -> str:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
        return str(self.graceful_setup("actor_rollout", config=config))

    def update_actor(self, steps: int) -> int:
        for _ in range(steps):
            all_reduce_seen(torch.ones(1024))
            self.step += 1
            if self.should_stop(self.step):
                break
        return self.step

    async def generate_sequences(self) -> str:
        return "ok"


class AsyncTrainer(Trainer):
    """The async worker before adopting ray_graceful (for the thread-model comparison)."""

    async def ping(self) -> str:
        return "pong"


class SpareWorker:
    """A spare or standby: waits for the coordinator's word inside an actor method."""

    def pid(self) -> int:
        return os.getpid()

    def wait(self, role: str, config: GracefulConfig) -> dict:
        import dataclasses

        return dataclasses.asdict(ray_graceful.wait_as_spare(role, config=config, timeout=60))


class DcpTrainer(GracefulWorkerMixin, Trainer):
    """An FSDP2 worker (``fully_shard`` on a CPU mesh) that saves with ``dcp_saver``.

    The torchtitan / verl-on-FSDP2 shape: its state dict is DTensors, each rank holds its
    own rows, and the emergency checkpoint is DCP's format, loaded with ``dcp.load``.
    """

    def setup_fsdp(self, rank: int, world: int, addr: str, port: int, config) -> str:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        self.init(rank, world, addr, port)
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 5))
        fully_shard(self.model, mesh=init_device_mesh("cpu", (world,)))
        self.saver = ray_graceful.dcp_saver(
            lambda: {"model": self.model.state_dict(), "step": self.step}
        )
        return str(self.graceful_setup("policy", shard=rank, config=config, saver=self.saver))

    def full_weights(self) -> dict:
        """Every parameter whole, as numpy (a collective: every rank calls it)."""
        return {
            k: v.full_tensor().detach().numpy().copy() for k, v in self.model.state_dict().items()
        }

    def local_weights(self) -> dict:
        """This rank's own rows of every parameter, as numpy."""
        return {k: v.to_local().detach().numpy().copy() for k, v in self.model.state_dict().items()}

    def restore_own(self, rank: int, config) -> dict:
        """A restarted rank at the same world size: its own chunks, from whichever tier."""
        loaded = ray_graceful.load_latest("policy", rank, config)
        if loaded is None:
            return {"step": None, "tier": None}
        state = self.saver.restore(loaded.state)
        self.step = state["step"]
        return {"step": loaded.step, "tier": loaded.tier, "saved_step": state["step"]}
