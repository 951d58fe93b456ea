"""A held shard sent from a survivor to a spare over a real two-process gloo group.

The outline goes as an object, every tensor's bytes in one aligned buffer: what arrives must be
the same state, bit for bit, whatever the dtypes, sizes and nesting - and a shard of another
step or another size is refused before it is loaded.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback

import pytest

from ray_graceful.worker.process_groups import free_port

pytestmark = pytest.mark.unit


def _state():
    import torch

    return {
        "weights": torch.arange(1001, dtype=torch.float32).reshape(7, 143),
        "half": torch.linspace(-3, 3, 33).to(torch.bfloat16),
        "odd": torch.arange(13, dtype=torch.uint8),  # 13 bytes: the next tensor is re-aligned
        "ids": [torch.tensor([2**40, -7]), (torch.zeros(0), "a string", 3.5)],
        "empty": {},
    }


def _run(rank: int, port: int, step: int, held_bytes: int, out: mp.Queue) -> None:
    try:
        import torch
        import torch.distributed as dist

        from ray_graceful.checkpoint import ShardRecord
        from ray_graceful.memory.handoff import Snapshot
        from ray_graceful.memory.tree import to_tree, tree_bytes
        from ray_graceful.place import Place
        from ray_graceful.protocol import Rendezvous
        from ray_graceful.worker import peer_transfer
        from ray_graceful.worker.late_copy import HeldShard

        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2
        )
        tree = to_tree({"step": 9, "state": _state()}, copy=True)
        nbytes = tree_bytes(tree)
        if rank == 0:
            record = ShardRecord("g/0", 9, "f", nbytes, 0, tier=Place.HELD)
            held = [HeldShard(Snapshot(9, nbytes, tree=tree), record, (), "", 5.0)]
            answer = Rendezvous("join", group="g", rank=0, shard="0", step=9, send_to=(1,))
            peer_transfer.send(held, answer)
            out.put(("sent", nbytes))
        else:
            answer = Rendezvous(
                "join", group="g", rank=1, shard="0", step=step, peer=0,
                shard_bytes=held_bytes or nbytes,
            )  # fmt: skip
            got: list = []
            try:
                peer_transfer.receive(answer, got.append)
            except RuntimeError as exc:
                out.put(("refused", str(exc)))
                return
            want = _state()
            same = all(
                torch.equal(got[0][k], want[k]) for k in ("weights", "half", "odd")
            ) and torch.equal(got[0]["ids"][0], want["ids"][0])
            rest = got[0]["ids"][1][1:], got[0]["empty"]
            out.put(("received", same, rest, got[0]["half"].dtype == torch.bfloat16))
        dist.destroy_process_group()
    except Exception:
        out.put(("error", traceback.format_exc()))


def _transfer(step: int = 9, held_bytes: int = 0) -> list:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_run, args=(r, port, step, held_bytes, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            os.kill(p.pid, 9)
    return results


def test_a_held_shard_arrives_bit_for_bit_whatever_its_dtypes_and_nesting():
    results = {r[0]: r[1:] for r in _transfer()}
    assert "error" not in results, results.get("error")
    same, rest, bf16 = results["received"]
    assert same and bf16, "every tensor equal, bfloat16 kept"
    assert rest == (("a string", 3.5), {}), "the values that are not tensors come as they were"


@pytest.mark.parametrize("wrong", ["step", "size"])
def test_a_shard_of_another_step_or_size_is_refused_before_it_is_loaded(wrong):
    results = _transfer(step=8) if wrong == "step" else _transfer(held_bytes=100)
    by_kind = {r[0]: r[1:] for r in results}
    assert "refused" in by_kind, by_kind  # the sender's send may then fail: its peer left
    (why,) = by_kind["refused"]
    assert ("of step 9, not 8" if wrong == "step" else "not") in why, why
