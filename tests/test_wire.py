"""The coordinator's packed replies to node agents (``protocol/wire.py``)."""

from __future__ import annotations

import pytest

from ray_graceful.protocol import PollAnswer, PollKind, ProtocolError, TeardownOrder, wire

pytestmark = pytest.mark.unit


def test_a_node_reply_unpacks_equal_and_typed():
    order = TeardownOrder("job", 3, "abc-0", 12.5, "cli: test (node n0)", rejoin=True)
    reply = {"p0": PollAnswer(PollKind.ORDER, order), "p1": PollAnswer(PollKind.IDLE)}
    back = wire.unpack(wire.pack(reply), dict, "poll_node")
    assert back == reply
    assert back["p0"].kind is PollKind.ORDER and back["p0"].order.rejoin is True


@pytest.mark.parametrize(
    ("blob", "said"),
    [
        ({"p0": "not packed"}, "expected packed bytes, got dict"),
        (b"\x80\x05garbage", "not a packed reply (UnpicklingError)"),
        (b"", "not a packed reply (EOFError)"),
        (wire.pack(["a list"]), "expected a packed dict, got list"),
    ],
)
def test_what_is_not_a_packed_reply_is_said_not_raised_raw(blob, said):
    with pytest.raises(ProtocolError) as caught:
        wire.unpack(blob, dict, "poll_node")
    assert str(caught.value) == f"poll_node: {said}"
