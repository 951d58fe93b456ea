"""A deadline that no Python code can hold up: a POSIX timer that calls ``_exit`` in C.

The teardown's watchdog is a Python thread, and a Python thread needs the GIL to run. A save
blocked inside C code that holds the GIL (``torch.save`` to a hung mount: its C++ writer keeps
the GIL while blocked in I/O) freezes every Python thread of the process, the watchdog
included. So the last word belongs to the kernel: ``timer_create`` with ``SIGEV_THREAD`` makes
glibc start a fresh native thread at the deadline and run the notify function there, and the
notify function is libc's own ``_exit``, given the exit status as its argument. No Python, no
GIL, no lock: the process ends at the deadline whatever its threads are doing.

Ray records such an exit as a worker crash (SYSTEM_ERROR, "connection error ... End of
file"), like any ``os._exit``: it is the backstop, not the path a healthy teardown takes.

Linux with glibc only (``timer_create`` with ``SIGEV_THREAD`` is a glibc feature); elsewhere
``arm`` returns False and the Python watchdog stays the only one.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
import threading

_SIGEV_THREAD = 2
_CLOCK_MONOTONIC = 1  # what time.monotonic() reads on Linux
_TIMER_ABSTIME = 1


class _SigVal(ctypes.Union):
    _fields_ = (("sival_int", ctypes.c_int), ("sival_ptr", ctypes.c_void_p))


class _SigEvThread(ctypes.Structure):
    _fields_ = (("function", ctypes.c_void_p), ("attribute", ctypes.c_void_p))


class _SigEvUnion(ctypes.Union):
    _fields_ = (("pad", ctypes.c_int * 12), ("tid", ctypes.c_int), ("thread", _SigEvThread))


class _SigEvent(ctypes.Structure):  # struct sigevent, 64 bytes on LP64 Linux
    _fields_ = (
        ("value", _SigVal),
        ("signo", ctypes.c_int),
        ("notify", ctypes.c_int),
        ("un", _SigEvUnion),
    )


class _TimeSpec(ctypes.Structure):
    _fields_ = (("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long))


class _ITimerSpec(ctypes.Structure):
    _fields_ = (("it_interval", _TimeSpec), ("it_value", _TimeSpec))


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        if not hasattr(libc, "timer_create"):  # glibc < 2.34 keeps it in librt
            libc = ctypes.CDLL(ctypes.util.find_library("rt") or "librt.so.1", use_errno=True)
        return libc if hasattr(libc, "timer_create") else None
    except OSError:
        return None


class HardDeadline:
    """One process-wide kernel timer that ends the process with ``code`` at a monotonic time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._timer: ctypes.c_void_p | None = None
        self._code: int | None = None
        self._libc = _libc()

    @property
    def available(self) -> bool:
        return self._libc is not None

    def arm(self, at_monotonic: float, code: int) -> bool:
        """End the process with ``code`` at ``at_monotonic`` (``time.monotonic()`` seconds).

        Re-arming moves the deadline (and the status). Returns False where no such timer can
        be made (not Linux/glibc), leaving the Python watchdog as the only guard.
        """
        libc = self._libc
        if libc is None:
            return False
        with self._lock:
            if self._timer is None or self._code != code:
                self._delete()
                event = _SigEvent()
                event.notify = _SIGEV_THREAD
                event.value.sival_int = code
                event.un.thread.function = ctypes.cast(libc._exit, ctypes.c_void_p).value
                timer = ctypes.c_void_p()
                if libc.timer_create(_CLOCK_MONOTONIC, ctypes.byref(event), ctypes.byref(timer)):
                    return False
                self._timer, self._code = timer, code
            spec = _ITimerSpec()
            seconds = max(at_monotonic, 1e-6)
            spec.it_value.tv_sec = int(seconds)
            spec.it_value.tv_nsec = int((seconds - int(seconds)) * 1e9)
            return libc.timer_settime(self._timer, _TIMER_ABSTIME, ctypes.byref(spec), None) == 0

    def cancel(self) -> None:
        """Disarm (a teardown that does not end the process: tests, ``exit_process=False``)."""
        with self._lock:
            self._delete()

    def _delete(self) -> None:
        if self._timer is not None and self._libc is not None:
            self._libc.timer_delete(self._timer)
        self._timer, self._code = None, None


_deadline = HardDeadline()


def hard_deadline() -> HardDeadline:
    """This process's one hard deadline."""
    return _deadline
