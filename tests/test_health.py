"""NVML readings to verdicts, against a stand-in pynvml raising the library's real errors."""

from __future__ import annotations

import json
import threading
import time

import pynvml
import pytest

from ray_graceful import GracefulConfig
from ray_graceful.health import DEGRADED, FAULTY, HEALTHY, UNKNOWN, HealthReport, make_probe
from ray_graceful.health.nologin import NologinCheck
from ray_graceful.health.nvml import NvmlProbe, NvmlUnavailable
from ray_graceful.health.scripted import ScriptedProbe, ScriptError, write_faults
from tests.fake_pynvml import FakeNvml
from tests.helpers import wait_for

CONFIG = GracefulConfig()


def probe(fake, gpus=(0,), **kw):
    return NvmlProbe(
        list(gpus), CONFIG.fatal_xids, CONFIG.degraded_xids, CONFIG.ignored_xids, nvml=fake, **kw
    )


def codes(report: HealthReport) -> list[str]:
    return [r.code for r in report.reasons]


def test_no_nvml_library_is_unknown_not_an_exception():
    """The real nvidia-ml-py on a machine without a driver: UNKNOWN, with the reason."""
    report = NvmlProbe([0]).check()
    assert report.verdict == UNKNOWN
    assert codes(report) == ["nvml_unavailable"]
    assert "NVML Shared Library Not Found" in report.reasons[0].detail  # the library's message


def test_nvml_asked_for_explicitly_but_missing_is_an_error():
    with pytest.raises(NvmlUnavailable, match="health_probe='nvml' was asked for"):
        NvmlProbe([0], required=True, nvml=FakeNvml(init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED))


def test_healthy_gpu():
    assert probe(FakeNvml(gpus=2), gpus=(0, 1)).check().verdict == HEALTHY


@pytest.mark.parametrize(
    "action,code",
    [
        (pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET, "recovery_action_gpu_reset"),
        (pynvml.NVML_GPU_RECOVERY_ACTION_NODE_REBOOT, "recovery_action_node_reboot"),
        (pynvml.NVML_GPU_RECOVERY_ACTION_DRAIN_P2P, "recovery_action_drain_p2p"),
        (pynvml.NVML_GPU_RECOVERY_ACTION_DRAIN_AND_RESET, "recovery_action_drain_and_reset"),
    ],
)
def test_recovery_action_other_than_none_is_faulty(action, code):
    fake = FakeNvml()
    fake.gpu[0].recovery_action = action
    report = probe(fake).check()
    assert report.verdict == FAULTY and codes(report) == [code]


def test_old_driver_without_recovery_field_is_skipped():
    fake = FakeNvml()
    fake.gpu[0].recovery_field_supported = False
    fake.gpu[0].recovery_action = pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET  # not readable
    assert probe(fake).check().verdict == HEALTHY


@pytest.mark.parametrize(
    "xid,verdict", [(79, FAULTY), (48, FAULTY), (94, DEGRADED), (13, HEALTHY), (999, DEGRADED)]
)
def test_xid_events_by_list(xid, verdict):
    fake = FakeNvml()
    p = probe(fake)
    fake.inject_xid(0, xid)
    assert p.check().verdict == verdict


def test_fatal_xid_stays_faulty_after_the_event_was_read():
    fake = FakeNvml(gpus=2)
    p = probe(fake, gpus=(0, 1))
    fake.inject_xid(1, 79)
    first = p.check()
    assert first.verdict == FAULTY and first.reasons[0].gpu == 1
    assert p.check().verdict == FAULTY  # the event queue is empty now; the verdict is not


def test_xid_lists_are_configurable():
    fake = FakeNvml()
    p = NvmlProbe([0], fatal_xids=(13,), ignored_xids=(79,), nvml=fake)
    fake.inject_xid(0, 79)
    fake.inject_xid(0, 13)
    assert codes(p.check()) == ["xid_13"]


@pytest.mark.parametrize(
    "setup,verdict,code",
    [
        (lambda g: setattr(g, "ecc_uncorrected", 2), FAULTY, "ecc_uncorrected"),
        (lambda g: setattr(g, "remap", (0, 1, 0, 1)), FAULTY, "row_remap_failure"),
        (lambda g: setattr(g, "remap", (3, 1, 1, 0)), DEGRADED, "row_remap_pending"),
        (lambda g: setattr(g, "retired_pending", True), DEGRADED, "retired_pages_pending"),
    ],
)
def test_memory_errors(setup, verdict, code):
    fake = FakeNvml()
    setup(fake.gpu[0])
    report = probe(fake).check()
    assert report.verdict == verdict and codes(report) == [code]


def test_nvlink_that_was_up_and_went_down():
    fake = FakeNvml()
    p = probe(fake)  # links 0 and 1 up at start, link 2 never was
    assert p.check().verdict == HEALTHY
    fake.gpu[0].nvlinks[1] = 0
    report = p.check()
    assert report.verdict == FAULTY and "[1]" in report.reasons[0].detail


def test_gpu_lost_on_any_call_is_faulty():
    fake = FakeNvml()
    p = probe(fake)
    fake.gpu[0].lost = True
    report = p.check()
    assert report.verdict == FAULTY and codes(report) == ["gpu_lost"]


def test_unexpected_nvml_error_makes_that_check_unknown():
    fake = FakeNvml()
    fake.gpu[0].errors["nvmlDeviceGetTotalEccErrors"] = pynvml.NVML_ERROR_UNKNOWN
    fake.gpu[0].errors["nvmlDeviceGetRemappedRows"] = pynvml.NVML_ERROR_NOT_SUPPORTED
    report = probe(fake).check()
    assert report.verdict == UNKNOWN and codes(report) == ["nvml_error"]


def test_hanging_nvml_is_not_trusted_and_leaks_no_threads():
    """A wedged driver makes the GPU DEGRADED (not UNKNOWN, which the planner prefers), in
    bounded time, and while the wedged check has not returned no further thread is started."""
    fake = FakeNvml()
    p = probe(fake, timeout_s=0.3)
    fake.gpu[0].hang = threading.Event()
    start = time.monotonic()
    report = p.check()
    assert time.monotonic() - start < 2.0
    assert report.verdict == DEGRADED and codes(report) == ["probe_timeout"]
    before = threading.active_count()
    for _ in range(20):
        again = p.check()
        assert again.verdict == DEGRADED and codes(again) == ["probe_timeout"]
    assert threading.active_count() == before, "each check leaked a thread"
    fake.gpu[0].hang.set()  # the wedged check returns; the next one runs again
    assert wait_for(lambda: p.check().verdict == HEALTHY, 5, "a healthy verdict once unwedged")


def test_a_wedged_nvml_init_is_bounded_and_degraded():
    fake = FakeNvml()
    hang = threading.Event()
    original = fake.nvmlInit
    fake.nvmlInit = lambda: (hang.wait(), original())  # type: ignore[method-assign]
    start = time.monotonic()
    p = probe(fake, timeout_s=0.3)
    assert time.monotonic() - start < 2.0
    report = p.check()
    hang.set()
    assert report.verdict == DEGRADED and codes(report) == ["nvml_init_timeout"]


def test_repeated_xids_are_kept_once_with_a_count():
    fake = FakeNvml()
    p = probe(fake)
    for _ in range(50):
        fake.inject_xid(0, 94)
        p.check()
    report = p.check()
    assert codes(report) == ["xid_94"] and "(x50)" in report.reasons[0].detail


def test_our_own_nccl_aborts_never_make_a_gpu_faulty_or_degraded():
    """Every NCCL abort logs XID 45 (ours included): it stays in the ignored list."""
    fake = FakeNvml()
    p = probe(fake)
    for _ in range(100):
        fake.inject_xid(0, 45)
    assert p.check().verdict == HEALTHY
    assert 45 in GracefulConfig().ignored_xids


def test_host_shutting_down_marker(tmp_path):
    marker = tmp_path / "nologin"
    p = NvmlProbe([0], nologin=NologinCheck(str(marker)), nvml=FakeNvml())
    assert p.check().verdict == HEALTHY
    marker.write_text("")
    report = p.check()
    assert report.verdict == FAULTY and codes(report) == ["host_shutting_down"]


def test_scripted_probe_matches_node_and_gpu(tmp_path):
    path = str(tmp_path / "faults.json")
    p = ScriptedProbe(path, "node-a", [0, 1])
    assert p.check().verdict == HEALTHY  # no file: no faults
    write_faults(
        path,
        [
            {"node": "node-b", "verdict": "FAULTY", "code": "xid_79"},
            {"node": "node-a", "gpu": 5, "verdict": "FAULTY", "code": "other_gpu"},
            {"node": "node-a", "gpu": 1, "verdict": "DEGRADED", "code": "xid_94"},
        ],
    )
    report = p.check()
    assert report.verdict == DEGRADED and codes(report) == ["xid_94"]
    write_faults(path, [{"node": "*", "verdict": "FAULTY", "code": "xid_79"}])
    assert p.check().verdict == FAULTY


@pytest.mark.parametrize(
    "content,message",
    [
        ("not json", "not JSON"),
        (json.dumps({"x": 1}), 'expected {"faults": [...]}'),
        (json.dumps({"faults": [{"node": "a", "verdict": "BAD"}]}), "faults[0].verdict = 'BAD'"),
        (json.dumps({"faults": [{"verdict": "FAULTY"}]}), "faults[0].node must be"),
    ],
)
def test_malformed_fault_script_is_an_error(tmp_path, content, message):
    path = tmp_path / "faults.json"
    path.write_text(content)
    with pytest.raises(ScriptError, match=__import__("re").escape(message)):
        ScriptedProbe(str(path), "n", [0]).check()


def test_make_probe_choices(tmp_path):
    assert make_probe(GracefulConfig(health_probe="none"), [0]).check().verdict == UNKNOWN
    auto = make_probe(GracefulConfig(nologin_path=str(tmp_path / "x")), [0])
    assert auto.name == "nvml" and auto.check().verdict == UNKNOWN  # no driver here
    scripted = make_probe(
        GracefulConfig(health_probe="scripted", health_script_path=str(tmp_path / "f.json")),
        [0],
        "n",
    )
    assert scripted.name == "scripted" and scripted.check().verdict == HEALTHY


def test_report_round_trip_and_bad_verdict():
    fake = FakeNvml()
    fake.gpu[0].ecc_uncorrected = 1
    report = probe(fake).check()
    assert HealthReport.from_dict(json.loads(json.dumps(report.to_dict()))) == report
    with pytest.raises(ValueError, match="health verdict 'SICK' is not one of"):
        HealthReport.from_dict({"verdict": "SICK"})


def test_a_healthy_verdict_lists_what_it_rests_on():
    fake = FakeNvml()
    report = probe(fake).check()
    assert report.verdict == HEALTHY
    names = [c.split(":")[0] for c in report.checks]
    assert names[0] == "xid_events" and "registered" in report.checks[0]
    for check in ("recovery_action", "ecc", "row_remap", "retired_pages", "nvlink"):
        assert f"gpu0.{check}" in names, report.checks
    assert report.seconds > 0
    assert HealthReport.from_dict(report.to_dict()).checks == report.checks
