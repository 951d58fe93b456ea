"""NVML checks, through nvidia-ml-py, mapped to verdicts.

What is read, and what it means (ANCHORS.md's table; XID lists configurable):

- the driver's own verdict, ``NVML_FI_DEV_GET_GPU_RECOVERY_ACTION`` (driver >= 570): anything
  but NONE (GPU reset, node reboot, drain P2P, drain and reset, ...) is FAULTY;
- XID events from an event set registered at start-up (only later events are seen): fatal XIDs
  are FAULTY and stay so, "watch" XIDs DEGRADED, application XIDs ignored, others DEGRADED;
- uncorrectable ECC errors (volatile): FAULTY;
- row remapping: a failed remap is FAULTY, a pending one (needs a reset) DEGRADED;
- retired pages pending (pre-Ampere): DEGRADED;
- NVLink: a link that was up at start-up and is now down is FAULTY;
- ``NVML_ERROR_GPU_IS_LOST`` from any call: FAULTY;
- the host-shutdown marker (``nologin.py``).

A check this GPU does not support is skipped; another NVML error makes that check UNKNOWN.
No NVML library (CPU machines, CI) gives UNKNOWN with the reason - never an exception, unless
``health_probe='nvml'`` was asked for explicitly.

NVML that does not answer is not trusted: starting NVML and every check run bounded on a
helper thread, and a driver that does not answer within ``timeout_s`` makes the GPU DEGRADED
("nvml_init_timeout", "probe_timeout") - a hanging driver is itself a sign of a sick GPU, so
such a rank is the planner's last choice as a saver, behind HEALTHY and UNKNOWN ones. At most
one check is in flight: while a wedged one has not returned, no new thread is started.
A finding seen again (a degraded XID repeated) is kept once, with its count.

XID 45 (a channel torn down by its process: what every NCCL abort produces, ours included) is
in the default ignored list and never makes a GPU FAULTY or DEGRADED.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Iterable
from types import ModuleType
from typing import Any

from . import DEGRADED, FAULTY, UNKNOWN, HealthReport, Reason
from .nologin import NologinCheck


class NvmlUnavailable(RuntimeError):
    """health_probe='nvml' was asked for, but NVML cannot be used here."""


def _import_pynvml() -> ModuleType:
    import pynvml

    return pynvml


class NvmlProbe:
    name = "nvml"

    def __init__(
        self,
        gpu_indices: Iterable[int],
        fatal_xids: Iterable[int] = (),
        degraded_xids: Iterable[int] = (),
        ignored_xids: Iterable[int] = (),
        nologin: NologinCheck | None = None,
        required: bool = False,
        nvml: ModuleType | None = None,
        timeout_s: float = 5.0,
    ) -> None:
        self.gpus = list(gpu_indices)
        self.fatal_xids = frozenset(fatal_xids)
        self.degraded_xids = frozenset(degraded_xids)
        self.ignored_xids = frozenset(ignored_xids)
        self.nologin = nologin
        self.timeout_s = timeout_s
        # Events are seen once; what they said stays: (code, gpu) -> (reason, count).
        self._sticky: dict[tuple[str, int | None], tuple[Reason, int]] = {}
        self._lock = threading.Lock()
        self._in_flight: tuple[threading.Thread, float] | None = None
        self._started = threading.Event()
        self._handles: list[Any] = []
        self._event_set: Any = None
        self._nvlinks_up: dict[int, list[int]] = {}
        self._unavailable: Reason | None = None
        self.nvml: Any
        try:
            self.nvml = nvml if nvml is not None else _import_pynvml()
        except ImportError as exc:
            self.nvml = None
            self._unavailable = Reason(UNKNOWN, "nvml_unavailable", f"nvidia-ml-py: {exc}")
        if self.nvml is not None:
            self._start_bounded()
        if required and self._unavailable is not None:
            raise NvmlUnavailable(
                f"health_probe='nvml' was asked for, but {self._unavailable.detail}; use "
                "health_probe='auto' to accept UNKNOWN where there is no NVML."
            )

    # --- start-up --------------------------------------------------------------------------

    def _start_bounded(self) -> None:
        """Start NVML on a helper thread; a driver that does not answer is not waited for."""

        def start() -> None:
            try:
                self._start()
            finally:
                self._started.set()

        with self._lock:
            threading.Thread(target=start, name="ray_graceful-nvml-init", daemon=True).start()
            if not self._started.wait(self.timeout_s):
                self._unavailable = Reason(
                    DEGRADED,
                    "nvml_init_timeout",
                    f"nvmlInit did not return within {self.timeout_s}s (a wedged driver)",
                )

    def _start(self) -> None:
        n = self.nvml
        try:
            n.nvmlInit()
        except n.NVMLError as exc:
            self._unavailable = Reason(UNKNOWN, "nvml_unavailable", f"nvmlInit failed: {exc}")
            return
        if not self.gpus:
            self._unavailable = Reason(UNKNOWN, "no_gpus", "this rank was assigned no GPU")
            return
        for gpu in self.gpus:
            try:
                self._handles.append(n.nvmlDeviceGetHandleByIndex(gpu))
            except n.NVMLError as exc:
                self._unavailable = Reason(UNKNOWN, "nvml_no_handle", f"GPU {gpu}: {exc}", gpu)
                return
        self._register_events()
        for gpu, handle in zip(self.gpus, self._handles, strict=True):
            self._nvlinks_up[gpu] = self._active_links(handle)

    def _register_events(self) -> None:
        n = self.nvml
        try:
            self._event_set = n.nvmlEventSetCreate()
        except n.NVMLError:
            self._event_set = None
            return
        wanted = n.nvmlEventTypeXidCriticalError | n.nvmlEventTypeDoubleBitEccError
        for handle in self._handles:
            for mask in (wanted, n.nvmlEventTypeXidCriticalError):
                try:
                    n.nvmlDeviceRegisterEvents(handle, mask, self._event_set)
                    break
                except n.NVMLError_NotSupported:
                    continue
                except n.NVMLError:
                    break

    def _active_links(self, handle: Any) -> list[int]:
        n = self.nvml
        active = []
        for link in range(n.NVML_NVLINK_MAX_LINKS):
            try:
                if n.nvmlDeviceGetNvLinkState(handle, link) == n.NVML_FEATURE_ENABLED:
                    active.append(link)
            except n.NVMLError:
                break  # NotSupported past the last link, or no NVLink at all
        return active

    # --- checking --------------------------------------------------------------------------

    def check(self) -> HealthReport:
        in_flight = self._in_flight
        if in_flight is not None and in_flight[0].is_alive():
            waited = time.monotonic() - in_flight[1]
            return self._timed_out(f"an NVML check has not returned for {waited:.1f}s")
        box: dict[str, HealthReport] = {}
        thread = threading.Thread(
            target=lambda: box.setdefault("report", self._check()),
            name="ray_graceful-nvml-check",
            daemon=True,
        )
        self._in_flight = (thread, time.monotonic())
        thread.start()
        thread.join(self.timeout_s)
        if "report" not in box:
            return self._timed_out(f"NVML did not answer in {self.timeout_s}s")
        self._in_flight = None
        return box["report"]

    def _timed_out(self, detail: str) -> HealthReport:
        reasons = [Reason(DEGRADED, "probe_timeout", detail)]
        return HealthReport.of(self.name, reasons + self._nologin() + self._sticky_reasons())

    def _sticky_reasons(self) -> list[Reason]:
        out = []
        for reason, count in list(self._sticky.values()):
            if count > 1:
                reason = Reason(
                    reason.verdict, reason.code, f"{reason.detail} (x{count})", reason.gpu
                )
            out.append(reason)
        return out

    def _remember(self, reason: Reason) -> None:
        key = (reason.code, reason.gpu)
        _old, count = self._sticky.get(key, (reason, 0))
        self._sticky[key] = (reason, count + 1)

    def _nologin(self) -> list[Reason]:
        return self.nologin.check() if self.nologin is not None else []

    def _check(self) -> HealthReport:
        started = time.perf_counter()
        with self._lock:
            if self._unavailable is not None:
                return HealthReport.of(self.name, [self._unavailable, *self._nologin()])
            reasons = self._nologin()
            checks = ["xid_events: " + ("registered" if self._event_set is not None else "none")]
            self._drain_events()
            reasons += self._sticky_reasons()
            for gpu, handle in zip(self.gpus, self._handles, strict=True):
                reasons += self._check_gpu(gpu, handle, checks)
            took = time.perf_counter() - started
            return HealthReport.of(self.name, reasons, checks=tuple(checks), seconds=took)

    def _drain_events(self) -> None:
        n = self.nvml
        if self._event_set is None:
            return
        for _ in range(1000):
            try:
                data = n.nvmlEventSetWait_v2(self._event_set, 0)
            except n.NVMLError_Timeout:
                return
            except n.NVMLError_GpuIsLost:
                self._remember(Reason(FAULTY, "gpu_lost", "NVML_ERROR_GPU_IS_LOST (events)"))
                return
            except n.NVMLError:
                return
            gpu = self._gpu_of(data.device)
            if data.eventType & n.nvmlEventTypeDoubleBitEccError:
                self._remember(Reason(FAULTY, "ecc_double_bit", "double-bit ECC event", gpu))
            if data.eventType & n.nvmlEventTypeXidCriticalError:
                reason = self.classify_xid(int(data.eventData), gpu)
                if reason is not None:
                    self._remember(reason)

    def classify_xid(self, xid: int, gpu: int | None = None) -> Reason | None:
        if xid in self.ignored_xids:
            return None
        if xid in self.fatal_xids:
            return Reason(FAULTY, f"xid_{xid}", f"XID {xid} (fatal for the GPU or node)", gpu)
        if xid in self.degraded_xids:
            return Reason(DEGRADED, f"xid_{xid}", f"XID {xid} (degraded: watch)", gpu)
        return Reason(
            DEGRADED, f"xid_{xid}", f"XID {xid} (not in any list: treated as degraded)", gpu
        )

    def _gpu_of(self, device: Any) -> int | None:
        """Which of our GPUs an event came from (handles are ctypes pointers: compare addresses)."""
        target = _address(device)
        for gpu, handle in zip(self.gpus, self._handles, strict=True):
            if target is not None and _address(handle) == target:
                return gpu
        return None

    def _check_gpu(self, gpu: int, handle: Any, checks: list[str]) -> list[Reason]:
        n = self.nvml
        reasons: list[Reason] = []
        for check in (
            self._recovery_action,
            self._ecc,
            self._row_remap,
            self._retired_pages,
            self._nvlink,
        ):
            name = f"gpu{gpu}.{check.__name__[1:]}"
            try:
                found = check(gpu, handle)
            except n.NVMLError_GpuIsLost:
                checks.append(f"{name}: gpu lost")
                return [Reason(FAULTY, "gpu_lost", "NVML_ERROR_GPU_IS_LOST", gpu)]
            except (n.NVMLError_NotSupported, n.NVMLError_FunctionNotFound):
                checks.append(f"{name}: not supported")
                continue
            except n.NVMLError as exc:
                checks.append(f"{name}: error")
                reasons.append(Reason(UNKNOWN, "nvml_error", f"{check.__name__[1:]}: {exc}", gpu))
                continue
            checks.append(f"{name}: " + (",".join(r.code for r in found) or "ok"))
            reasons += found
        return reasons

    def _recovery_action(self, gpu: int, handle: Any) -> list[Reason]:
        n = self.nvml
        field_id = getattr(n, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", None)
        if field_id is None:  # nvidia-ml-py older than the field
            raise n.NVMLError(n.NVML_ERROR_NOT_SUPPORTED)
        value = n.nvmlDeviceGetFieldValues(handle, [field_id])[0]
        if value.nvmlReturn != n.NVML_SUCCESS:  # driver older than 570: no such field
            raise n.NVMLError(n.NVML_ERROR_NOT_SUPPORTED)
        action = int(value.value.uiVal)
        if action == n.NVML_GPU_RECOVERY_ACTION_NONE:
            return []
        name = _recovery_names(n).get(action, f"UNKNOWN_{action}")
        return [
            Reason(
                FAULTY,
                f"recovery_action_{name.lower()}",
                f"the driver asks for recovery action {name}",
                gpu,
            )
        ]

    def _ecc(self, gpu: int, handle: Any) -> list[Reason]:
        n = self.nvml
        count = n.nvmlDeviceGetTotalEccErrors(
            handle, n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, n.NVML_VOLATILE_ECC
        )
        if count:
            return [Reason(FAULTY, "ecc_uncorrected", f"{count} uncorrectable ECC errors", gpu)]
        return []

    def _row_remap(self, gpu: int, handle: Any) -> list[Reason]:
        _corrected, _uncorrected, pending, failure = self.nvml.nvmlDeviceGetRemappedRows(handle)
        if failure:
            return [Reason(FAULTY, "row_remap_failure", "row remapping failed", gpu)]
        if pending:
            return [Reason(DEGRADED, "row_remap_pending", "a row remap waits for a GPU reset", gpu)]
        return []

    def _retired_pages(self, gpu: int, handle: Any) -> list[Reason]:
        n = self.nvml
        if n.nvmlDeviceGetRetiredPagesPendingStatus(handle) == n.NVML_FEATURE_ENABLED:
            return [Reason(DEGRADED, "retired_pages_pending", "page retirement pending", gpu)]
        return []

    def _nvlink(self, gpu: int, handle: Any) -> list[Reason]:
        n = self.nvml
        if not self._nvlinks_up.get(gpu):  # no NVLink on this GPU (or none was up at start)
            raise n.NVMLError(n.NVML_ERROR_NOT_SUPPORTED)
        down = [
            link
            for link in self._nvlinks_up.get(gpu, [])
            if n.nvmlDeviceGetNvLinkState(handle, link) != n.NVML_FEATURE_ENABLED
        ]
        if down:
            return [Reason(FAULTY, "nvlink_down", f"NVLink links {down} went down", gpu)]
        return []

    def close(self) -> None:
        n = self.nvml
        if n is None or (self._unavailable is not None and not self._handles):
            return
        try:
            if self._event_set is not None:
                n.nvmlEventSetFree(self._event_set)
            n.nvmlShutdown()
        except Exception:
            pass


def _recovery_names(n: ModuleType) -> dict[int, str]:
    prefix = "NVML_GPU_RECOVERY_ACTION_"
    return {getattr(n, k): k[len(prefix) :] for k in dir(n) if k.startswith(prefix)}


def _address(pointer: Any) -> int | None:
    try:
        return ctypes.cast(pointer, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return None
