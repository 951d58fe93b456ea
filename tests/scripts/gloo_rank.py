"""One gloo rank in a plain process (no Ray): used by test_plain_process.py.

argv: rank world port report_dir mode
mode "block": rank 0 registers, then all-reduces; rank 1, a plain torch rank, never joins.
mode "leave-together": as "block", but rank 1 registers too (and idles): no coordinator.
mode "fork-race": register, fork a child whose first at-fork hook SIGTERMs itself.
mode "park": train (w += 1 per step, a pause after the update), save w on SIGTERM; the loop
    breaks at should_stop and then waits in the same function.
mode "gil-save": on SIGTERM, save with torch.save into a FIFO nobody reads (holds the GIL).
mode "report-fifo": the teardown report's file is a FIFO nobody reads.
"""

import datetime
import json
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

rank, world, port, report_dir, mode = (
    int(sys.argv[1]),
    int(sys.argv[2]),
    int(sys.argv[3]),
    sys.argv[4],
    sys.argv[5],
)
if mode == "fork-race":
    # Registered before ray_graceful's own at-fork hook, so it runs first in the child.
    os.register_at_fork(after_in_child=lambda: os.kill(os.getpid(), signal.SIGTERM))

import ray_graceful  # noqa: E402
from ray_graceful.worker.signals import current_listener  # noqa: E402

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
config = ray_graceful.GracefulConfig(
    report_dir=report_dir, exit_code=7, teardown_timeout_s=10, save_budget_s=5
)
w = torch.zeros(())
saver = None
if mode in ("park", "gil-save", "report-fifo"):
    config = config.replace(
        checkpoint_dir=os.path.join(report_dir, "ckpt"), teardown_timeout_s=4, save_budget_s=2
    )
    fifo = os.path.join(report_dir, "fifo")
    if mode == "gil-save":

        def saver(path, step):
            os.mkfifo(fifo)
            torch.save({"w": w}, fifo)  # opens the FIFO in C++, GIL held, no reader: blocks

    if mode == "report-fifo":
        import socket

        directory = os.path.join(report_dir, "no-job")
        os.makedirs(directory)
        os.mkfifo(
            os.path.join(directory, f"teardown-{socket.gethostname()}-{os.getpid()}.json.tmp")
        )


def _say_when_blocked() -> None:
    """Tell the test once the training thread is inside the all-reduce (what it waits on):
    printed before the call instead, a SIGTERM could land just before it."""
    from ray_graceful.worker.threads import thread_in_collective

    while not thread_in_collective():
        time.sleep(0.005)
    print(json.dumps({"blocked": "all_reduce"}), flush=True)


if mode != "block" or rank == 0:  # in "block", nothing may release rank 0 but its teardown
    status = ray_graceful.after_init_process_group(
        "plain",
        config=config,
        **({"saver": saver} if saver else {"state_dict": lambda: {"w": w.clone()}}),
    )
print(json.dumps({"ready": os.getpid()}), flush=True)

if mode in ("park", "gil-save", "report-fifo"):
    print(json.dumps({"training": True}), flush=True)
    step = 0
    while True:
        w += 1  # the optimizer step
        step += 1
        time.sleep(0.2)  # the rest of the step: the signal lands here
        if ray_graceful.should_stop(step):
            break
    time.sleep(30)  # waits in the same function after the loop (logging, a wait for the driver)

if mode in ("block", "leave-together"):
    if rank == 0:
        threading.Thread(target=_say_when_blocked, name="test-watch", daemon=True).start()
        try:
            dist.all_reduce(torch.ones(8))
        except RuntimeError as exc:
            print(json.dumps({"released": str(exc)[:80]}), flush=True)
        time.sleep(30)
    else:
        time.sleep(30)
elif mode == "fork-race":
    pid = os.fork()
    if pid == 0:
        time.sleep(30)
        os._exit(0)
    _, status_code = os.waitpid(pid, 0)
    time.sleep(1.0)  # long enough for a stray byte to have woken the listener
    listener = current_listener()
    print(
        json.dumps(
            {
                "child_signal": os.WTERMSIG(status_code) if os.WIFSIGNALED(status_code) else None,
                "parent_signals_seen": listener.signals_seen,
                "parent_stopping": ray_graceful.should_stop(),
            }
        ),
        flush=True,
    )
    os._exit(0)
