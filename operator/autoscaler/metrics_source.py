"""The built-in autoscaler's input: the gateways' exact in-flight counts, read from their ``/metrics``.

Each gateway reports ``m3stack_gateway_engine_inflight_requests{model_name=..., engine=...}``, the engine requests it
has open on each engine right now; the sum over engines and gateways is the observed concurrency.
The 503 responses it counted (``m3stack_gateway_requests_total{status="503"}``) are the demand seen
while no engine can serve, which is how a deployment scaled to zero wakes up.

Where the gateways are (``MetricsTargets``): by default the pods the gateway Service selects, scraped
on their pod IP and the gateway port.  Explicit URLs per resource replace that for runs where pod IPs
cannot be reached (the operator outside the cluster, tests whose pods are fake): with any explicit
URLs configured, resources without an entry are not scraped at all.
"""

import asyncio
import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx
from prometheus_client.parser import text_string_to_metric_families

from m3stack.metrics import GATEWAY_INFLIGHT as INFLIGHT_METRIC
from m3stack.metrics import GATEWAY_REQUESTS as REQUESTS_METRIC
from m3stack.metrics import REFUSED_STATUS
from m3stack.operator.autoscaler.cluster_view import PodSummary

logger = logging.getLogger(__name__)

METRICS_PATH = "/metrics"
# A gateway's page is a few tens of KiB; anything far larger is not one.
MAX_RESPONSE_BYTES = 4 << 20


class MetricsFormatError(ValueError):
    """A /metrics page that is not a gateway's, or holds impossible values."""


@dataclass(frozen=True)
class GatewayReading:
    inflight: float  # engine requests this gateway has open, over every engine
    refused: float  # 503 responses since the gateway started (a counter)


def parse_gateway_metrics(text: str) -> GatewayReading:
    """The two families the autoscaler reads, from a Prometheus text page; the rest is skipped unparsed."""
    wanted = [line for line in text.splitlines() if _mentions(line, (INFLIGHT_METRIC, REQUESTS_METRIC))]
    if f"# TYPE {INFLIGHT_METRIC} gauge" not in wanted:
        raise MetricsFormatError(f"not a gateway's metrics: no {INFLIGHT_METRIC} gauge")
    inflight = refused = 0.0
    try:
        families = list(text_string_to_metric_families("\n".join(wanted) + "\n"))
    except ValueError as error:
        raise MetricsFormatError(f"unparsable metrics: {error}") from error
    for family in families:
        for sample in family.samples:
            if not math.isfinite(sample.value) or sample.value < 0:
                raise MetricsFormatError(f"{sample.name}{sample.labels} = {sample.value}")
            if sample.name == INFLIGHT_METRIC:
                inflight += sample.value
            elif sample.name == REQUESTS_METRIC and sample.labels.get("status") == REFUSED_STATUS:
                refused += sample.value
    return GatewayReading(inflight=inflight, refused=refused)


def _mentions(line: str, names: Iterable[str]) -> bool:
    """Sample lines of these metrics and their HELP/TYPE comments (``name{`` or ``name `` exactly)."""
    body = line[7:] if line.startswith(("# HELP ", "# TYPE ")) else line
    return any(body.startswith(name) and body[len(name) : len(name) + 1] in ("{", " ") for name in names)


@dataclass(frozen=True)
class Scrape:
    """One round over a resource's gateways."""

    readings: Mapping[str, GatewayReading]  # url -> reading, for the gateways that answered
    failures: Mapping[str, str] = field(default_factory=dict)  # url -> why it did not

    @property
    def inflight(self) -> float:
        return sum(reading.inflight for reading in self.readings.values())


class GatewayScraper:
    """Reads many gateways' /metrics concurrently over one HTTP client."""

    def __init__(self, timeout_s: float, client: httpx.AsyncClient | None = None) -> None:
        self._client = client or httpx.AsyncClient(timeout=timeout_s, follow_redirects=False, trust_env=False)
        self._timeout_s = timeout_s

    async def scrape(self, urls: Sequence[str]) -> Scrape:
        results = await asyncio.gather(*(self._read(url) for url in urls))
        readings = {
            url: result for url, result in zip(urls, results, strict=True) if isinstance(result, GatewayReading)
        }
        failures = {url: result for url, result in zip(urls, results, strict=True) if isinstance(result, str)}
        return Scrape(readings=readings, failures=failures)

    async def _read(self, url: str) -> GatewayReading | str:
        try:
            async with self._client.stream("GET", url, timeout=self._timeout_s) as response:
                if response.status_code != 200:
                    return f"HTTP {response.status_code}"
                body = bytearray()
                async for chunk in response.aiter_bytes():
                    body += chunk
                    if len(body) > MAX_RESPONSE_BYTES:
                        return f"response larger than {MAX_RESPONSE_BYTES} bytes"
            return parse_gateway_metrics(body.decode("utf-8", errors="replace"))
        except httpx.HTTPError as error:
            return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
        except MetricsFormatError as error:
            return str(error)

    async def aclose(self) -> None:
        await self._client.aclose()


# ------------------------------------------------------------------------------------------------
# Targets


Key = tuple[str, str]  # (namespace, name)


def pod_metrics_urls(pods: Iterable[PodSummary], port: int) -> list[str]:
    """The /metrics URL of every running gateway pod with an address, terminating ones included
    (they still hold the requests they are draining)."""
    urls = []
    for pod in pods:
        if pod.phase != "Running" or not pod.pod_ip:
            continue
        host = f"[{pod.pod_ip}]" if ":" in pod.pod_ip else pod.pod_ip
        urls.append(f"http://{host}:{port}{METRICS_PATH}")
    return sorted(urls)


@dataclass(frozen=True)
class MetricsTargets:
    """Explicit gateway metrics URLs per resource (``(namespace or None, name) -> urls``), or pod discovery
    when there are none."""

    explicit: Mapping[tuple[str | None, str], tuple[str, ...]] = field(default_factory=dict)

    def urls(self, key: Key, gateway_pods: Iterable[PodSummary], gateway_port: int) -> list[str]:
        if not self.explicit:
            return pod_metrics_urls(gateway_pods, gateway_port)
        namespace, name = key
        return list(self.explicit.get((namespace, name), self.explicit.get((None, name), ())))


def parse_explicit_targets(text: str) -> dict[tuple[str | None, str], tuple[str, ...]]:
    """``"[NAMESPACE/]NAME=URL[,URL...][;...]"`` -> ``{(namespace or None, name): urls}``; raises ValueError."""
    targets: dict[tuple[str | None, str], tuple[str, ...]] = {}
    for entry in (part.strip() for part in text.split(";")):
        if not entry:
            continue
        resource, separator, urls = entry.partition("=")
        if not separator:
            raise ValueError(f"{entry!r}: expected [NAMESPACE/]NAME=URL[,URL...]")
        namespace, _, name = resource.strip().rpartition("/")
        if not name:
            raise ValueError(f"{entry!r}: no resource name before '='")
        checked = tuple(_checked_url(url.strip()) for url in urls.split(",") if url.strip())
        if not checked:
            raise ValueError(f"{entry!r}: no URL after '='")
        targets[(namespace or None, name)] = checked
    return targets


def _checked_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r}: expected an http(s) URL with a host")
    try:
        parts.port  # noqa: B018 (raises on a malformed port)
    except ValueError as error:
        raise ValueError(f"{url!r}: {error}") from error
    return url
