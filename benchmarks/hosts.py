"""Real hosts on one machine: a Ray cluster whose nodes are Linux network namespaces.

Used by ``tests/hosts/`` (its own pytest session) and ``python -m benchmarks host-loss``.

Every other multi-node test runs its raylets on 127.0.0.1: a node can be drained or have one
process killed, but it cannot vanish, be cut off or slow down. Here each extra host is a network
namespace with its own veth, its own IP and its own raylet (``ray start --block`` inside it), so
a host can fail the ways hosts fail:

    with HostCluster() as hosts:                    # the head on the bridge, 10.77.0.1
        a = hosts.add_host(resources={"hostA": 1})  # namespace rgh1, 10.77.0.2
        hosts.crash(a)        # every process of the host SIGKILLed at once
        hosts.partition(a)    # its link down, its processes alive; hosts.heal(a) undoes it
        hosts.slow(a, delay_ms=200, loss_pct=0)    # every packet to it late (or lost)
        hosts.slow(a, delay_ms=200, from_host_ms=200)  # and every packet from it
        hosts.stall(a, seconds=2.0)                # every process SIGSTOPped, SIGCONT after

The head runs in the root namespace (``ray.cluster_utils.Cluster`` bound to the bridge's
address), so the driver - the test - reaches it as any driver would. Only addresses inside
10.77.0.0/24 and names starting ``rg`` are used, all made here; ``close()`` ends every process
it started (by PID: the head's through ``Cluster.shutdown``, a host's as the namespace's PIDs),
deletes each veth explicitly (after a partition a namespace is not freed while orphaned TCP
sockets retry, and its links linger for minutes - ``../shared/RAY_FACTS.md``), then the
namespaces and the bridge, also when the test failed.

Needs root and iproute2 (``ip``, ``tc``), as CI here has; ``unavailable()`` says why not.
``slow`` uses ``tc netem`` where the kernel has it, else a relay of the host's frames through user
space (``link_relay.py``, two TAP devices; ``/dev/net/tun``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

BRIDGE = "rgbr0"
SUBNET = "10.77.0"  # the head is .1, host i is .(i + 1)
HEAD_IP = f"{SUBNET}.1"


def unavailable() -> str | None:
    """Why a namespace cluster cannot be made here, or None when it can."""
    if sys.platform != "linux":
        return "network namespaces are Linux's"
    if os.geteuid() != 0:
        return "making network namespaces needs root (CI here runs as root)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"iproute2's `{tool}` is not installed"
    probe = subprocess.run(["ip", "netns", "add", "rgprobe"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"`ip netns add` failed: {probe.stderr.strip()[:200]}"
    subprocess.run(["ip", "netns", "del", "rgprobe"], capture_output=True)
    return None


def netem_unavailable() -> str | None:
    """Why ``tc netem`` cannot work here, or None when it can: a throwaway veth is given a netem
    qdisc (some kernels - this machine's 6.18 build among them - lack the module; ``slow`` then
    relays the host's link through user space)."""
    _ip("link", "add", "rgnetem0", "type", "veth", "peer", "name", "rgnetem1")
    try:
        tried = _run("tc", "qdisc", "add", "dev", "rgnetem0", "root", "netem", "delay", "1ms",
                     check=False)  # fmt: skip
    finally:
        _ip("link", "del", "rgnetem0", check=False)
    if tried.returncode != 0:
        return f"tc netem is not in this kernel ({os.uname().release}): {tried.stderr.strip()}"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return _run("ip", *args, check=check)


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(args, capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"`{' '.join(args)}` failed: {done.stderr.strip()[:300]}")
    return done


@dataclass
class Host:
    """One host: a namespace, its link (``veth`` on the bridge side), its address, its raylet."""

    index: int
    namespace: str
    veth: str
    ip: str
    raylet: subprocess.Popen
    log_path: str
    resources: dict[str, float] = field(default_factory=dict)
    stalled: set[int] = field(default_factory=set)
    relay: subprocess.Popen | None = None  # its slow link where there is no netem

    def pids(self) -> list[int]:
        """Every live process now in the host's namespace (not the zombies of dead ones)."""
        out = _ip("netns", "pids", self.namespace, check=False).stdout.split()
        return [int(p) for p in out if p.isdigit() and _alive(int(p))]

    def node_id(self) -> str | None:
        """Ray's id of the host's node, while Ray calls it alive."""
        import ray

        for node in ray.nodes():
            if node["NodeManagerAddress"] == self.ip and node["Alive"]:
                return node["NodeID"]
        return None


class HostCluster:
    """A Ray cluster across network namespaces; the driver is connected while it is open."""

    def __init__(self, head_cpus: int = 4, head_resources: dict[str, float] | None = None) -> None:
        self.head_cpus = head_cpus
        self.head_resources = {"head": 100.0, **(head_resources or {})}
        self.hosts: list[Host] = []
        self.cluster: Any = None
        self.temp_dir = tempfile.mkdtemp(prefix="rg-hosts-")
        self._timers: list[threading.Timer] = []
        self._made = 0  # hosts made so far: names and addresses are never reused

    # --- set-up ----------------------------------------------------------------------------

    def __enter__(self) -> HostCluster:
        try:
            self.open()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def open(self) -> None:
        import ray
        from ray.cluster_utils import Cluster

        self._remove_leftovers()
        _ip("link", "add", BRIDGE, "type", "bridge")
        _ip("addr", "add", f"{HEAD_IP}/24", "dev", BRIDGE)
        _ip("link", "set", BRIDGE, "up")
        os.environ["RAY_TMPDIR"] = self.temp_dir
        self.cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "node_ip_address": HEAD_IP,
                "num_cpus": self.head_cpus,
                "include_dashboard": False,
                "resources": self.head_resources,
            },
        )
        # Not the workers' logs: every host's log monitor would send the head's again.
        ray.init(address=self.cluster.address, logging_level="WARNING", log_to_driver=False)

    def add_host(
        self, num_cpus: int = 2, resources: dict[str, float] | None = None, timeout: float = 60
    ) -> Host:
        """A new namespace on the bridge running a raylet joined to the head; returns once Ray
        lists the node alive at the host's address."""
        self._made += 1
        index = self._made
        if index > 250:
            raise ValueError("at most 250 hosts: their addresses are 10.77.0.2-251")
        namespace, veth, ip = f"rgh{index}", f"rgv{index}", f"{SUBNET}.{index + 1}"
        _ip("netns", "add", namespace)
        _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", namespace)
        _ip("link", "set", veth, "master", BRIDGE, "up")
        _ip("-n", namespace, "addr", "add", f"{ip}/24", "dev", "eth0")
        _ip("-n", namespace, "link", "set", "eth0", "up")
        _ip("-n", namespace, "link", "set", "lo", "up")
        log_path = os.path.join(self.temp_dir, f"{namespace}.log")
        ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
        command = [
            "ip", "netns", "exec", namespace, ray_bin, "start", "--block",
            "--address", self.cluster.address, "--node-ip-address", ip,
            "--num-cpus", str(num_cpus), "--resources", json.dumps(resources or {}),
            "--disable-usage-stats",
        ]  # fmt: skip
        # A temp dir of its own: sharing the head's, its log monitor would republish the
        # head's workers' logs as its own (every line twice, with the wrong address).
        env = {**os.environ, "RAY_TMPDIR": os.path.join(self.temp_dir, namespace)}
        os.makedirs(env["RAY_TMPDIR"])
        with open(log_path, "w") as log:
            raylet = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env
            )
        host = Host(index, namespace, veth, ip, raylet, log_path, dict(resources or {}))
        self.hosts.append(host)
        deadline = time.monotonic() + timeout
        while host.node_id() is None:
            if raylet.poll() is not None or time.monotonic() > deadline:
                with open(log_path) as f:
                    tail = f.read()[-800:]
                raise RuntimeError(f"host {namespace} ({ip}) did not join the cluster: {tail}")
            time.sleep(0.2)
        return host

    def start_process(self, host: Host, command: list[str], log_path: str) -> subprocess.Popen:
        """``command`` run inside ``host``: a driver on that host (``RAY_ADDRESS`` is the head's;
        ``ray.init`` there must name ``host.ip`` as its node's address). It is one of the host's
        processes, so a ``crash`` ends it too; the caller reaps it (``wait``)."""
        env = {**os.environ, "RAY_ADDRESS": self.cluster.address}
        env["RAY_TMPDIR"] = os.path.join(self.temp_dir, host.namespace)
        with open(log_path, "w") as log:
            return subprocess.Popen(
                ["ip", "netns", "exec", host.namespace, *command],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=env,
            )

    # --- faults ----------------------------------------------------------------------------

    def crash(self, host: Host) -> list[int]:
        """Every process of the host SIGKILLed at once, as a kernel panic or power loss ends
        them (its kernel - this machine's - still answers for its address: see ``silence``)."""
        pids = host.pids()
        for pid in pids:
            _signal(pid, signal.SIGKILL)
        host.raylet.wait(10)  # ours to reap; the rest are reaped by whoever adopted them
        deadline = time.monotonic() + 10
        while host.pids() and time.monotonic() < deadline:
            time.sleep(0.05)
        return pids

    def silence(self, host: Host) -> list[int]:
        """A real crash: the link down first, then every process killed - nothing is sent."""
        self.partition(host)
        return self.crash(host)

    def fail(self, host: Host, fault: str) -> None:
        """``fault`` - "crash", "silence" or "partition" - on ``host`` (a harness's parameter)."""
        faults = {"crash": self.crash, "silence": self.silence, "partition": self.partition}
        if fault not in faults:
            raise ValueError(f"fault {fault!r} is not one of {', '.join(faults)}")
        faults[fault](host)

    def partition(self, host: Host) -> None:
        """The host's link down: its processes run on, and nothing reaches them or leaves."""
        _ip("link", "set", host.veth, "down")
        if host.relay is not None:
            _ip("link", "set", _outer(host), "down")

    def heal(self, host: Host) -> None:
        """The link up again (after ``partition``), and any ``slow`` removed."""
        if host.relay is not None:
            self._end_relay(host)
        _run("tc", "qdisc", "del", "dev", host.veth, "root", check=False)
        _ip("netns", "exec", host.namespace, "tc", "qdisc", "del", "dev", "eth0", "root",
            check=False)  # fmt: skip
        _ip("link", "set", host.veth, "up")

    def slow(
        self, host: Host, delay_ms: float = 200, loss_pct: float = 0, from_host_ms: float = 0
    ) -> None:
        """Every packet to the host delayed by ``delay_ms`` (the round trip grows by as much),
        ``loss_pct`` percent of them dropped, and every packet from it by ``from_host_ms``:
        ``tc netem`` on both ends of its link; where the kernel has no netem
        (``netem_unavailable()``), the host's link goes through ``link_relay.py``. ``heal``
        ends either."""
        delays = (delay_ms, from_host_ms)
        if not all(0 <= d <= 60_000 for d in delays) or not 0 <= loss_pct <= 100:
            raise ValueError(
                f"delays are 0-60000 ms and loss_pct 0-100, not {delays} and {loss_pct}"
            )
        if netem_unavailable() is None:
            args = ["delay", f"{delay_ms}ms"] + (["loss", f"{loss_pct}%"] if loss_pct else [])
            _run("tc", "qdisc", "replace", "dev", host.veth, "root", "netem", *args)
            if from_host_ms:
                _ip("netns", "exec", host.namespace, "tc", "qdisc", "replace", "dev", "eth0",
                    "root", "netem", "delay", f"{from_host_ms}ms")  # fmt: skip
            return
        if host.relay is not None:
            self._end_relay(host)
        self._relay(host, delay_ms, loss_pct, from_host_ms)

    def _relay(self, host: Host, delay_ms: float, loss_pct: float, from_host_ms: float) -> None:
        """Move the host onto a link through user space: its TAP ``inner`` becomes its eth0
        (same MAC, same address: its connections go on), the veth rests as ``rgveth``."""
        inner, ns = f"rgi{host.index}", host.namespace
        host.relay = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.link_relay", "--outer", _outer(host),
             "--inner", inner, "--delay-ms", str(delay_ms), "--loss-pct", str(loss_pct),
             "--from-host-ms", str(from_host_ms)],
            stdout=subprocess.PIPE, text=True, cwd=os.path.dirname(os.path.dirname(__file__)),
        )  # fmt: skip
        assert host.relay.stdout is not None
        if host.relay.stdout.readline().strip() != "ready":
            host.relay.kill()
            host.relay.wait(10)
            host.relay = None
            raise RuntimeError(f"the link relay of {ns} did not start (is /dev/net/tun there?)")
        mac = _ip("-n", ns, "-j", "link", "show", "eth0").stdout
        address = json.loads(mac)[0]["address"]
        _ip("link", "set", _outer(host), "master", BRIDGE, "up")
        _ip("link", "set", inner, "netns", ns)
        for step in (
            ["link", "set", "eth0", "down"],
            ["link", "set", "eth0", "name", "rgveth"],
            ["link", "set", inner, "name", "eth0"],
            ["link", "set", "eth0", "address", address],
            ["addr", "add", f"{host.ip}/24", "dev", "eth0"],
            ["link", "set", "eth0", "up"],
        ):
            _ip("-n", ns, *step)

    def _end_relay(self, host: Host) -> None:
        """End the relay (its TAPs vanish with it) and give the host its veth back as eth0."""
        relay, host.relay = host.relay, None
        if relay is not None:
            relay.kill()
            relay.wait(10)
        if _ip("-n", host.namespace, "link", "show", "rgveth", check=False).returncode != 0:
            return  # the relay never took the host's link
        deadline = time.monotonic() + 5.0  # the TAP's name is freed once the kernel drops it
        while _ip(
            "-n", host.namespace, "link", "set", "rgveth", "name", "eth0", check=False
        ).returncode:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{host.namespace}: its eth0 did not go with the relay")
            time.sleep(0.05)
        _ip("-n", host.namespace, "link", "set", "eth0", "up")

    def stall(self, host: Host, seconds: float) -> None:
        """Every process of the host SIGSTOPped, and SIGCONTed ``seconds`` later: a host that
        stops answering (a long GC pause, a hung kernel) and comes back."""
        host.stalled = set(host.pids())
        for pid in host.stalled:
            _signal(pid, signal.SIGSTOP)
        timer = threading.Timer(seconds, self.resume, args=(host,))
        timer.daemon = True
        self._timers.append(timer)
        timer.start()

    def resume(self, host: Host) -> None:
        for pid in host.stalled:
            _signal(pid, signal.SIGCONT)
        host.stalled = set()

    # --- clean-up --------------------------------------------------------------------------

    def remove_host(self, host: Host) -> None:
        """End the host's processes and delete its link and namespace (a crashed host's
        namespace holds nothing, but its address and link remain until this)."""
        self.resume(host)
        if host.relay is not None:
            self._end_relay(host)
        for pid in host.pids():
            _signal(pid, signal.SIGKILL)
        if host.raylet.poll() is None:
            host.raylet.kill()
        host.raylet.wait(10)
        _ip("link", "del", host.veth, check=False)  # first: a partitioned one lingers
        _ip("netns", "del", host.namespace, check=False)
        self.hosts.remove(host)

    def close(self) -> None:
        """End everything this cluster started; safe to call twice and after a failed set-up."""
        import ray

        for timer in self._timers:
            timer.cancel()
        for host in list(self.hosts):
            self.remove_host(host)
        if ray.is_initialized():
            ray.shutdown()
        if self.cluster is not None:
            self.cluster.shutdown()
            self.cluster = None
        _ip("link", "del", BRIDGE, check=False)
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def _remove_leftovers(self) -> None:
        """Namespaces and links of this helper's names left by a run that was killed (SIGKILL
        skips ``close``): their processes are ended by PID, then the links, then the names."""
        listed = _ip("netns", "list", check=False).stdout.split("\n")
        for namespace in [line.split()[0] for line in listed if line.startswith("rgh")]:
            for pid in _ip("netns", "pids", namespace, check=False).stdout.split():
                _signal(int(pid), signal.SIGKILL)
            _ip("link", "del", f"rgv{namespace[3:]}", check=False)
            _ip("netns", "del", namespace, check=False)
        _ip("link", "del", BRIDGE, check=False)


def _outer(host: Host) -> str:
    """The bridge's side of a host's relayed link."""
    return f"rgo{host.index}"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass
