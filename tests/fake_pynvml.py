"""A stand-in for the ``pynvml`` module, scripted per test.

It carries the real module's constants and error classes (errors are raised as
``pynvml.NVMLError(code)``, which pynvml maps to its own subclasses) and real ctypes structures
for handles, events and field values, so the probe's code runs exactly as against a driver.
"""

from __future__ import annotations

import ctypes
import threading
import types
from dataclasses import dataclass, field

import pynvml as real


@dataclass
class Gpu:
    recovery_action: int = real.NVML_GPU_RECOVERY_ACTION_NONE
    recovery_field_supported: bool = True
    ecc_uncorrected: int = 0
    remap: tuple[int, int, int, int] = (0, 0, 0, 0)  # corrected, uncorrected, pending, failure
    retired_pending: bool = False
    nvlinks: list[int] = field(default_factory=lambda: [1, 1, 0])  # link state by index
    lost: bool = False
    errors: dict[str, int] = field(default_factory=dict)  # function name -> NVML error code
    hang: threading.Event | None = None  # set to block that GPU's queries


class FakeNvml(types.ModuleType):
    def __init__(self, gpus: int = 1, init_error: int | None = None) -> None:
        super().__init__("pynvml")
        for name in dir(real):
            if name.startswith(("NVML_", "NVMLError", "nvmlEventType")):
                setattr(self, name, getattr(real, name))
        self.gpu = [Gpu() for _ in range(gpus)]
        self.init_error = init_error
        self.events: list[tuple[int, int, int]] = []  # (gpu, event type, data)
        self.registered: dict[int, int] = {}
        self._handles = [
            ctypes.cast(ctypes.c_void_p(0x1000 + i), real.c_nvmlDevice_t) for i in range(gpus)
        ]

    # --- helpers for tests ---
    def inject_xid(self, gpu: int, xid: int) -> None:
        self.events.append((gpu, real.nvmlEventTypeXidCriticalError, xid))

    def _index(self, handle) -> int:
        address = ctypes.cast(handle, ctypes.c_void_p).value
        return address - 0x1000

    def _query(self, name: str, handle):
        g = self.gpu[self._index(handle)]
        if g.hang is not None:
            g.hang.wait()
        if g.lost:
            raise real.NVMLError(real.NVML_ERROR_GPU_IS_LOST)
        if name in g.errors:
            raise real.NVMLError(g.errors[name])
        return g

    # --- the pynvml API the probe uses ---
    def nvmlInit(self):
        if self.init_error is not None:
            raise real.NVMLError(self.init_error)

    def nvmlShutdown(self):
        pass

    def nvmlDeviceGetHandleByIndex(self, index):
        if index >= len(self._handles):
            raise real.NVMLError(real.NVML_ERROR_INVALID_ARGUMENT)
        return self._handles[index]

    def nvmlEventSetCreate(self):
        return object()

    def nvmlEventSetFree(self, event_set):
        pass

    def nvmlDeviceRegisterEvents(self, handle, mask, event_set):
        self.registered[self._index(handle)] = mask

    def nvmlEventSetWait_v2(self, event_set, timeout_ms):
        while self.events:
            gpu, kind, data = self.events.pop(0)
            if self.registered.get(gpu, 0) & kind:
                event = real.c_nvmlEventData_t()
                event.device = self._handles[gpu]
                event.eventType = kind
                event.eventData = data
                return event
        raise real.NVMLError(real.NVML_ERROR_TIMEOUT)

    def nvmlDeviceGetFieldValues(self, handle, field_ids):
        g = self._query("nvmlDeviceGetFieldValues", handle)
        values = (real.c_nvmlFieldValue_t * len(field_ids))()
        for i, field_id in enumerate(field_ids):
            values[i].fieldId = field_id
            if field_id == real.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION and g.recovery_field_supported:
                values[i].nvmlReturn = real.NVML_SUCCESS
                values[i].value.uiVal = g.recovery_action
            else:
                values[i].nvmlReturn = real.NVML_ERROR_NOT_SUPPORTED
        return values

    def nvmlDeviceGetTotalEccErrors(self, handle, error_type, counter_type):
        assert (error_type, counter_type) == (
            real.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
            real.NVML_VOLATILE_ECC,
        )
        return self._query("nvmlDeviceGetTotalEccErrors", handle).ecc_uncorrected

    def nvmlDeviceGetRemappedRows(self, handle):
        return self._query("nvmlDeviceGetRemappedRows", handle).remap

    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle):
        g = self._query("nvmlDeviceGetRetiredPagesPendingStatus", handle)
        return real.NVML_FEATURE_ENABLED if g.retired_pending else real.NVML_FEATURE_DISABLED

    def nvmlDeviceGetNvLinkState(self, handle, link):
        g = self._query("nvmlDeviceGetNvLinkState", handle)
        if link >= len(g.nvlinks):
            raise real.NVMLError(real.NVML_ERROR_NOT_SUPPORTED)
        return g.nvlinks[link]
