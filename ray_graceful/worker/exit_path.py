"""How a process leaves: Ray's intended exit where it can, a hard exit where it must.

Everything here is safe on the exit path: writes go through ``os.write`` (never ``logging``,
whose lock a wedged thread may hold), and a hard exit is ``os._exit``. Ray records its
intended exit as INTENDED_SYSTEM_EXIT with status 0; it records any hard exit as a worker crash
(SYSTEM_ERROR) whatever the status - so the teardown takes the hard way only when Ray's does not
end the process in time.
"""

from __future__ import annotations

import os

from .. import ray_adapter


def write_stderr(text: str) -> None:
    """Write to stderr with os.write: safe from any thread, whoever holds logging's lock."""
    try:
        os.write(2, text.encode(errors="replace"))
    except OSError:
        pass


def hard_exit(code: int, why: str) -> None:
    write_stderr(f"ray_graceful: hard exit ({why}), status {code}\n")
    os._exit(code)


def request_ray_intended_exit(detail: str) -> bool:
    """Take Ray's intended-exit path now; False where there is none."""
    exit_via_ray = ray_adapter.intended_exit()
    if exit_via_ray is None:
        return False
    try:
        exit_via_ray(detail)
    except Exception as exc:
        write_stderr(f"ray_graceful: Ray's intended exit failed: {exc!r}\n")
        return False
    return True
