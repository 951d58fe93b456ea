"""The host-shutdown marker: ``/run/nologin`` exists while a host is going down.

systemd creates it when shutdown begins; axlearn's PR 1324 skips the save on such a host. A
host that is shutting down will not finish a checkpoint: its ranks are FAULTY for planning.
"""

from __future__ import annotations

import os

from . import FAULTY, Reason


class NologinCheck:
    def __init__(self, path: str) -> None:
        self.path = path

    def check(self) -> list[Reason]:
        if os.path.exists(self.path):
            return [
                Reason(FAULTY, "host_shutting_down", f"{self.path} exists: the host is going down")
            ]
        return []
