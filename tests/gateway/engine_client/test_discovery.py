"""DNS discovery of engines: records to targets, and the pool following the answers."""

import asyncio
import socket

from m3stack.gateway.engine_client.breaker import BreakerSettings
from m3stack.gateway.engine_client.client import ProbeSettings
from m3stack.gateway.engine_client.discovery import (
    DnsDiscovery,
    addresses_from_records,
    format_address,
    system_resolver,
)
from m3stack.gateway.engine_client.pool import EnginePool
from m3stack.gateway.metrics import GatewayMetrics


def record(family: int, host: str) -> tuple:
    sockaddr = (host, 50051) if family == socket.AF_INET else (host, 50051, 0, 0)
    return (family, socket.SOCK_STREAM, 6, "", sockaddr)


def test_records_become_sorted_distinct_targets():
    records = [
        record(socket.AF_INET, "10.0.0.2"),
        record(socket.AF_INET6, "fd00::1"),
        record(socket.AF_INET, "10.0.0.1"),
        record(socket.AF_INET, "10.0.0.2"),
    ]
    assert addresses_from_records(records, 7000) == ["10.0.0.1:7000", "10.0.0.2:7000", "[fd00::1]:7000"]
    assert format_address("::1", 5) == "[::1]:5"
    assert format_address("engine-0.engines", 5) == "engine-0.engines:5"


def test_pool_follows_dns_answers_and_survives_lookup_failures():
    answers: list[list[tuple] | OSError] = [
        [record(socket.AF_INET, "127.0.0.2"), record(socket.AF_INET, "127.0.0.3")],
        [record(socket.AF_INET, "127.0.0.3"), record(socket.AF_INET, "127.0.0.4")],
        socket.gaierror(socket.EAI_NONAME, "Name or service not known"),
    ]

    async def scripted_resolver(host: str, port: int) -> list[tuple]:
        answer = answers.pop(0)
        if isinstance(answer, OSError):
            raise answer
        return answer

    async def scenario() -> tuple[list[list[str]], str, str]:
        metrics = GatewayMetrics("m3")
        pool = EnginePool(BreakerSettings(), ProbeSettings(), metrics)
        discovery = DnsDiscovery("engines.default.svc", 9, pool, 60.0, resolver=scripted_resolver)
        seen = []
        for _ in range(3):
            await discovery.refresh()
            seen.append(sorted(pool.engines))
        serving = metrics.render().decode()
        await pool.stop()
        return seen, serving, metrics.render().decode()

    seen, serving, stopped = asyncio.run(scenario())
    # Each engine's series carry the model's name; closed engines' series go away.
    assert 'm3stack_gateway_engine_inflight_requests{engine="127.0.0.4:9",model_name="m3"} 0.0' in serving
    assert "engine=" not in stopped
    assert seen == [
        ["127.0.0.2:9", "127.0.0.3:9"],
        ["127.0.0.3:9", "127.0.0.4:9"],
        ["127.0.0.3:9", "127.0.0.4:9"],  # the failed lookup kept the last answer
    ]


def test_the_system_resolver_finds_localhost():
    records = asyncio.run(system_resolver("localhost", 50051))
    assert "127.0.0.1:50051" in addresses_from_records(records, 50051)
