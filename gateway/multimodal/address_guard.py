"""SSRF guard: which hosts a media URL may name and which addresses it may reach.

A host passes when it matches the domain allowlist (if any), and every address it resolves to is
global (not loopback, private, link-local, shared, reserved, multicast or unspecified, including
IPv4 addresses embedded in IPv6 forms).  The fetcher connects to exactly the address checked here
(no second resolution an attacker's DNS could answer differently) and repeats the check on every
redirect hop.
"""

import asyncio
import ipaddress
import socket
from collections.abc import Awaitable, Callable, Sequence

from .errors import MediaError

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
# (host, port) -> addresses; the default asks the system resolver.
Resolver = Callable[[str, int], Awaitable[list[str]]]


def is_global_address(address: IPAddress) -> bool:
    """True only for addresses that route on the public internet."""
    if isinstance(address, ipaddress.IPv6Address):
        embedded = address.ipv4_mapped or address.sixtofour or (address.teredo[1] if address.teredo else None)
        if embedded is not None:
            return is_global_address(embedded)
    return address.is_global and not address.is_multicast and not address.is_unspecified


def host_in_allowlist(host: str, allowed_domains: Sequence[str]) -> bool:
    """Empty allowlist: any host.  Otherwise the host or one of its parent domains must be listed."""
    if not allowed_domains:
        return True
    name = host.lower().rstrip(".")
    return any(name == domain or name.endswith("." + domain) for domain in allowed_domains)


async def system_resolver(host: str, port: int) -> list[str]:
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(info[4][0] for info in infos))


async def resolve_allowed(
    host: str,
    port: int,
    *,
    allowed_domains: Sequence[str] = (),
    allow_private: bool = False,
    resolver: Resolver = system_resolver,
) -> list[IPAddress]:
    """The addresses a fetch to ``host`` may connect to; raises :class:`MediaError` when the host is refused."""
    if not host:
        raise MediaError("the media URL has no host", "media_fetch_failed")
    if not host_in_allowlist(host, allowed_domains):
        raise MediaError(f"media host {host!r} is not in the allowed domains", "media_fetch_failed")
    literal = _ip_literal(host)
    if literal is not None:
        addresses = [literal]
    else:
        try:
            addresses = [ipaddress.ip_address(a.split("%", 1)[0]) for a in await resolver(host, port)]
        except (OSError, UnicodeError, ValueError) as exc:
            raise MediaError(f"media host {host!r} cannot be resolved ({exc})", "media_fetch_failed") from None
    if not addresses:
        raise MediaError(f"media host {host!r} has no addresses", "media_fetch_failed")
    if not allow_private:
        refused = [str(a) for a in addresses if not is_global_address(a)]
        if refused:
            raise MediaError(
                f"media host {host!r} resolves to a non-public address ({', '.join(refused)})", "media_fetch_failed"
            )
    return addresses


def _ip_literal(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None
