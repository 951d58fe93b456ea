"""A rank's GPU as its teardown sees it: has the work it queued run yet?

NCCL returns from a collective once it is enqueued, so a training loop that never waits on the
device (no ``.item()``, no ``synchronize``) can reach its step boundary with the device still
behind it, running - or waiting in - collectives of that step. Before a parked rank's
communicators are aborted, that queue is drained; and where it does not drain, the rank must
know, because its state is then not the step it parked at.
"""

from __future__ import annotations

from typing import Any

from ..bounded import wait_until


def device_queue_finished(torch: Any, timeout: float, interval_s: float = 0.001) -> bool:
    """Whether the work queued on this device's current stream finishes within ``timeout``.

    Polled through an event, never ``torch.cuda.synchronize()``: a synchronize waiting on a
    collective that a departed peer will never join does not return, and it would leave a thread
    inside a CUDA call while the communicators are aborted. (On an H100, 2026-11-27, ranks whose
    loop never waits on the device were released 13 s after a SIGTERM once, and ended by the
    watchdog at 24 s in 3 runs of 5, while the synchronize was still used.) A synchronous
    collective makes the current stream wait for its communicator's stream, so the event covers
    the training loop's collectives as well as its kernels. ``torch`` is passed in (the module,
    or a stand-in in tests).
    """
    finished = torch.cuda.Event()
    finished.record()
    return bool(wait_until(finished.query, timeout, every=interval_s))
