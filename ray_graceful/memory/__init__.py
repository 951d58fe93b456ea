"""The memory tier: emergency checkpoints held in the memory of nodes that survive.

- ``tree``: a state dict as Ray moves it fastest (tensors as numpy bytes);
- ``keeper``: one actor per node that holds shards, persists them, hands them back;
- ``placement``: which surviving nodes hold a shard (pure);
- ``commit``: when a memory checkpoint counts as committed (pure);
- ``handoff``: the worker's side - hand a shard over, load one back (memory, peer, disk).

The coordinator's side is ``coordinator/memory.py``. See docs/memory-tier.md.
"""
