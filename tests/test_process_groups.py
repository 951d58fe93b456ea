"""Releasing peers without a collective: NCCL abort selection and gloo connection shutdown."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import socket
import struct
import threading
import time

import pytest

from ray_graceful.torch_adapter import choose_abort
from ray_graceful.worker.gloo import listeners_in, sockaddrs_at
from tests.helpers import free_port


class _Backend:
    def __init__(self, calls):
        self.calls = calls

    def abort(self):
        self.calls.append("backend.abort")


class _OldBackend:
    """A ProcessGroupNCCL from a torch without per-backend abort."""


class _Group:
    def __init__(self, calls):
        self.calls = calls

    def abort(self):
        self.calls.append("group.abort")


class _C10d:
    def __init__(self, calls, has_abort_pg=True):
        if has_abort_pg:
            self._abort_process_group = lambda group: calls.append(("abort_pg", group))


def test_nccl_abort_prefers_the_backends_own_abort():
    calls = []
    how, abort = choose_abort(_Group(calls), _Backend(calls), _C10d(calls))
    abort()
    assert how == "_Backend.abort()" and calls == ["backend.abort"]


def test_nccl_abort_falls_back_to_c10d_then_group_then_none():
    calls = []
    group = _Group(calls)
    how, abort = choose_abort(group, _OldBackend(), _C10d(calls))
    abort()
    assert how.startswith("distributed_c10d._abort_process_group") and calls == [
        ("abort_pg", group)
    ]

    calls.clear()
    how, abort = choose_abort(group, _OldBackend(), _C10d(calls, has_abort_pg=False))
    abort()
    assert how == "ProcessGroup.abort()" and calls == ["group.abort"]

    assert choose_abort(object(), _OldBackend(), _C10d(calls, has_abort_pg=False)) is None


def test_sockaddrs_at_finds_ipv4_and_ipv6():
    v4 = struct.pack("<H", socket.AF_INET) + struct.pack(">H", 4242) + socket.inet_aton("10.1.2.3")
    v4 += b"\0" * 8
    v6 = struct.pack("<H", socket.AF_INET6) + struct.pack(">H", 5151) + b"\0" * 4
    v6 += socket.inet_pton(socket.AF_INET6, "fe80::1") + b"\0" * 4
    blob = b"\x07header" + v4 + b"\x00\x01" + v6 + b"tail"
    assert set(sockaddrs_at(blob).values()) >= {("10.1.2.3", 4242), ("fe80::1", 5151)}
    assert sockaddrs_at(blob)[7] == ("10.1.2.3", 4242), "found where it starts"
    assert sockaddrs_at(b"") == {}


# What two gloo ranks published (torch 2.x, captured on this machine): each listener's
# sockaddr_in at byte 18, then the rest of a sockaddr_storage that gloo leaves uninitialised.
_BLOB0 = bytes.fromhex(
    "0200000000000000766d88000000000000000200aeed7f00000100000000000000001833e23229560000"
    "8c95aa514b7f00001092ce53ff7f00005092ce53ff7f000028f5c12d295600005092ce53ff7f000028f5"
    "c12d29560000e092ce53ff7f00005092ce53ff7f000000cacc40542aad7d000000000000000080ffffff"
    "ffffffff730000000000000062db975a4b7f0000ffffffffffffffff00000000000000000100000000000000"
)
_BLOB1 = bytes.fromhex(
    "0200000000000000766d880000000000000002009bb17f0000010000000000000000e8c26b7698550000"
    "8c954a86b27f0000b0328ba8fc7f0000f0328ba8fc7f000028854b7198550000f0328ba8fc7f00002885"
    "4b719855000000c903b17653e406000000000000000000c903b17653e406000000000000000080ffffff"
    "ffffffff730000000000000062db378fb27f0000ffffffffffffffff00000000000000000100000000000000"
)


def _plant(blob: bytes, offset: int, fake: bytes) -> bytes:
    return blob[:offset] + fake + blob[offset + len(fake) :]


def test_listeners_ignore_lookalikes_in_gloos_uninitialised_bytes():
    """A CI run found 3 listeners for 2 ranks: garbage after the sockaddr looked like one."""
    real = {("127.0.0.1", 0xAEED), ("127.0.0.1", 0x9BB1)}
    assert listeners_in([_BLOB0, _BLOB1], {0xAEED}) == real
    ipv6_lookalike = _plant(_BLOB0, 60, bytes.fromhex("0a001234"))
    ipv4_with_own_port = _plant(_BLOB1, 90, bytes.fromhex("0200aeed0a0000010000000000000000"))
    assert len(sockaddrs_at(ipv6_lookalike)) + len(sockaddrs_at(ipv4_with_own_port)) > 2
    assert listeners_in([ipv6_lookalike, ipv4_with_own_port], {0xAEED, 6379}) == real
    # Blobs this module does not know: no listener rather than a guess.
    assert listeners_in([_BLOB0, _BLOB1], {6379}) == frozenset()
    assert listeners_in([b"not gloo"], {0xAEED}) == frozenset()


def _rank(rank, port, queue):
    import torch
    import torch.distributed as dist

    from ray_graceful.worker.process_groups import release, resolve_group

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=30))
    handle = resolve_group("g")
    found = handle.gloo_addresses
    queue.put(
        ("addresses", rank, len(found.listeners), len(found.others), found.others & found.inodes)
    )
    if rank == 0:
        threading.Timer(0.5, lambda: queue.put(("released", release(handle)))).start()
        start = time.monotonic()
        try:
            dist.all_reduce(torch.ones(4))  # rank 1 never joins
            queue.put(("rank0", "returned", time.monotonic() - start))
        except RuntimeError as exc:
            queue.put(("rank0", str(exc)[-200:], time.monotonic() - start))
    else:
        time.sleep(1.5)
        start = time.monotonic()
        try:
            dist.all_reduce(torch.ones(4))
            queue.put(("rank1", "returned", time.monotonic() - start))
        except RuntimeError as exc:
            queue.put(("rank1", str(exc)[-200:], time.monotonic() - start))
    time.sleep(0.5)


@pytest.mark.timeout(60)
def test_gloo_release_frees_own_thread_and_peer():
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    events = {}
    deadline = time.monotonic() + 40
    while len(events) < 5 and time.monotonic() < deadline:
        item = queue.get(timeout=40)
        events[item[0] if item[0] != "addresses" else f"addresses{item[1]}"] = item
    for p in procs:
        p.join(10)
    assert events["addresses0"][2] == 2 and events["addresses1"][2] == 2
    # The store's connection is not the group's: set aside at setup, not looked at again.
    assert events["addresses0"][3] >= 1 and events["addresses1"][3] >= 1
    assert not events["addresses0"][4] and not events["addresses1"][4]
    assert any("shut down" in line and "gloo" in line for line in events["released"][1])
    _, outcome0, waited0 = events["rank0"]
    assert "closed by peer" in outcome0 and waited0 < 2.0, events["rank0"]
    _, outcome1, waited1 = events["rank1"]
    assert outcome1 != "returned" and waited1 < 2.0, events["rank1"]


def test_abort_choice_against_torchs_real_classes():
    """Feature detection against the installed torch: what a rank would call there."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    calls = []
    choice = choose_abort(dist.group.WORLD, _OldBackend(), c10d)
    if hasattr(c10d, "_abort_process_group"):
        assert choice is not None and choice[0].startswith("distributed_c10d._abort_process_group")
    elif hasattr(dist.ProcessGroup, "abort"):
        assert choice is not None and choice[0] == "ProcessGroup.abort()"
    assert choose_abort(None, _Backend(calls), c10d)[0] == "_Backend.abort()"


@pytest.mark.parametrize("name", ["nccl", "nccl2", "xccl"])
def test_every_backend_that_can_abort_is_aborted_whatever_its_name(monkeypatch, name):
    """torch's new nccl2 (pytorch #192281) and other backends are found by capability."""
    from ray_graceful import torch_adapter
    from ray_graceful.worker import process_groups

    calls = []

    class Backend(_Backend):
        def name(self):
            return name

    monkeypatch.setattr(
        torch_adapter, "process_group_backends", lambda group: {"cuda": Backend(calls)}
    )
    handle = process_groups.GroupHandle("g", 0, 2, object(), (name,))
    done = process_groups.release(handle)
    assert calls == ["backend.abort"] and name in done[0], done


class _SharedBarrierBackend:
    """An NCCL-like backend whose abort returns only once every other abort is running too."""

    def __init__(self, barrier, calls):
        self.barrier, self.calls = barrier, calls

    def name(self):
        return "nccl"

    def abort(self):
        self.calls.append("abort")
        self.barrier.wait()  # BrokenBarrierError when the aborts run one after another


class _GroupWith:
    _device_types = ("cuda",)

    def __init__(self, backend):
        self.backend = backend

    def _get_backend(self, device):
        return self.backend


def test_a_ranks_groups_have_their_communicators_aborted_at_the_same_time():
    """A training group and a weight-sync group: ``ProcessGroupNCCL.abort()`` costs about 0.5 s
    each on an H200, and they were aborted one after the other. Both aborts must be in flight
    together: run in turn, the first one's barrier breaks and the release says so."""
    from ray_graceful.worker.process_groups import GroupHandle, release_all

    barrier, calls = threading.Barrier(2, timeout=5), []
    handles = [
        GroupHandle(name, 0, 2, _GroupWith(_SharedBarrierBackend(barrier, calls)), ("nccl",))
        for name in ("train", "weight-sync")
    ]
    done = release_all(handles)
    assert calls == ["abort", "abort"]
    assert sorted(done) == [
        "train: _SharedBarrierBackend.abort() (nccl, cuda)",
        "weight-sync: _SharedBarrierBackend.abort() (nccl, cuda)",
    ]


def test_an_abort_that_raises_is_reported_after_every_other_group_was_released():
    from ray_graceful.worker.process_groups import GroupHandle, release_all

    class Failing(_SharedBarrierBackend):
        def abort(self):
            raise RuntimeError("NCCL error: unhandled system error")

    calls = []
    ok = GroupHandle("ok", 0, 2, _GroupWith(_SharedBarrierBackend(threading.Barrier(1), calls)))
    bad = GroupHandle("bad", 0, 2, _GroupWith(Failing(None, calls)))
    with pytest.raises(RuntimeError) as caught:
        release_all([bad, ok])
    assert calls == ["abort"], "the failing group kept the other from being released"
    assert "bad: Failing.abort() (nccl, cuda): RuntimeError: NCCL error" in str(caught.value)
    assert "ok: _SharedBarrierBackend.abort() (nccl, cuda)" in str(caught.value)


def _async_ahead_rank(rank: int, world: int, port: int, queue) -> None:
    """The GPU hang's shape on gloo: rank 1's loop issues ``async_op=True`` all-reduces and never
    waits on them, rank 0 (a departed peer) never joins them; rank 1's teardown then runs as at
    a step boundary, with its collectives still pending on gloo's worker thread."""
    import torch
    import torch.distributed as dist

    import ray_graceful
    from ray_graceful import GracefulConfig

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=600),
    )  # fmt: skip
    x = torch.ones(1 << 16)
    dist.all_reduce(x)
    dist.barrier()
    if rank == 0:
        time.sleep(40)  # present, but in no collective: rank 1's work never completes
        os._exit(0)
    pending = [dist.all_reduce(x, async_op=True) for _ in range(8)]
    config = GracefulConfig(
        report_dir=f"/tmp/rg-gloo-async-{os.getpid()}", teardown_timeout_s=8, save_budget_s=4
    )
    ray_graceful.after_init_process_group("ahead", config=config)
    started = time.monotonic()
    teardown = ray_graceful.teardown_now("test", exit_process=False)
    finished = teardown.done.wait(30)
    seconds = time.monotonic() - started
    until = time.monotonic() + 5.0  # a released collective ends, with an error, on gloo's thread
    while not all(w.is_completed() for w in pending) and time.monotonic() < until:
        time.sleep(0.01)
    ended = [w.is_completed() for w in pending]
    queue.put((finished, seconds, ended, teardown.report.to_dict()))
    queue.close()
    queue.join_thread()  # the put is made by a feeder thread: flushed before the hard exit
    os._exit(0)


@pytest.mark.timeout(120)
def test_a_rank_with_unwaited_async_collectives_is_released_and_ends_within_its_bound():
    """A loop that never waits on its ``async_op=True`` collectives parks with them pending on
    a peer that left (the H100's hang, 3 runs in 5, on the CPU): the release shuts gloo's
    connections, every pending collective ends, and the teardown ends well inside its deadline -
    no wait for gloo's 10-minute timeout."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_async_ahead_rank, args=(r, 2, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        finished, seconds, ended, report = queue.get(timeout=100)
    finally:
        for p in procs:
            p.join(1)
            if p.is_alive():
                p.kill()
    steps = {s["name"]: s for s in report["phases"]}
    assert finished, report
    assert steps["release_peers"]["status"] == "ran", steps["release_peers"]
    assert steps["drain_device"]["status"] == "skipped", "no device: nothing queued there"
    assert steps["destroy_process_group"]["status"] in ("ran", "failed"), steps
    assert all(ended), f"pending collectives left inside gloo after the release: {ended}"
    assert seconds < 5.0, f"released and torn down in {seconds:.1f}s, deadline 8 s"


class _LeaveStore:
    def __init__(self) -> None:
        self.keys: dict[str, str] = {}

    def check(self, keys):
        return all(k in self.keys for k in keys)

    def set(self, key, value):
        self.keys[key] = value


class _GroupWithStore:
    def __init__(self, store=None, error: Exception | None = None) -> None:
        self.store, self.error = store, error

    def get_group_store(self):
        if self.error is not None:
            raise self.error
        return self.store


def test_announcing_a_leave_never_raises_into_the_teardown_that_announces():
    """A group whose store cannot even be reached (any error, not only the ones the adapter
    expects) is skipped: the teardown that announces must start all the same, and the other
    groups are told."""
    from ray_graceful.worker.peer_release import LEAVE_KEY, announce_leaving
    from ray_graceful.worker.process_groups import GroupHandle

    store = _LeaveStore()
    groups = [
        GroupHandle("broken", 0, 2, _GroupWithStore(error=TypeError("a torch of its own"))),
        GroupHandle("train", 0, 2, _GroupWithStore(store)),
    ]
    assert announce_leaving(groups, "SIGTERM") == ["train"]
    assert LEAVE_KEY in store.keys
