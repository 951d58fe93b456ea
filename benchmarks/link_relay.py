"""A host's link through user space, with delay and loss: a slow link where the kernel has no
``sch_netem`` (this machine's 6.18 build among them).

``HostCluster.slow`` starts this as a process of its own. It opens two TAP devices - ``outer``,
which joins the cluster's bridge, and ``inner``, which becomes the host's ``eth0`` inside its
namespace - and copies every Ethernet frame between them: frames to the host (outer -> inner)
after ``delay_ms``, ``loss_pct`` percent of those dropped, and frames from the host after
``from_host_ms`` (0: at once). That is what ``tc netem delay D loss L`` on the bridge side of
the host's veth does (and netem on the host's own side, for the way back): every packet to the
host late, the round trip longer by D.

The TAP devices are not persistent: they vanish with this process, so a relay that ends - asked
to, killed, or because its parent died (``PR_SET_PDEATHSIG``) - leaves nothing behind.

    python -m benchmarks.link_relay --outer rgo1 --inner rgi1 --delay-ms 200 --from-host-ms 0
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import heapq
import os
import random
import select
import signal
import struct
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TAP, IFF_NO_PI = 0x0002, 0x1000
PR_SET_PDEATHSIG = 1
MAX_FRAME = 65536


def open_tap(name: str) -> int:
    """A new TAP device ``name``, and the descriptor its frames are read from and written to."""
    fd = os.open("/dev/net/tun", os.O_RDWR)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI))
    return fd


def relay(
    outer: int,
    inner: int,
    delay_s: float,
    loss: float,
    back_s: float = 0.0,
    seed: int | None = None,
) -> None:
    """Copy frames between the two devices until killed: to the host (outer -> inner) after
    ``delay_s``, a ``loss`` fraction dropped; from it after ``back_s``. Order is kept."""
    rng = random.Random(seed)
    due: list[tuple[float, int, int, bytes]] = []  # (when, order, to, frame) held back
    order = 0
    while True:
        wait = max(due[0][0] - time.monotonic(), 0.0) if due else None
        readable, _, _ = select.select([outer, inner], [], [], wait)
        for source in readable:
            frame = os.read(source, MAX_FRAME)
            to_host = source == outer
            if to_host and loss and rng.random() < loss:
                continue
            order += 1
            late, to = (delay_s, inner) if to_host else (back_s, outer)
            heapq.heappush(due, (time.monotonic() + late, order, to, frame))
        now = time.monotonic()
        while due and due[0][0] <= now:
            _, _, to, frame = heapq.heappop(due)
            _write(to, frame)


def _write(fd: int, frame: bytes) -> None:
    try:
        os.write(fd, frame)
    except OSError:
        pass  # the device is down (a partition on top of the slow link): the frame is lost


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--outer", required=True, help="the TAP on the bridge's side")
    parser.add_argument("--inner", required=True, help="the TAP that goes into the host")
    parser.add_argument("--delay-ms", type=float, default=200.0)
    parser.add_argument("--loss-pct", type=float, default=0.0)
    parser.add_argument("--from-host-ms", type=float, default=0.0)
    args = parser.parse_args(argv)
    delays = (args.delay_ms, args.from_host_ms)
    if not all(0 <= d <= 60_000 for d in delays) or not 0 <= args.loss_pct <= 100:
        parser.error("--delay-ms and --from-host-ms are 0-60000, --loss-pct 0-100")
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # never outlive HostCluster
    outer, inner = open_tap(args.outer), open_tap(args.inner)
    print("ready", flush=True)
    relay(outer, inner, args.delay_ms / 1000, args.loss_pct / 100, args.from_host_ms / 1000)
    return 0


if __name__ == "__main__":
    sys.exit(main())
