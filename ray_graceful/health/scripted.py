"""A probe that reads injected faults from a file: for tests and the demo, never picked silently.

The file is JSON, read at every check (so a fault can be injected while a job runs)::

    {"faults": [{"node": "<ray node id | hostname | *>", "gpu": 0,
                 "verdict": "FAULTY", "code": "xid_79", "detail": "GPU fell off the bus"}]}

A fault applies to this rank when its ``node`` matches the rank's node and its ``gpu`` (if
given) is one of the rank's GPUs. No file, or no matching fault, is HEALTHY. A malformed file
is an error that names what is wrong.
"""

from __future__ import annotations

import json
import os
import socket
from typing import Any

from . import HEALTHY, VERDICTS, HealthReport, Reason
from .nologin import NologinCheck


class ScriptError(ValueError):
    """The fault script is malformed."""


def read_faults(path: str) -> list[dict[str, Any]]:
    """Parse and validate a fault script; a missing file holds no faults."""
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        return []
    except json.JSONDecodeError as exc:
        raise ScriptError(f"{path}: not JSON ({exc})") from exc
    if not isinstance(data, dict) or not isinstance(data.get("faults"), list):
        raise ScriptError(f'{path}: expected {{"faults": [...]}}')
    faults = []
    for i, fault in enumerate(data["faults"]):
        if not isinstance(fault, dict):
            raise ScriptError(f"{path}: faults[{i}] is not an object")
        if fault.get("verdict") not in VERDICTS:
            raise ScriptError(
                f"{path}: faults[{i}].verdict = {fault.get('verdict')!r}; "
                f"allowed: {', '.join(VERDICTS)}"
            )
        if not isinstance(fault.get("node"), str) or not fault["node"]:
            raise ScriptError(f"{path}: faults[{i}].node must be a node id, a hostname or '*'")
        gpu = fault.get("gpu")
        if gpu is not None and (not isinstance(gpu, int) or isinstance(gpu, bool)):
            raise ScriptError(f"{path}: faults[{i}].gpu must be an integer or absent")
        faults.append(fault)
    return faults


def write_faults(path: str, faults: list[dict[str, Any]]) -> None:
    """Replace the fault script atomically (what the demo and the tests call)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"faults": faults}, f)
    os.replace(tmp, path)


class ScriptedProbe:
    name = "scripted"

    def __init__(
        self, path: str, node_id: str, gpus: list[int], nologin: NologinCheck | None = None
    ) -> None:
        self.path = path
        self.node_names = {node_id, socket.gethostname(), "*"} - {""}
        self.gpus = set(gpus)
        self.nologin = nologin

    def check(self) -> HealthReport:
        reasons = self.nologin.check() if self.nologin is not None else []
        for fault in read_faults(self.path):
            if fault["node"] not in self.node_names:
                continue
            if fault.get("gpu") is not None and self.gpus and fault["gpu"] not in self.gpus:
                continue
            reasons.append(
                Reason(
                    fault["verdict"],
                    str(fault.get("code", "scripted")),
                    str(fault.get("detail", "injected by the fault script")),
                    fault.get("gpu"),
                )
            )
        return HealthReport.of(self.name, reasons, default=HEALTHY)

    def close(self) -> None:
        pass
