"""The built-in autoscaler's input: gateway /metrics pages (rendered by the real GatewayMetrics), read
over real HTTP on loopback, and where the gateways are (pods or explicit URLs)."""

import asyncio
import contextlib
import random
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest
from prometheus_client.parser import text_string_to_metric_families

from m3stack.gateway.metrics import GatewayMetrics
from m3stack.metrics import GATEWAY_INFLIGHT, GATEWAY_REQUESTS, REFUSED_STATUS
from m3stack.operator.autoscaler.cluster_view import PodSummary
from m3stack.operator.autoscaler.metrics_source import (
    MAX_RESPONSE_BYTES,
    GatewayReading,
    GatewayScraper,
    MetricsFormatError,
    MetricsTargets,
    parse_explicit_targets,
    parse_gateway_metrics,
    pod_metrics_urls,
)


def gateway_page(inflight: dict[str, int], refused: int = 0, other_statuses: int = 0) -> str:
    metrics = GatewayMetrics("m3-prod")
    for engine, count in inflight.items():
        metrics.engine_inflight.labels(engine=engine).set(count)
        metrics.engine_ready.labels(engine=engine).set(1)
    for _ in range(refused):
        metrics.requests.labels(endpoint="/v1/chat/completions", status="503").inc()
    for _ in range(other_statuses):
        metrics.requests.labels(endpoint="/v1/completions", status="200").inc()
    metrics.time_to_first_token.observe(0.3)
    return metrics.render().decode()


def test_the_names_are_the_gateways_own():
    page = gateway_page({"10.0.0.1:50051": 1}, refused=1)
    assert f"# TYPE {GATEWAY_INFLIGHT} gauge" in page
    labels = {"model_name": "m3-prod", "endpoint": "/v1/chat/completions", "status": REFUSED_STATUS}
    samples = [sample for family in text_string_to_metric_families(page) for sample in family.samples]
    assert any(sample.name == GATEWAY_REQUESTS and sample.labels == labels for sample in samples)


def test_a_gateway_page_gives_the_sum_over_engines_and_the_refused_count():
    rng = random.Random()
    inflight = {f"10.0.0.{i}:50051": rng.randrange(0, 50) for i in range(rng.randrange(1, 6))}
    refused, ok = rng.randrange(0, 9), rng.randrange(1, 9)
    reading = parse_gateway_metrics(gateway_page(inflight, refused=refused, other_statuses=ok))
    assert reading == GatewayReading(inflight=sum(inflight.values()), refused=refused)


def test_a_gateway_without_engines_reads_zero():
    assert parse_gateway_metrics(gateway_page({})) == GatewayReading(0.0, 0.0)


@pytest.mark.parametrize(
    ("page", "complaint"),
    [
        ("<html><body>hello</body></html>", "not a gateway's metrics"),
        ("", "not a gateway's metrics"),
        (gateway_page({"e:1": 3}).replace(" 3.0\n", " -3.0\n"), "-3.0"),
        (gateway_page({"e:1": 3}).replace(" 3.0\n", " NaN\n"), "nan"),
        (gateway_page({"e:1": 3}).replace(" 3.0\n", " three\n"), "unparsable"),
    ],
)
def test_pages_that_are_not_a_gateways_are_refused(page, complaint):
    with pytest.raises(MetricsFormatError, match=complaint):
        parse_gateway_metrics(page)


def test_similar_names_are_not_counted():
    page = gateway_page({"e:1": 2}) + f'{GATEWAY_INFLIGHT}_other{{engine="e:1"}} 40.0\n'
    assert parse_gateway_metrics(page).inflight == 2


class _Pages(BaseHTTPRequestHandler):
    pages: ClassVar[dict[str, str]] = {}
    # /gate/* answers only once three requests wait at it together: reads one after another never pass.
    gate: ClassVar[threading.Barrier] = threading.Barrier(3, timeout=3)

    def do_GET(self) -> None:
        # The client may give up first (the timeout and size tests).
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            self._answer()

    def _answer(self) -> None:
        if self.path == "/slow":
            time.sleep(1.5)
        if self.path.startswith("/gate/"):
            try:
                self.gate.wait()
            except threading.BrokenBarrierError:
                self.send_response(503)
                self.end_headers()
                return
        if self.path == "/huge":
            self.send_response(200)
            self.end_headers()
            chunk = b"# " + b"x" * 65534 + b"\n"
            for _ in range(MAX_RESPONSE_BYTES // len(chunk) + 2):
                self.wfile.write(chunk)
            return
        page = self.pages.get(self.path)
        self.send_response(200 if page is not None else 404)
        self.end_headers()
        self.wfile.write((page or "not found").encode())

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture(scope="module")
def pages_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Pages)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _scrape(urls: list[str], timeout_s: float):
    async def scrape():
        scraper = GatewayScraper(timeout_s=timeout_s)
        try:
            return await scraper.scrape(urls)
        finally:
            await scraper.aclose()

    return asyncio.run(scrape())


def test_scraping_many_gateways_sums_those_that_answer(pages_server):
    _Pages.pages = {"/a": gateway_page({"e:1": 3, "e:2": 4}, refused=2), "/b": gateway_page({"e:1": 5})}
    closed = f"http://127.0.0.1:{_closed_port()}/metrics"
    urls = [f"{pages_server}/a", f"{pages_server}/b", f"{pages_server}/missing", f"{pages_server}/slow", closed]
    result = _scrape(urls, timeout_s=0.3)
    assert result.inflight == 12
    assert result.readings[f"{pages_server}/a"].refused == 2
    assert set(result.failures) == {f"{pages_server}/missing", f"{pages_server}/slow", closed}
    assert result.failures[f"{pages_server}/missing"] == "HTTP 404"
    assert "Timeout" in result.failures[f"{pages_server}/slow"]
    assert "Connect" in result.failures[closed]


def test_gateways_are_read_at_the_same_time(pages_server):
    for gate in ("/gate/1", "/gate/2", "/gate/3"):
        _Pages.pages[gate] = gateway_page({"e:1": 1})
    result = _scrape([f"{pages_server}/gate/{i}" for i in (1, 2, 3)], timeout_s=10)
    assert not result.failures
    assert result.inflight == 3


def test_an_oversized_page_is_cut_off(pages_server):
    result = _scrape([f"{pages_server}/huge"], timeout_s=5)
    assert not result.readings
    assert "larger than" in result.failures[f"{pages_server}/huge"]


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _pod(name: str, ip: str | None, phase: str = "Running", terminating: bool = False) -> PodSummary:
    return PodSummary(name, "gateway", phase, phase == "Running", False, terminating, ip)


def test_running_gateway_pods_are_scraped_on_their_address():
    pods = [
        _pod("a", "10.244.0.7"),
        _pod("b", "fd00::5"),
        _pod("c", "10.244.0.9", terminating=True),  # still draining requests
        _pod("d", None, phase="Pending"),
        _pod("e", "10.244.0.3", phase="Succeeded"),
    ]
    assert pod_metrics_urls(pods, 8000) == [
        "http://10.244.0.7:8000/metrics",
        "http://10.244.0.9:8000/metrics",
        "http://[fd00::5]:8000/metrics",
    ]


def test_explicit_urls_replace_discovery_for_every_resource():
    targets = MetricsTargets(
        parse_explicit_targets("ns1/a=http://127.0.0.1:1/metrics,http://127.0.0.1:2/metrics; b=http://[::1]:3/m")
    )
    pods = [_pod("x", "10.244.0.7")]
    assert targets.urls(("ns1", "a"), pods, 8000) == ["http://127.0.0.1:1/metrics", "http://127.0.0.1:2/metrics"]
    assert targets.urls(("other", "b"), pods, 8000) == ["http://[::1]:3/m"]
    assert targets.urls(("ns2", "a"), pods, 8000) == [], "a resource without URLs is not scraped at all"
    assert MetricsTargets().urls(("ns2", "a"), pods, 8000) == ["http://10.244.0.7:8000/metrics"]


@pytest.mark.parametrize(
    ("text", "complaint"),
    [
        ("a", "expected"),
        ("=http://127.0.0.1:1/", "no resource name"),
        ("a=", "no URL"),
        ("a=ftp://127.0.0.1/", "http"),
        ("a=http:///metrics", "host"),
        ("a=http://127.0.0.1:99999/metrics", "(?i)port"),
    ],
)
def test_bad_explicit_targets_are_refused(text, complaint):
    with pytest.raises(ValueError, match=complaint):
        parse_explicit_targets(text)
