"""Release a gloo process group from another thread, by closing its connections.

Gloo has no abort: ``ProcessGroup.abort()``, ``_abort_process_group()`` and
``destroy_process_group()`` all return at once and leave a collective blocked until its timeout
(measured, torch 2.13). What does end a gloo collective is its TCP connection
closing: the blocked rank raises "Connection closed by peer" at once, and so does the peer at
the other end. So this module finds the group's own connections and shuts them down
(``shutdown(SHUT_RDWR)``, never ``close``: the fd stays gloo's to close).

Finding them exactly: each rank publishes its gloo listening address in the group's store when
the group is created (read through ``torch_adapter.gloo_listener_blobs``; each value holds a
``sockaddr``, at the offset where this rank finds its own listener in its own value). A socket
of this process belongs to the group if its remote end is one of those listeners, or its local
end is this rank's listener. The addresses are read once, at setup (the store may be gone at
teardown); the sockets are matched at release time. Listening sockets are never touched
(shutting gloo's listener down makes gloo call ``std::terminate``).
"""

from __future__ import annotations

import os
import socket
import stat
import struct
from dataclasses import dataclass
from typing import NamedTuple

from .. import torch_adapter

Endpoint = tuple[str, int]


@dataclass(frozen=True)
class GlooAddresses:
    """The listening endpoints of every rank of one gloo group, and this rank's connections.

    ``inodes`` are the group's connected sockets as found at setup, by inode: a socket whose
    peer has already reset it no longer has a peer address to match, but keeps its inode.
    ``others`` are the connected sockets found at setup that are not the group's (Ray's, the
    store's, the user's): their two ends are fixed, so the release need not look at them again
    (about 30 us of system calls each; a Ray worker holds dozens).
    """

    listeners: frozenset[Endpoint]
    inodes: frozenset[int] = frozenset()
    others: frozenset[int] = frozenset()

    def __bool__(self) -> bool:
        return bool(self.listeners)


def sockaddrs_at(blob: bytes) -> dict[int, Endpoint]:
    """Every IPv4/IPv6 ``sockaddr`` (Linux layout) in a gloo address blob, by byte offset.

    A scan finds look-alikes as well as the real one: gloo copies its listener's whole
    ``sockaddr_storage`` into the blob, and the 112 bytes after the address are left
    uninitialised (stack pointers, measured), so ``listeners_in`` keeps only the offset where
    this rank's own listener is found.
    """
    found: dict[int, Endpoint] = {}
    for i in range(0, max(len(blob) - 15, 0)):
        family = struct.unpack_from("<H", blob, i)[0]
        if family == socket.AF_INET and blob[i + 8 : i + 16] == b"\0" * 8:
            port = struct.unpack_from(">H", blob, i + 2)[0]
            if port:
                found[i] = (socket.inet_ntop(socket.AF_INET, blob[i + 4 : i + 8]), port)
        elif family == socket.AF_INET6 and i + 28 <= len(blob):
            port = struct.unpack_from(">H", blob, i + 2)[0]
            if port:
                found[i] = (socket.inet_ntop(socket.AF_INET6, blob[i + 8 : i + 24]), port)
    return found


def listeners_in(blobs: list[bytes], own_ports: set[int]) -> frozenset[Endpoint]:
    """Each rank's listener from the group's blobs: the endpoint at the one offset where this
    rank's own listener (a port in ``own_ports``) appears, read at that offset in every blob.

    Every rank's blob has the same layout, so the offset that holds this rank's listener holds
    every rank's. Empty when no offset does: the blobs are not what this module knows, and
    releasing must not guess (a wrong port would shut down another library's connections).
    Where look-alikes also carry one of ``own_ports``, the offset found in the most blobs
    wins, then the earliest.
    """
    parsed = [sockaddrs_at(blob) for blob in blobs]
    offsets = {off for found in parsed for off, (_, port) in found.items() if port in own_ports}
    if not offsets:
        return frozenset()
    best = min(offsets, key=lambda off: (-sum(off in found for found in parsed), off))
    return frozenset(_normal(found[best]) for found in parsed if best in found)


def read_group_addresses(process_group: object) -> GlooAddresses:
    """Read the gloo listeners of ``process_group`` from its store (call at setup)."""
    sockets = _tcp_sockets()
    own_ports = {s.local[1] for s in sockets.values() if s.listening}
    found = listeners_in(torch_adapter.gloo_listener_blobs(process_group), own_ports)
    if not found:
        return GlooAddresses(frozenset())
    ours = frozenset(s.inode for s in _matching(found, sockets))
    others = frozenset(
        s.inode
        for s in sockets.values()
        if s.remote is not None and not s.listening and s.inode not in ours
    )
    return GlooAddresses(found, ours, others)


def shutdown_connections(addresses: GlooAddresses) -> int:
    """Shut down this process's connections of the group; returns how many."""
    sockets = _tcp_sockets(skip=addresses.others)
    matched = {sock.inode for sock in _matching(addresses.listeners, sockets)} | addresses.inodes
    count = 0
    for fd, sock in sockets.items():
        if sock.inode not in matched or sock.listening:
            continue  # not the group's; and a listener never (gloo calls std::terminate)
        try:
            with socket.socket(fileno=os.dup(fd)) as dup:
                dup.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # its peer already reset it: released all the same
        count += 1
    return count


class _Socket(NamedTuple):
    inode: int
    local: Endpoint
    remote: Endpoint | None  # None: a listener, or a connection its peer has reset
    listening: bool


def _matching(listeners: frozenset[Endpoint], sockets: dict[int, _Socket]) -> list[_Socket]:
    """The connected sockets whose remote end is a gloo listener, or whose local end is ours."""
    listener_ports = {port for _, port in listeners}
    own_ports = {
        s.local[1]
        for s in sockets.values()
        if s.listening and (s.local in listeners or s.local[1] in listener_ports)
    }
    return [
        s
        for s in sockets.values()
        if not s.listening
        and ((s.remote is not None and s.remote in listeners) or s.local[1] in own_ports)
    ]


def _normal(endpoint: Endpoint) -> Endpoint:
    host, port = endpoint
    if host.startswith("::ffff:"):
        host = host[len("::ffff:") :]
    return host, port


def _tcp_sockets(skip: frozenset[int] = frozenset()) -> dict[int, _Socket]:
    """This process's TCP sockets by fd, but for those whose inode is in ``skip``."""
    out: dict[int, _Socket] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for name in names:
        fd = int(name)
        try:
            status = os.fstat(fd)  # a socket's st_ino is its inode: "socket:[<st_ino>]"
            if not stat.S_ISSOCK(status.st_mode) or status.st_ino in skip:
                continue
            inode = status.st_ino
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if sock.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            if sock.type != socket.SOCK_STREAM:
                continue
            local = _normal(sock.getsockname()[:2])
            try:
                remote: Endpoint | None = _normal(sock.getpeername()[:2])
            except OSError:
                remote = None
            listening = bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))
            out[fd] = _Socket(inode, local, remote, listening)
        except OSError:
            continue
        finally:
            sock.close()
    return out
