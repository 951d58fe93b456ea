"""A state dict as Ray moves it fastest: every tensor a flat uint8 numpy array, the rest as is.

Ray serializes numpy arrays out of band: one copy into the object store on ``ray.put``, none on
a ``ray.get`` on the same node. A torch tensor would go through pickle instead (a copy into a
bytes object, then another). So the memory tier ships a *tree*: the same nesting of dicts,
lists and tuples, each tensor replaced by a ``TensorLeaf`` holding its bytes as uint8 (any
dtype - bfloat16 and float8 have no numpy twin), its dtype and shape.

``from_tree`` gives the tensors back as the caller's own copies: an object in Ray's store is
mapped writable into every process on its node, and ``Optimizer.load_state_dict`` keeps the
tensors it is given - so a view handed to user code had Adam's next steps written into a
keeper's held step, which the keeper then made durable as that step. Only the plugin's own
readers (a keeper writing its shard to disk) take views, and ``tree_checksum`` proves the bytes
they read are the ones held.
"""

from __future__ import annotations

import pickle
import warnings
import zlib
from collections.abc import Callable
from copy import deepcopy
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TensorLeaf:
    """One tensor's bytes (``data``: flat uint8 numpy array), dtype name and shape."""

    data: Any
    dtype: str
    shape: tuple[int, ...]


def to_tree(obj: Any, copy: bool = False) -> Any:
    """``obj`` with every torch tensor replaced by a ``TensorLeaf`` (CPU, detached).

    ``copy``: a snapshot - every leaf its own copy, so that the state may change on (a warm
    restart's survivor holding its shard while it trains: ``worker/late_copy.py``).
    """
    import torch

    if isinstance(obj, torch.Tensor):
        tensor = obj.detach()
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()  # device to host: the one copy a GPU shard needs
        elif copy:
            tensor = tensor.clone(memory_format=torch.contiguous_format)
        tensor = tensor.contiguous()
        if tensor.numel():
            flat = tensor.reshape(-1).view(torch.uint8)
        else:
            flat = torch.empty(0, dtype=torch.uint8)
        dtype = str(tensor.dtype).removeprefix("torch.")
        return TensorLeaf(flat.numpy(), dtype, tuple(tensor.shape))
    if isinstance(obj, dict):
        return type(obj)((k, to_tree(v, copy)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(to_tree(v, copy) for v in obj)
    return deepcopy(obj) if copy else obj


def map_leaves(obj: Any, fn: Callable[[TensorLeaf], Any]) -> Any:
    """The tree with each ``TensorLeaf`` replaced by ``fn(leaf)``, in a fixed order (the
    order ``leaves`` gives); the containers rebuilt, every other value kept as is."""
    if isinstance(obj, TensorLeaf):
        return fn(obj)
    if isinstance(obj, dict):
        return type(obj)((k, map_leaves(v, fn)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(map_leaves(v, fn) for v in obj)
    return obj


def leaves(obj: Any) -> list[TensorLeaf]:
    """Every ``TensorLeaf`` of the tree, in ``map_leaves``'s order."""
    found: list[TensorLeaf] = []
    map_leaves(obj, found.append)
    return found


def from_tree(obj: Any, copy: bool = True) -> Any:
    """The state back as torch tensors.

    ``copy`` (the default): every tensor its own memory, safe to hand to user code that keeps
    it. ``copy=False``: views of the leaves' bytes (no copy), for the plugin's own read-only
    uses, or where the bytes are already the caller's alone (a buffer it just received into).
    """
    import torch

    if isinstance(obj, TensorLeaf):
        dtype = getattr(torch, obj.dtype)
        if obj.data.size == 0:
            return torch.empty(obj.shape, dtype=dtype)
        with warnings.catch_warnings():  # a zero-copy view of an object in Ray's store
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.from_numpy(obj.data)
        tensor = raw.view(dtype).reshape(obj.shape)
        return tensor.clone() if copy else tensor
    if isinstance(obj, dict):
        return type(obj)((k, from_tree(v, copy)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(from_tree(v, copy) for v in obj)
    return deepcopy(obj) if copy else obj


def tree_checksum(obj: Any) -> int:
    """CRC32 of every leaf's bytes in ``leaves`` order, then of the pickled rest (the step,
    numbers, strings): what a keeper takes when it holds a shard, and checks again once it has
    written the shard to disk - a held step that changed is refused, never committed."""
    crc = 0
    rest = map_leaves(obj, lambda leaf: (leaf.dtype, leaf.shape))
    for leaf in leaves(obj):
        crc = zlib.crc32(leaf.data, crc)
    return zlib.crc32(pickle.dumps(rest, protocol=pickle.HIGHEST_PROTOCOL), crc)


def tree_bytes(obj: Any) -> int:
    """How many bytes a tree holds: what a keeper's budget counts, every leaf included.

    Tensors and numpy arrays count their buffers, bytes-like values their length, strings their
    UTF-8 length, numbers 8 bytes; containers the sum of their values. Anything else (a replay
    buffer object, an RNG state) counts its pickled size - never 0 bytes.
    """
    if isinstance(obj, TensorLeaf):
        return int(obj.data.nbytes)
    if isinstance(obj, dict):
        return sum(tree_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tree_bytes(v) for v in obj)
    if obj is None:
        return 0
    if isinstance(obj, (int, float, complex)):
        return 8
    if isinstance(obj, str):
        return len(obj.encode("utf-8", "surrogatepass"))
    if isinstance(obj, (bytes, bytearray)):
        return len(obj)
    nbytes = getattr(obj, "nbytes", None)  # numpy arrays, memoryviews, tensors
    if isinstance(nbytes, int):
        return nbytes
    return len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
