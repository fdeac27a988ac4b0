"""Where the engines are: a fixed list, or the addresses behind a Kubernetes headless Service.

A headless Service's DNS name resolves to one A/AAAA record per ready pod, so re-resolving it every
few seconds follows scale-ups, scale-downs and restarts without talking to the Kubernetes API.
"""

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from m3stack.gateway.engine_client.pool import EnginePool

logger = logging.getLogger(__name__)

AddrInfo = tuple[Any, ...]  # what getaddrinfo returns per record: (family, type, proto, canonname, sockaddr)
Resolver = Callable[[str, int], Awaitable[list[AddrInfo]]]


def format_address(host: str, port: int) -> str:
    """``HOST:PORT`` as gRPC targets want it (IPv6 literals in brackets)."""
    try:
        if ipaddress.ip_address(host).version == 6:
            return f"[{host}]:{port}"
    except ValueError:
        pass
    return f"{host}:{port}"


def addresses_from_records(records: Iterable[AddrInfo], port: int) -> list[str]:
    """Distinct ``IP:PORT`` targets from getaddrinfo records, sorted so the order is stable."""
    hosts = {record[4][0] for record in records if record[0] in (socket.AF_INET, socket.AF_INET6)}
    return [format_address(host, port) for host in sorted(hosts)]


async def system_resolver(host: str, port: int) -> list[AddrInfo]:
    return await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)


class DnsDiscovery:
    """Re-resolves ``host`` every ``interval_s`` and makes the pool follow the answer.

    A failed lookup keeps the last known engines: a DNS hiccup must not empty the pool, and when the
    Service has no ready pods at all (NXDOMAIN) the health probes already mark the old ones down.
    """

    def __init__(
        self, host: str, port: int, pool: EnginePool, interval_s: float, resolver: Resolver = system_resolver
    ) -> None:
        self._host = host
        self._port = port
        self._pool = pool
        self._interval_s = interval_s
        self._resolver = resolver
        self._task: asyncio.Task[None] | None = None

    async def refresh(self) -> None:
        try:
            records = await self._resolver(self._host, self._port)
        except (OSError, UnicodeError) as exc:
            logger.warning(
                "resolving engine service %s failed: %s; keeping %d engines", self._host, exc, len(self._pool.engines)
            )
            return
        self._pool.set_addresses(addresses_from_records(records, self._port))

    def start(self) -> None:
        self._task = asyncio.create_task(self._refresh_forever(), name="engine-discovery")

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            await self.refresh()

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
