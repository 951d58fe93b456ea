"""Notices straight from the cloud: the instance metadata service says a VM is going, early.

A spot VM on AWS gets a two-minute interruption notice (and sometimes an earlier rebalance
recommendation); GCE publishes a maintenance event about 60 s ahead and a preemption flag;
Azure publishes Scheduled Events (Preempt, Terminate, Reboot, ...) with a not-before time.
Ray sees none of them - only the SIGTERM at the very end. This module reads them:

- ``detect`` finds which cloud answers (IMDSv2 token on AWS, ``Metadata-Flavor: Google`` on
  GCE, ``Metadata: true`` with an API version on Azure); off a cloud nothing answers within a
  short timeout and the poller stays silent;
- ``CloudPoller.poll_once`` reads the relevant endpoints and turns an event into a
  ``CloudEvent`` with the cloud's own deadline (``to_notice`` makes the ``EvictionNotice``);
- every response is untrusted: bodies are read bounded, parsed strictly, and anything
  malformed, slow, failing or hostile becomes a log line and no notice - never a crash and
  never an invented deadline.

The base URLs are settings (``cloud_metadata_url``) so that tests run real HTTP against a
stand-in server on 127.0.0.1. One poller runs per node (``node_poller.py``), not per rank.
"""

from __future__ import annotations

import email.utils
import http.client
import json
import logging
import re
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from datetime import datetime, timezone

from .notices import EvictionNotice, Source, short

logger = logging.getLogger(__name__)

CLOUDS = ("aws", "gce", "azure")
DEFAULT_URLS = {
    "aws": "http://169.254.169.254",
    "gce": "http://metadata.google.internal",
    "azure": "http://169.254.169.254",
}
MAX_BODY = 64 * 1024  # metadata answers are tiny; more is hostile
AWS_TOKEN_TTL_S = 21600
AZURE_API = "2020-07-01"
# What each cloud gives when it announces no explicit time (its documented lead times).
GCE_MAINTENANCE_LEAD_S = 60.0
GCE_PREEMPTION_LEAD_S = 30.0


_TOKEN = re.compile(r"[\x21-\x7e]{1,1024}")  # what may go into a header: no CR/LF, no spaces


class CloudResponseError(ValueError):
    """A metadata response is not what the cloud documents; the message says what."""


@dataclass(frozen=True)
class CloudEvent:
    """One announced end of this VM, in the cloud's own words and with its deadline."""

    cloud: str
    kind: str  # "spot-interruption", "rebalance", "maintenance", "preempted", "scheduled-event"
    detail: str
    deadline: float  # Unix seconds; the cloud's own time
    key: str  # stable per event: the same event is reported once

    def to_notice(self, node_id: str, cycle: int) -> EvictionNotice:
        return EvictionNotice(
            Source.CLOUD,
            f"{self.cloud} {self.kind}: {self.detail}"[:500],
            cycle,
            self.deadline,
            node_id=node_id,
        )


# --- parsing: pure functions of what the cloud answered ----------------------------------------


def _iso_time(text: object, what: str) -> float:
    """``text`` as a time: anything else (a missing field's None) is the service's error."""
    try:
        if not isinstance(text, str):
            raise TypeError(type(text).__name__)
        parsed = datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)
    except (TypeError, ValueError):
        raise CloudResponseError(
            f"{what}: {short(text)} is not a UTC time like 2026-01-02T03:04:05Z"
        ) from None
    return parsed.timestamp()


def parse_aws_instance_action(body: bytes) -> CloudEvent:
    """``/latest/meta-data/spot/instance-action``: ``{"action": ..., "time": ...}``."""
    data = _json(body, "spot/instance-action")
    if not isinstance(data, dict):
        raise CloudResponseError(f"spot/instance-action is {short(data)}, not an object")
    action = data.get("action")
    if action not in ("terminate", "stop", "hibernate"):
        raise CloudResponseError(
            f"spot/instance-action.action = {short(action)}: one of terminate, stop, hibernate"
        )
    deadline = _iso_time(data.get("time"), "spot/instance-action.time")
    return CloudEvent(
        "aws", "spot-interruption", f"spot instance {action}", deadline, f"aws-{action}-{deadline}"
    )


def parse_aws_rebalance(body: bytes, now: float) -> CloudEvent:
    """``/latest/meta-data/events/recommendations/rebalance``: ``{"noticeTime": ...}``.

    A recommendation, not a deadline: AWS may still interrupt up to two minutes after its own
    interruption notice, so the deadline given is the latest that notice could leave.
    """
    data = _json(body, "rebalance")
    if not isinstance(data, dict):
        raise CloudResponseError(f"rebalance is {short(data)}, not an object")
    notice_time = _iso_time(data.get("noticeTime"), "rebalance.noticeTime")
    return CloudEvent(
        "aws",
        "rebalance",
        "rebalance recommendation",
        max(notice_time, now) + 120.0,
        f"aws-rebalance-{notice_time}",
    )


def parse_gce_maintenance(body: bytes, now: float) -> CloudEvent | None:
    """``instance/maintenance-event``: NONE, or a migration / termination about 60 s ahead."""
    text = _text(body, "maintenance-event")
    if text == "NONE":
        return None
    if text not in ("MIGRATE_ON_HOST_MAINTENANCE", "TERMINATE_ON_HOST_MAINTENANCE"):
        raise CloudResponseError(
            f"maintenance-event = {short(text)}: NONE, MIGRATE_ON_HOST_MAINTENANCE or "
            "TERMINATE_ON_HOST_MAINTENANCE"
        )
    return CloudEvent("gce", "maintenance", text, now + GCE_MAINTENANCE_LEAD_S, f"gce-{text}")


def parse_gce_preempted(body: bytes, now: float) -> CloudEvent | None:
    """``instance/preempted``: TRUE once a spot/preemptible VM is being preempted (~30 s)."""
    text = _text(body, "preempted")
    if text == "FALSE":
        return None
    if text != "TRUE":
        raise CloudResponseError(f"preempted = {short(text)}: TRUE or FALSE")
    return CloudEvent(
        "gce", "preempted", "preemption", now + GCE_PREEMPTION_LEAD_S, "gce-preempted"
    )


def parse_azure_events(body: bytes, vm_name: str) -> list[CloudEvent]:
    """Scheduled Events for this VM that end it (Preempt, Terminate, Reboot, Redeploy)."""
    data = _json(body, "scheduledevents")
    if not isinstance(data, dict) or not isinstance(data.get("Events"), list):
        raise CloudResponseError('scheduledevents is not {"Events": [...]}')
    events = []
    for i, event in enumerate(data["Events"]):
        if not isinstance(event, dict):
            raise CloudResponseError(f"scheduledevents.Events[{i}] is not an object")
        kind = event.get("EventType")
        resources = event.get("Resources", [])
        if kind not in ("Preempt", "Terminate", "Reboot", "Redeploy"):
            continue  # Freeze and the like pause the VM; they do not end it
        if not isinstance(resources, list) or (vm_name and vm_name not in resources):
            continue  # another VM's event
        not_before = event.get("NotBefore")
        if not not_before:
            raise CloudResponseError(f"Events[{i}] ({kind}) has no NotBefore time")
        try:
            parsed = email.utils.parsedate_to_datetime(not_before)
        except (TypeError, ValueError, IndexError):
            parsed = None  # "soon", a number, a list: not the HTTP date Azure documents
        if parsed is None:
            raise CloudResponseError(
                f"Events[{i}].NotBefore = {short(not_before)}: not an HTTP date"
            )
        event_id = str(event.get("EventId", i))[:100]
        events.append(
            CloudEvent(
                "azure",
                "scheduled-event",
                f"{kind} ({event_id})",
                parsed.timestamp(),
                f"azure-{event_id}",
            )
        )
    return events


def _json(body: bytes, what: str) -> object:
    try:
        return json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CloudResponseError(f"{what}: not JSON ({str(exc)[:100]})") from None


def _text(body: bytes, what: str) -> str:
    try:
        return body.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise CloudResponseError(f"{what}: not UTF-8 text") from None


# --- HTTP ----------------------------------------------------------------------------------


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        return None  # a metadata service never redirects: a redirect is not followed


_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirect())


def _request(
    url: str, headers: dict[str, str], timeout: float, method: str = "GET"
) -> tuple[int, dict, bytes]:
    """(status, headers, body) - body bounded; 404 is an answer, not an error.

    Whatever the other end sends - no HTTP at all, a broken status line, a header line over
    http.client's 64 kB limit, broken chunked encoding - is a ``CloudResponseError`` (or an
    ``OSError`` for the network), never another exception.
    """
    request = urllib.request.Request(url, headers=headers, method=method)
    try:
        with _OPENER.open(request, timeout=timeout) as response:
            body = response.read(MAX_BODY + 1)
            status, got = response.status, dict(response.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers or {}), b""
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, OSError):
            raise exc.reason from None
        raise CloudResponseError(f"{url}: {str(exc.reason)[:200]}") from None
    except (http.client.HTTPException, ValueError) as exc:
        what = f"{type(exc).__name__}: {str(exc)[:200]}"
        raise CloudResponseError(f"{url}: not a valid HTTP answer ({what})") from None
    if len(body) > MAX_BODY:
        raise CloudResponseError(f"{url}: answer larger than {MAX_BODY} bytes")
    return status, got, body


class CloudPoller:
    """Reads one cloud's metadata service; ``poll_once`` returns the new events."""

    def __init__(self, cloud: str, base_url: str | None = None, timeout_s: float = 2.0) -> None:
        if cloud not in CLOUDS:
            raise ValueError(f"cloud {cloud!r}: one of {', '.join(CLOUDS)}")
        self.cloud = cloud
        self.base = (base_url or DEFAULT_URLS[cloud]).rstrip("/")
        self.timeout_s = timeout_s
        self._token: tuple[str, float] | None = None
        self._azure_vm: str | None = None
        self.seen: set[str] = set()

    # --- per cloud ---------------------------------------------------------------------------

    def _aws_headers(self) -> dict[str, str]:
        if self._token is None or self._token[1] < time.monotonic():
            status, _h, body = _request(
                f"{self.base}/latest/api/token",
                {"X-aws-ec2-metadata-token-ttl-seconds": str(AWS_TOKEN_TTL_S)},
                self.timeout_s,
                "PUT",
            )
            if status != 200 or not body:
                raise CloudResponseError(f"IMDSv2 token: status {status}")
            token = _text(body, "token")
            if not _TOKEN.fullmatch(token):
                raise CloudResponseError(
                    f"IMDSv2 token {short(token, 60)} has characters a token cannot have "
                    "(printable ASCII without spaces, at most 1024)"
                )
            self._token = (token, time.monotonic() + AWS_TOKEN_TTL_S / 2)
        return {"X-aws-ec2-metadata-token": self._token[0]}

    def _aws(self, now: float) -> list[CloudEvent]:
        headers = self._aws_headers()
        events = []
        status, _h, body = _request(
            f"{self.base}/latest/meta-data/spot/instance-action", headers, self.timeout_s
        )
        if status == 200:
            events.append(parse_aws_instance_action(body))
        elif status != 404:
            raise CloudResponseError(f"spot/instance-action: status {status}")
        status, _h, body = _request(
            f"{self.base}/latest/meta-data/events/recommendations/rebalance",
            headers,
            self.timeout_s,
        )
        if status == 200:
            events.append(parse_aws_rebalance(body, now))
        elif status != 404:
            raise CloudResponseError(f"rebalance: status {status}")
        return events

    def _gce(self, now: float) -> list[CloudEvent]:
        headers = {"Metadata-Flavor": "Google"}
        out = []
        for path, parse in (
            ("maintenance-event", parse_gce_maintenance),
            ("preempted", parse_gce_preempted),
        ):
            status, got, body = _request(
                f"{self.base}/computeMetadata/v1/instance/{path}", headers, self.timeout_s
            )
            if status != 200 or got.get("Metadata-Flavor") != "Google":
                raise CloudResponseError(f"{path}: status {status}, not a GCE metadata answer")
            event = parse(body, now)
            if event is not None:
                out.append(event)
        return out

    def _azure(self, now: float) -> list[CloudEvent]:
        headers = {"Metadata": "true"}
        if self._azure_vm is None:
            status, _h, body = _request(
                f"{self.base}/metadata/instance/compute/name?api-version=2021-02-01&format=text",
                headers,
                self.timeout_s,
            )
            self._azure_vm = _text(body, "compute/name") if status == 200 else ""
        status, _h, body = _request(
            f"{self.base}/metadata/scheduledevents?api-version={AZURE_API}", headers, self.timeout_s
        )
        if status != 200:
            raise CloudResponseError(f"scheduledevents: status {status}")
        return parse_azure_events(body, self._azure_vm)

    # --- the loop's one step -----------------------------------------------------------------

    def poll_once(self, now: float | None = None) -> list[CloudEvent]:
        """New events since the last poll; a bad answer is logged and gives none."""
        now = time.time() if now is None else now
        try:
            events = {"aws": self._aws, "gce": self._gce, "azure": self._azure}[self.cloud](now)
        except (CloudResponseError, OSError) as exc:
            logger.warning(
                "ray_graceful: %s metadata gave no usable answer: %s", self.cloud, str(exc)[:500]
            )
            return []
        except Exception as exc:  # a case the parsers missed: still a log line, never a crash
            logger.warning(
                "ray_graceful: %s metadata gave no usable answer (unexpected %s: %s)",
                self.cloud,
                type(exc).__name__,
                str(exc)[:500],
            )
            return []
        fresh = [e for e in events if e.key not in self.seen]
        self.seen.update(e.key for e in fresh)
        return fresh


def detect(base_urls: dict[str, str] | None = None, timeout_s: float = 1.0) -> str | None:
    """Which cloud's metadata service answers here, or None (off a cloud: nothing answers)."""
    urls = {**DEFAULT_URLS, **(base_urls or {})}
    probes = (
        ("aws", "/latest/api/token", {"X-aws-ec2-metadata-token-ttl-seconds": "60"}, "PUT"),
        ("gce", "/computeMetadata/v1/instance/id", {"Metadata-Flavor": "Google"}, "GET"),
        ("azure", f"/metadata/instance?api-version={AZURE_API}", {"Metadata": "true"}, "GET"),
    )
    for cloud, path, headers, method in probes:
        try:
            status, got, body = _request(urls[cloud].rstrip("/") + path, headers, timeout_s, method)
        except (CloudResponseError, OSError):
            continue
        if status != 200:
            continue
        if cloud == "gce" and got.get("Metadata-Flavor") != "Google":
            continue
        if cloud == "aws" and not body:
            continue
        return cloud
    return None
