"""GPU health: verdicts with machine-readable reasons, and the probes that produce them.

Verdicts, from best to worst: HEALTHY, UNKNOWN (nothing could be checked - CPU machines, no
NVML), DEGRADED (usable; may save, as a last choice), FAULTY (never saves; leaves first). A
probe's overall verdict is the worst of its checks.

``make_probe(config, ...)`` picks the probe the config names; the scripted probe (faults read
from a file, for tests and the demo) is only ever used when asked for by name.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

HEALTHY, UNKNOWN, DEGRADED, FAULTY = "HEALTHY", "UNKNOWN", "DEGRADED", "FAULTY"
VERDICTS = (HEALTHY, UNKNOWN, DEGRADED, FAULTY)
_SEVERITY = {v: i for i, v in enumerate(VERDICTS)}


def worst(*verdicts: str) -> str:
    """The most severe of ``verdicts`` (HEALTHY when given none)."""
    return max(verdicts, key=_SEVERITY.__getitem__, default=HEALTHY)


@dataclass(frozen=True)
class Reason:
    """One finding: a stable ``code`` for machines, a ``detail`` for people."""

    verdict: str
    code: str
    detail: str
    gpu: int | None = None


@dataclass(frozen=True)
class HealthReport:
    """A probe's verdict for the GPUs of one rank, and why."""

    verdict: str
    reasons: tuple[Reason, ...] = ()
    probe: str = ""
    checked_at: float = field(default_factory=time.time)
    # What was checked, "name: result" (e.g. "ecc: ok", "nvlink: not supported"), so a HEALTHY
    # verdict says what it rests on; and how long the probe took.
    checks: tuple[str, ...] = ()
    seconds: float = 0.0

    @classmethod
    def of(
        cls,
        probe: str,
        reasons: list[Reason],
        default: str = HEALTHY,
        checks: tuple[str, ...] = (),
        seconds: float = 0.0,
    ) -> HealthReport:
        verdict = worst(*(r.verdict for r in reasons)) if reasons else default
        return cls(verdict, tuple(reasons), probe, time.time(), checks, seconds)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "reasons": [asdict(r) for r in self.reasons]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HealthReport:
        verdict = data.get("verdict")
        if verdict not in VERDICTS:
            raise ValueError(f"health verdict {verdict!r} is not one of {', '.join(VERDICTS)}")
        reasons = tuple(Reason(**r) for r in data.get("reasons", ()))
        return cls(
            verdict,
            reasons,
            str(data.get("probe", "")),
            float(data.get("checked_at", 0)),
            tuple(str(c) for c in data.get("checks", ())),
            float(data.get("seconds", 0.0)),
        )

    def summary(self) -> str:
        if not self.reasons:
            return self.verdict
        return f"{self.verdict}: " + "; ".join(r.code for r in self.reasons)


class HealthProbe(Protocol):
    """Anything that can give a verdict for this rank's GPUs."""

    name: str

    def check(self) -> HealthReport: ...

    def close(self) -> None: ...


class NullProbe:
    """Gives UNKNOWN with a reason: used when there is nothing to check or checking is off."""

    def __init__(self, why: str, code: str = "not_checked") -> None:
        self.name = "none"
        self._reason = Reason(UNKNOWN, code, why)

    def check(self) -> HealthReport:
        return HealthReport(UNKNOWN, (self._reason,), self.name)

    def close(self) -> None:
        pass


def make_probe(config: Any, gpu_indices: list[int], node_id: str = "") -> HealthProbe:
    """The probe ``config.health_probe`` asks for, for the GPUs ``gpu_indices`` of this host."""
    from .nologin import NologinCheck

    nologin = NologinCheck(config.nologin_path)
    if config.health_probe == "none":
        return NullProbe("health_probe='none'")
    if config.health_probe == "scripted":
        from .scripted import ScriptedProbe

        return ScriptedProbe(config.health_script_path, node_id, gpu_indices, nologin)
    from .nvml import NvmlProbe

    return NvmlProbe(
        gpu_indices,
        fatal_xids=config.fatal_xids,
        degraded_xids=config.degraded_xids,
        ignored_xids=config.ignored_xids,
        nologin=nologin,
        required=config.health_probe == "nvml",
    )


__all__ = [
    "DEGRADED",
    "FAULTY",
    "HEALTHY",
    "UNKNOWN",
    "VERDICTS",
    "HealthProbe",
    "HealthReport",
    "NullProbe",
    "Reason",
    "make_probe",
    "worst",
]
