"""The coordinator's replies to node agents, packed into one pickle.

A node agent's poll is answered with the orders of every process of its node; at thousands of
nodes the coordinator sends thousands of such replies, one after another on its event loop.
Ray serializes a returned object with cloudpickle, which calls back into Python for every
object in it - about 0.4 ms a reply of 8 orders on the project's 2-core machine, more than
Ray's own cost of a reply (0.3 ms). Packed here with pickle's C path and sent as ``bytes``
(which Ray passes through untouched), the same reply costs about 0.1 ms: 2,048 replies were
all received after 1.4-1.7 s as objects and 0.8-0.9 s packed (``docs/benchmarks.md``, "fanout").

Only what the coordinator itself built travels this way - the protocol's own dataclasses, to
the node agents of its job - so it carries no more trust than Ray's own unpickling of every
call. ``unpack`` says what it expected when the bytes are not such a reply.
"""

from __future__ import annotations

import pickle
from typing import Any

from .checks import ProtocolError


def pack(value: Any) -> bytes:
    """``value`` as one pickle (the newest protocol: out-of-band buffers are not needed)."""
    return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def unpack(blob: Any, expected: type, what: str) -> Any:
    """The value ``pack`` made of ``blob``, which must be a ``expected``; else ProtocolError."""
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"{what}: expected packed bytes, got {type(blob).__name__}")
    try:
        value = pickle.loads(blob)
    except Exception as exc:
        raise ProtocolError(f"{what}: not a packed reply ({type(exc).__name__})") from None
    if not isinstance(value, expected):
        raise ProtocolError(
            f"{what}: expected a packed {expected.__name__}, got {type(value).__name__}"
        )
    return value
