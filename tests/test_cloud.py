"""Cloud notices over real HTTP, against a stand-in metadata server on 127.0.0.1.

The stand-in answers with each cloud's documented responses (AWS IMDSv2 spot instance-action
and rebalance, GCE maintenance-event and preempted, Azure Scheduled Events) - and with the
malformed, slow, failing and hostile answers a poller must survive: a log line, no notice,
never a crash, never an invented deadline.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from ray_graceful.cloud import CloudPoller, detect
from ray_graceful.node.agent import agent_name
from ray_graceful.ray_adapter import actor_id_of

AWS_TOKEN = "AQAEAtoken=="


class MetadataServer:
    """routes: (method, path) -> (status, headers, body, delay_s)."""

    def __init__(self) -> None:
        self.routes: dict[tuple[str, str], tuple[int, dict, bytes, float]] = {}
        self.requests: list[tuple[str, str, dict]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                server.requests.append((self.command, self.path, self.headers))  # any case
                status, headers, body, delay = server.routes.get(
                    (self.command, self.path), (404, {}, b"", 0.0)
                )
                if callable(body):
                    status, headers, body = body(self)
                time.sleep(delay)
                try:
                    self.send_response(status)
                    for k, v in headers.items():
                        self.send_header(k, v)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except OSError:
                    pass  # the client gave up (a slow answer)

            do_GET = do_PUT = _answer

            def log_message(self, *args) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def route(self, method, path, status=200, body=b"", headers=None, delay=0.0):
        if isinstance(body, (dict, list)):
            body = json.dumps(body).encode()
        elif isinstance(body, str):
            body = body.encode()
        self.routes[(method, path)] = (status, headers or {}, body, delay)

    def close(self) -> None:
        self.httpd.shutdown()


@pytest.fixture
def server():
    s = MetadataServer()
    yield s
    s.close()


def aws(server: MetadataServer) -> None:
    def token(handler):
        ok = handler.headers.get("X-aws-ec2-metadata-token-ttl-seconds")
        return (200, {}, AWS_TOKEN.encode()) if ok else (400, {}, b"")

    server.routes[("PUT", "/latest/api/token")] = (200, {}, token, 0.0)


def gce(server: MetadataServer, maintenance="NONE", preempted="FALSE") -> None:
    flavor = {"Metadata-Flavor": "Google"}
    server.route("GET", "/computeMetadata/v1/instance/id", body="123", headers=flavor)
    base = "/computeMetadata/v1/instance/"
    server.route("GET", base + "maintenance-event", body=maintenance, headers=flavor)
    server.route("GET", base + "preempted", body=preempted, headers=flavor)


def iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def test_aws_spot_interruption_with_the_clouds_own_deadline(server):
    aws(server)
    assert detect({"aws": server.url}) == "aws"
    poller = CloudPoller("aws", server.url)
    assert poller.poll_once() == [], "no notice yet: 404 is the normal answer"
    when = int(time.time()) + 120
    server.route(
        "GET",
        "/latest/meta-data/spot/instance-action",
        body={"action": "terminate", "time": iso(when)},
    )
    (event,) = poller.poll_once()
    assert event.kind == "spot-interruption" and event.deadline == when
    assert poller.poll_once() == [], "the same event is reported once"
    token_uses = [h for m, p, h in server.requests if m == "GET"]
    assert all(h.get("X-aws-ec2-metadata-token") == AWS_TOKEN for h in token_uses), "IMDSv2"
    notice = event.to_notice("node-1", cycle=0)
    assert notice.deadline == when and notice.node_id == "node-1"


def test_aws_rebalance_recommendation(server):
    aws(server)
    now = time.time()
    server.route(
        "GET",
        "/latest/meta-data/events/recommendations/rebalance",
        body={"noticeTime": iso(now)},
    )
    (event,) = CloudPoller("aws", server.url).poll_once(now)
    assert event.kind == "rebalance" and event.deadline >= now + 119


def test_gce_maintenance_and_preemption(server):
    gce(server)
    assert detect({"aws": server.url + "/nothing", "gce": server.url}) == "gce"
    poller = CloudPoller("gce", server.url)
    assert poller.poll_once() == []
    gce(server, maintenance="TERMINATE_ON_HOST_MAINTENANCE", preempted="TRUE")
    now = time.time()
    events = {e.kind: e for e in poller.poll_once(now)}
    assert events["maintenance"].deadline == pytest.approx(now + 60)
    assert events["preempted"].deadline == pytest.approx(now + 30)
    requested = [h for m, p, h in server.requests if "maintenance-event" in p]
    assert requested[-1].get("Metadata-Flavor") == "Google"


def test_azure_scheduled_events_for_this_vm_only(server):
    server.route(
        "GET", "/metadata/instance/compute/name?api-version=2021-02-01&format=text", body="vm-a"
    )
    server.route("GET", "/metadata/instance?api-version=2020-07-01", body={"compute": {}})
    not_before = "Mon, 23 Nov 2026 06:40:00 GMT"
    server.route(
        "GET",
        "/metadata/scheduledevents?api-version=2020-07-01",
        body={
            "DocumentIncarnation": 3,
            "Events": [
                {
                    "EventId": "e1",
                    "EventType": "Preempt",
                    "ResourceType": "VirtualMachine",
                    "Resources": ["vm-a"],
                    "EventStatus": "Scheduled",
                    "NotBefore": not_before,
                },
                {
                    "EventId": "e2",
                    "EventType": "Reboot",
                    "Resources": ["vm-b"],
                    "NotBefore": not_before,
                },
                {
                    "EventId": "e3",
                    "EventType": "Freeze",
                    "Resources": ["vm-a"],
                    "NotBefore": not_before,
                },
            ],
        },
    )
    assert (
        detect({"aws": server.url + "/x", "gce": server.url + "/x", "azure": server.url}) == "azure"
    )
    (event,) = CloudPoller("azure", server.url).poll_once()
    assert event.detail.startswith("Preempt (e1)")
    assert time.strftime("%H:%M", time.gmtime(event.deadline)) == "06:40"
    headers = [h for m, p, h in server.requests if "scheduledevents" in p]
    assert headers[-1].get("Metadata") == "true"


def test_off_a_cloud_nothing_answers_and_it_costs_little():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"  # nobody listens once closed
    started = time.monotonic()
    assert detect({"aws": closed, "gce": closed, "azure": closed}, timeout_s=0.5) is None
    assert time.monotonic() - started < 3.0


@pytest.mark.parametrize(
    "body,status,delay,headers,why",
    [
        (b"{not json", 200, 0.0, {}, "not JSON"),
        ({"action": "explode", "time": "2026-01-01T00:00:00Z"}, 200, 0.0, {}, "one of terminate"),
        ({"action": "terminate", "time": "soon"}, 200, 0.0, {}, "not a UTC time"),
        ([1, 2, 3], 200, 0.0, {}, "not an object"),
        (b"x" * (65 * 1024), 200, 0.0, {}, "larger than"),
        (b"", 500, 0.0, {}, "status 500"),
        ({"action": "terminate", "time": "2026-01-01T00:00:00Z"}, 200, 3.0, {}, "timed out"),
        (b"", 302, 0.0, {"Location": "http://example.com/"}, "status 302"),
    ],
)
def test_bad_answers_give_a_log_line_and_no_notice(
    server, caplog, body, status, delay, headers, why
):
    aws(server)
    server.route(
        "GET",
        "/latest/meta-data/spot/instance-action",
        status=status,
        body=body,
        delay=delay,
        headers=headers,
    )
    poller = CloudPoller("aws", server.url, timeout_s=1.0)
    assert poller.poll_once() == []
    assert "aws metadata gave no usable answer" in caplog.text
    assert why in caplog.text, caplog.text[-500:]
    assert not [p for m, p, h in server.requests if "example.com" in p], "no redirect followed"


@pytest.mark.timeout(120)
def test_a_spot_notice_from_the_cloud_tears_the_group_down(ray_cluster, server, tmp_path):
    """The whole path: the node's poller detects the (stand-in) cloud, reads AWS's two-minute
    notice, and the coordinator plans with the cloud's own deadline and commits a checkpoint."""
    import ray

    from ray_graceful import GracefulConfig
    from ray_graceful.coordinator import Coordinator
    from tests import actors
    from tests.helpers import free_port, wait_for

    aws(server)
    config = GracefulConfig(
        report_dir=str(tmp_path / "reports"),
        checkpoint_dir=str(tmp_path / "ckpt"),
        cloud_notices="auto",
        cloud_metadata_url=server.url,
        cloud_poll_interval_s=0.2,
        teardown_timeout_s=15.0,
        save_budget_s=8.0,
        expected_save_s=1.0,
    )
    coordinator = Coordinator.start(config)
    rank = ray.remote(actors.GracefulTrainer).options(num_cpus=0).remote()
    job, poller = ray.get_runtime_context().get_job_id(), None
    try:
        status = ray.get(rank.setup.remote(0, 1, "127.0.0.1", free_port(), config), timeout=60)
        assert "orders arrive through a long poll" in status, status
        assert "cloud notices not started" not in status, status
        node = ray.get(rank.node.remote())
        name = agent_name(job, actor_id_of(coordinator.handle), node)

        def poller_started():
            try:
                return ray.get_actor(name, namespace="ray_graceful")
            except ValueError:
                return None

        try:
            poller = wait_for(poller_started, 30, "the node's cloud poller")
        except AssertionError:
            raise AssertionError((name, ray.util.list_named_actors(all_namespaces=True))) from None
        wait_for(lambda: ray.get(poller.seen.remote())["cloud"] == "aws", 30, "cloud detection")
        ray.get(rank.train.remote(2), timeout=30)
        training = rank.train.remote(100_000, 0.01)
        when = int(time.time()) + 60
        server.route(
            "GET",
            "/latest/meta-data/spot/instance-action",
            body={"action": "terminate", "time": iso(when)},
        )
        outcome = coordinator.wait_outcome(timeout=60, cycle=0)
        assert outcome is not None, "the cloud's notice reached the coordinator"
        notice = outcome.notices[0]
        assert notice["source"] == "cloud" and "aws spot-interruption" in notice["reason"]
        assert notice["deadline"] == when, "the cloud's own deadline"
        assert outcome.result == "committed", outcome.reason
        ray.wait([training], timeout=30)
    finally:
        if poller is not None:
            ray.kill(poller)
        coordinator.shutdown()


class RawServer:
    """Answers every connection with the bytes it is given, whatever HTTP says: the hostile
    answers a metadata service (or something squatting on its address) can send."""

    def __init__(self) -> None:
        self.answer = b""
        self.by_path: dict[bytes, bytes] = {}  # a path's own answer, over ``answer``
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(2)
                try:
                    request = conn.recv(65536)
                    path = request.split(b" ")[1] if request.count(b" ") > 1 else b""
                    conn.sendall(self.by_path.get(path, self.answer))
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()


def http_answer(body: bytes, head: bytes = b"HTTP/1.1 200 OK\r\n") -> bytes:
    return head + b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body


TERMINATE = http_answer(b'{"action": "terminate", "time": "2030-01-01T00:00:00Z"}')


@pytest.mark.parametrize(
    "answer,why",
    [
        (b"HTTP/1.1 abc OK\r\n\r\n", "BadStatusLine"),
        (b"\x00\x01\x02 this is not HTTP at all \xff\r\n\r\n", "not a valid HTTP answer"),
        (
            b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n{}",
            "LineTooLong",
        ),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nbroken\r\n",
            "not a valid HTTP answer",
        ),
    ],
    ids=["bad-status-line", "not-http", "100kB-header", "broken-chunked"],
)
def test_hostile_bytes_are_a_log_line_and_the_next_notice_still_comes(caplog, answer, why):
    """Review defect 3: each of these escaped the poller and ended the node's cloud notices;
    the real TERMINATE that followed was never reported."""
    server = RawServer()
    try:
        server.answer = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nConnection: close\r\n\r\ntoken"
        poller = CloudPoller("aws", server.url, timeout_s=1.0)
        poller._aws_headers()  # the token first, then every GET gets the hostile answer
        server.answer = answer
        assert poller.poll_once() == []
        assert "aws metadata gave no usable answer" in caplog.text and why in caplog.text
        server.answer = b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        server.by_path[b"/latest/meta-data/spot/instance-action"] = TERMINATE
        (event,) = poller.poll_once()
        assert event.kind == "spot-interruption"
    finally:
        server.close()


def test_a_token_with_cr_lf_is_refused_and_a_good_one_later_works(server, caplog):
    server.route("PUT", "/latest/api/token", body=b"abc\r\nX-Injected: 1")
    poller = CloudPoller("aws", server.url, timeout_s=1.0)
    assert poller.poll_once() == []
    assert "has characters a token cannot have" in caplog.text
    aws(server)
    server.route(
        "GET",
        "/latest/meta-data/spot/instance-action",
        body={"action": "terminate", "time": "2030-01-01T00:00:00Z"},
    )
    (event,) = poller.poll_once()
    assert event.kind == "spot-interruption"


def test_an_azure_not_before_of_soon_is_a_log_line(server, caplog):
    server.route(
        "GET", "/metadata/instance/compute/name?api-version=2021-02-01&format=text", body="vm-a"
    )
    events = {"Events": [{"EventType": "Preempt", "Resources": ["vm-a"], "NotBefore": "soon"}]}
    path = "/metadata/scheduledevents?api-version=2020-07-01"
    server.route("GET", path, body=events)
    poller = CloudPoller("azure", server.url, timeout_s=1.0)
    assert poller.poll_once() == []
    assert "NotBefore = 'soon': not an HTTP date" in caplog.text
    events["Events"][0]["NotBefore"] = "Mon, 23 Nov 2026 06:40:00 GMT"
    server.route("GET", path, body=events)
    (event,) = poller.poll_once()
    assert event.detail.startswith("Preempt")


def test_a_poller_that_raises_anyway_is_started_again():
    """The second fence: whatever escapes a step, the node's poller lives on."""
    from ray_graceful.cloud import CloudEvent
    from ray_graceful.node.cloud_poller import poll_forever

    told, made, stop = [], [], threading.Event()
    event = CloudEvent("aws", "spot-interruption", "x", 1.0, "k")

    class Flaky:
        seen: ClassVar[set] = set()

        def __init__(self) -> None:
            made.append(self)

        def poll_once(self):
            if len(made) == 1:
                raise RuntimeError("a bug of ours")
            return [event]

    def tell(e):
        told.append(e)
        stop.set()

    thread = threading.Thread(target=poll_forever, args=(Flaky, tell, 0.01, stop), daemon=True)
    thread.start()
    thread.join(10)
    assert told == [event] and len(made) == 2 and not thread.is_alive()
