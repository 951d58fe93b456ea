"""See SIGTERM within milliseconds, even while the thread that trains is blocked in C.

Python runs signal handlers on the main thread, between bytecodes: a handler is delayed for as
long as the main thread sits in a collective, possibly forever (measured). The C-level handler
does run at once, and writes the signal number to the *wakeup fd*; a listener thread that reads
the other end of that pipe therefore learns of the signal within a millisecond whatever the
main thread is doing. Both ``signal.signal`` and ``signal.set_wakeup_fd`` must be called on the
main thread, once per process; this module owns that.

Rules kept here:

- the previous SIGTERM handler is chained (called on the main thread, as it would have been),
  except Ray's own worker handler, whose job - ending the process - the teardown does better;
- a process with nothing registered behaves exactly as before (Ray's handler, or the default);
- a forked child (a DataLoader worker) never runs the teardown: it sees the pid guard and
  behaves as without us, and its copy of the pipe is dropped at fork;
- a second SIGTERM escalates to an immediate exit;
- installing twice is harmless.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

from .. import ray_adapter
from .exit_path import write_stderr

Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


is_ray_worker_handler = ray_adapter.is_ray_worker_sigterm_handler


class SignalListener:
    """The process's SIGTERM listener. Use ``install_listener()``, not the constructor."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.previous: Handler = signal.getsignal(signal.SIGTERM)
        self.previous_wakeup_fd = -1
        self.signals_seen = 0
        self.installed_from = ""
        # Called on the listener thread: (signum, count) -> True if the signal was taken.
        self.on_signal: Callable[[int, int], bool] | None = None
        # Called on the main thread by the Python-level handler (a backstop for the listener).
        self.on_main_thread_signal: Callable[[int], None] | None = None
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)
        self._null_fd = os.open(os.devnull, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        self._saved_write_fd = -1
        self._thread = threading.Thread(
            target=self._listen, name="ray_graceful-signal-listener", daemon=True
        )

    # --- main thread -----------------------------------------------------------------------

    def _install(self, where: str) -> None:
        self.previous_wakeup_fd = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        signal.signal(signal.SIGTERM, self._handle)
        self.installed_from = where
        self._thread.start()
        os.register_at_fork(
            before=self._before_fork,
            after_in_parent=self._after_fork_in_parent,
            after_in_child=self._after_fork_in_child,
        )

    def handler_in_place(self) -> bool:
        """Whether our Python-level SIGTERM handler is still the installed one."""
        return signal.getsignal(signal.SIGTERM) == self._handle

    def adopt_previous(self, handler: Handler) -> None:
        """Take ``handler`` as the one to chain instead of letting it replace ours.

        Ray's worker main loop installs its handler after a job's setup hook ran; the hook
        routes that call here (see ``hooks.py``) so the listener keeps the main-thread handler.
        """
        if handler != self._handle:
            self.previous = handler

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        """The Python-level handler: runs on the main thread whenever it next can."""
        if os.getpid() != self.pid:  # a forked child: behave as if we were never here
            self._run_previous(signum, frame, default_action=True)
            return
        # When a rank is registered the listener thread owns the teardown; here we chain the
        # handler that was there before (a user's or a framework's), and start the teardown in
        # case the listener missed the signal (it arrived while a fork muted the pipe).
        claimed = _claims()
        if claimed and self.on_main_thread_signal is not None:
            self.on_main_thread_signal(signum)
        self._run_previous(signum, frame, default_action=not claimed)

    def _run_previous(self, signum: int, frame: FrameType | None, default_action: bool) -> None:
        """Chain the previous handler; Ray's own and SIG_DFL only when nothing claims the signal."""
        previous = self.previous
        if callable(previous):
            if default_action or not is_ray_worker_handler(previous):
                previous(signum, frame)
            return
        if default_action and previous in (signal.SIG_DFL, None):
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    # --- listener thread -------------------------------------------------------------------

    def _listen(self) -> None:
        while True:
            try:
                data = os.read(self._read_fd, 512)
            except InterruptedError:
                continue
            except OSError:
                return
            if not data:
                return
            forward = bytes(b for b in data if b != signal.SIGTERM)
            if forward and self.previous_wakeup_fd >= 0:
                try:  # someone (an asyncio loop) had the wakeup fd before us: pass theirs on
                    os.write(self.previous_wakeup_fd, forward)
                except OSError:
                    pass
            for _ in range(len(data) - len(forward)):
                self.signals_seen += 1
                callback = self.on_signal
                if callback is not None:
                    try:
                        callback(signal.SIGTERM, self.signals_seen)
                    except Exception as exc:  # a bug in a callback must not kill the listener
                        write_stderr(f"ray_graceful: signal callback failed: {exc!r}\n")

    # --- fork: the child must never write into our pipe ----------------------------------------
    # A child starts with our wakeup fd. A SIGTERM that reaches it before its at-fork hooks ran
    # (DataLoader workers are signalled this early) would wake *our* listener. So across a
    # fork the wakeup fd number points at /dev/null: the child inherits that, and the parent
    # gets its pipe back right after (a signal to the parent in that window is still run by
    # the Python-level handler, which starts the teardown too).

    def _before_fork(self) -> None:
        if os.getpid() != self.pid:
            return
        self._saved_write_fd = os.dup(self._write_fd)
        os.dup2(self._null_fd, self._write_fd, inheritable=False)

    def _after_fork_in_parent(self) -> None:
        if self._saved_write_fd >= 0:
            os.dup2(self._saved_write_fd, self._write_fd, inheritable=False)
            os.close(self._saved_write_fd)
            self._saved_write_fd = -1

    def _after_fork_in_child(self) -> None:
        try:
            signal.set_wakeup_fd(self.previous_wakeup_fd if self.previous_wakeup_fd >= 0 else -1)
        except (ValueError, OSError):
            pass
        for fd in (self._read_fd, self._write_fd, self._null_fd, self._saved_write_fd):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass


_lock = threading.Lock()
_listener: SignalListener | None = None


def _nothing_registered() -> bool:
    return False


_claims: Callable[[], bool] = _nothing_registered


def set_claim_check(check: Callable[[], bool]) -> None:
    """Tell the handler whether this process has something registered that takes SIGTERM."""
    global _claims
    _claims = check


def current_listener() -> SignalListener | None:
    """The listener of this process, if one was installed here (not inherited through fork)."""
    listener = _listener
    return listener if listener is not None and listener.pid == os.getpid() else None


def install_listener(where: str) -> SignalListener:
    """Install the listener once per process; must run on the main thread.

    Raises ``RuntimeError`` (with the fix) off the main thread. Installing again returns the
    existing listener, re-asserting our handler if someone replaced it meanwhile.
    """
    global _listener
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError(
            "ray_graceful: the SIGTERM listener can only be installed on the main thread; "
            f"this is {threading.current_thread().name!r}. Call "
            "ray_graceful.install_signal_handling() from the actor's __init__, or run the job "
            "with the setup hook: runtime_env={'worker_process_setup_hook': "
            "'ray_graceful.hooks.setup'}."
        )
    with _lock:
        listener = current_listener()
        if listener is None:
            listener = SignalListener()
            listener._install(where)
            _listener = listener
        elif not listener.handler_in_place():
            listener.adopt_previous(signal.getsignal(signal.SIGTERM))
            signal.signal(signal.SIGTERM, listener._handle)
        return listener
