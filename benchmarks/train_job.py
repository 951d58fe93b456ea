"""A small TorchTrainer job (DDP on gloo, CPU): the Ray Train test and `recovery` run it.

It appends one line per executed step to ``progress`` (rank, step, time) and one per attempt
to ``attempt_file`` (rank, "start", step, time, pid, node id), so a test can tell where each attempt
started, when training was going again, and whether a step ran twice. Periodic checkpoints
every ``every`` steps. What it does about a preemption is ``handling``:

- ``"graceful"`` (default): an emergency checkpoint when ray_graceful says stop;
- ``"none"``: nothing (the periodic checkpoints only);
- ``"ray-documented"``: Ray Train's own pattern (``ray.train.get_preemption_info`` docstring,
  Ray 2.60): a just-in-time checkpoint when a preemption is reported, then keep training;
- ``"ray-best"``: the same checkpoint, then raise, so Train restarts from it at once instead
  of at the deadline (the best Ray Train alone did in our trials).

``stall_rank``/``stall_at``: that rank hangs before step ``stall_at`` (a stuck data loader),
so its peers block in the next all-reduce - a rank stuck in a collective.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from ray_graceful.config import GracefulConfig


def train_func(config: dict) -> None:
    import ray.train
    import torch
    from ray.train.torch import prepare_model

    from ray_graceful.train import emergency_checkpoint, resume_step, shard_dir, should_stop

    rank = ray.train.get_context().get_world_rank()
    model = prepare_model(torch.nn.Linear(8, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    start = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            emergency = resume_step(d)
            path = os.path.join(shard_dir(d) or d, "model.pt")
            if emergency is None:
                with open(os.path.join(d, "step")) as f:
                    start = int(f.read())
            else:
                start = emergency
            model.module.load_state_dict(torch.load(path))
    attempt = config["attempt_file"]
    with open(attempt, "a") as f:
        node = ray.get_runtime_context().get_node_id()
        f.write(f"{rank} start {start} {time.time()} {os.getpid()} {node}\n")

    def save(directory: str) -> None:
        torch.save(model.module.state_dict(), os.path.join(directory, "model.pt"))

    def report_checkpoint(done: int) -> None:
        checkpoint_out = None
        if rank == 0:
            import tempfile

            d = tempfile.mkdtemp()
            save(d)
            with open(os.path.join(d, "step"), "w") as f:
                f.write(str(done))
            checkpoint_out = ray.train.Checkpoint.from_directory(d)
        ray.train.report({"step": done}, checkpoint=checkpoint_out)

    handling = config.get("handling", "graceful" if config.get("graceful", True) else "none")
    saved_on_preemption = False
    x = torch.ones(4, 8)
    for step in range(start, config["total"]):
        first_attempt = checkpoint is None  # a restarted attempt does not stall again
        if (
            first_attempt
            and rank == config.get("stall_rank")
            and step + 1 == config.get("stall_at")
        ):
            time.sleep(10**6)  # hangs: the peers block in the next all-reduce
        opt.zero_grad()
        model(x).sum().backward()  # DDP all-reduces the gradients over gloo
        opt.step()
        time.sleep(config["step_s"])
        with open(config["progress"], "a") as f:
            f.write(f"{rank} {step + 1} {time.time()}\n")
        done = step + 1
        if handling == "graceful" and should_stop(done):
            emergency_checkpoint(save, done)
        ray_handles = handling in ("ray-documented", "ray-best") and not saved_on_preemption
        # get_preemption_info() is a barrier across the ranks: every rank calls it every step.
        if ray_handles and ray.train.get_preemption_info() is not None:
            report_checkpoint(done)
            saved_on_preemption = True
            if handling == "ray-best":
                raise RuntimeError(f"preempted: restart from the checkpoint of step {done}")
            continue
        if done % config["every"] == 0:
            report_checkpoint(done)


def callback_config(work: str, **settings: Any) -> GracefulConfig:
    """ray_graceful's settings in the recovery benchmarks: a fast drain poll and probe."""
    return GracefulConfig(
        report_dir=os.path.join(work, "reports"),
        drain_poll_interval_s=0.5,
        health_interval_s=0.5,
        train_shards="replicated",
        expected_save_s=1.0,
        **settings,
    )


def torch_trainer(loop: dict[str, Any], callbacks: list[Any], work: str, warm: bool = False) -> Any:
    """The recovery benchmarks' TorchTrainer: 2 CPU workers on ``bench_slot`` nodes; ``warm``:
    the warm path's job and backend (``warm_train_func``, ``GracefulTorchConfig``)."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from ray_graceful.train import GracefulTorchConfig

    return TorchTrainer(
        warm_train_func if warm else train_func,
        train_loop_config=loop,
        scaling_config=ScalingConfig(
            num_workers=2, resources_per_worker={"CPU": 0, "bench_slot": 1}
        ),
        torch_config=GracefulTorchConfig() if warm else TorchConfig(),
        run_config=RunConfig(
            storage_path=os.path.join(work, "storage"),
            name="run",
            callbacks=callbacks,
            failure_config=FailureConfig(max_failures=3),
        ),
    )


def _stop_agreed(stop_file: str | None) -> bool:
    """A soak's end: every rank stops at the same step once ``stop_file`` exists (one look per
    rank per step, agreed by an all-reduce: a rank that saw it makes them all stop)."""
    if stop_file is None:
        return False
    import torch
    import torch.distributed as dist

    seen = torch.tensor([float(os.path.exists(stop_file))])
    dist.all_reduce(seen, op=dist.ReduceOp.MAX)
    return bool(seen.item())


def _die_if_marked(marker: str | None) -> None:
    """A fault test's: the first process to find ``marker`` takes it away and dies at once
    (SIGKILL), as a host's crash would end it."""
    if marker is None:
        return
    try:
        os.unlink(marker)  # one process wins it
    except FileNotFoundError:
        return
    os.kill(os.getpid(), signal.SIGKILL)


def _slow_if_marked(marker: str | None, rank: int, seconds: float = 3.0) -> None:
    """A fault test's: the rank written in ``marker`` takes the marker away when it next saves,
    writes its rank and pid into ``marker + ".who"`` and takes ``seconds`` more - a slow save
    that holds its cycle open: the moment before the warm restart is decided."""
    if marker is None:
        return
    try:
        with open(marker) as f:
            if int(f.read().strip() or -1) != rank:
                return
    except (FileNotFoundError, ValueError):
        return
    try:
        os.rename(marker, marker + ".taken")  # one process wins it
    except FileNotFoundError:
        return
    with open(marker + ".who", "w") as f:
        f.write(f"{rank} {os.getpid()}\n")
    time.sleep(seconds)


def warm_train_func(config: dict) -> None:
    """The same job on the warm path (``GracefulTorchConfig``): ``setup`` and ``carry_on``.

    Gradients are all-reduced by hand on the default group (DDP would hold the group it was
    built with, which a warm restart replaces), with SGD and momentum, so every replica holds
    bitwise the same model and optimizer at each step. Each attempt's line carries its pid and
    when the function began (before ``setup``: a new worker's join is the span to its line's
    time); at the end each rank writes its step and a checksum of its state to ``final``.
    """
    import ray.train
    import torch
    import torch.distributed as dist

    from ray_graceful.train import carry_on, setup, should_stop, step_guard

    began = time.time()  # the training function started (a new worker: before it joined)
    rank = ray.train.get_context().get_world_rank()
    if config.get("began_file"):  # a fault test's moment: this process is about to join
        with open(config["began_file"], "a") as f:
            f.write(f"{rank} {os.getpid()} {began}\n")
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def state() -> dict:
        _slow_if_marked(config.get("slow_save"), rank)
        return {"model": model.state_dict(), "opt": opt.state_dict()}

    def load(loaded: dict) -> None:
        _die_if_marked(config.get("die_in_load"))
        model.load_state_dict(loaded["model"])
        opt.load_state_dict(loaded["opt"])

    step = setup(state_dict=state, load_state_dict=load) or 0
    with open(config["attempt_file"], "a") as f:
        node = ray.get_runtime_context().get_node_id()
        f.write(f"{rank} start {step} {time.time()} {os.getpid()} {node} {began}\n")
    while step < config["total"] and not _stop_agreed(config.get("stop_file")):
        with step_guard():  # a peer that crashed mid-step ends the step here, not the run
            x = torch.full((4, 8), float(step % 7))
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()
            opt.step()
            step += 1
            with open(config["progress"], "a") as f:
                f.write(f"{rank} {step} {time.time()} {os.getpid()}\n")
        time.sleep(config["step_s"])
        if should_stop(step):
            step = carry_on(step)
    total = sum(float(t.double().sum()) for t in model.state_dict().values())
    total += sum(float(s["momentum_buffer"].double().sum()) for s in opt.state.values())
    with open(config["final"], "a") as f:
        f.write(f"{rank} {step} {total!r} {os.getpid()}\n")
