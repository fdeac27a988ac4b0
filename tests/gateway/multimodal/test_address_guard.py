"""The SSRF guard, called as functions: nothing here sends a packet (resolvers are local or injected)."""

import asyncio
import ipaddress

import pytest

from m3stack.gateway.multimodal import MediaError
from m3stack.gateway.multimodal.address_guard import host_in_allowlist, is_global_address, resolve_allowed

REFUSED = [
    "127.0.0.1",
    "127.255.0.9",
    "10.1.2.3",
    "172.16.0.1",
    "192.168.1.1",
    "169.254.169.254",  # cloud metadata
    "100.64.0.1",  # carrier-grade NAT
    "0.0.0.0",
    "224.0.0.1",
    "255.255.255.255",
    "198.18.0.1",  # benchmarking
    "::1",
    "::",
    "fe80::1",
    "fc00::1",
    "ff02::1",
    "::ffff:127.0.0.1",  # IPv4-mapped
    "::ffff:10.0.0.1",
    "2002:7f00:1::",  # 6to4 around 127.0.0.1
    "2001:0:4136:e378:8000:63bf:f5ff:fffe",  # Teredo around 10.0.0.1
]
ALLOWED = ["8.8.8.8", "1.1.1.1", "2606:4700:4700::1111", "::ffff:8.8.8.8"]


@pytest.mark.parametrize("address", REFUSED)
def test_non_global_addresses_are_refused(address):
    assert not is_global_address(ipaddress.ip_address(address))


@pytest.mark.parametrize("address", ALLOWED)
def test_global_addresses_pass(address):
    assert is_global_address(ipaddress.ip_address(address))


def test_domain_allowlist_matches_the_domain_and_its_subdomains_only():
    allowed = ("example.com",)
    assert host_in_allowlist("example.com", allowed)
    assert host_in_allowlist("CDN.Example.com.", allowed)
    assert not host_in_allowlist("notexample.com", allowed)
    assert not host_in_allowlist("example.com.evil.net", allowed)
    assert host_in_allowlist("anything.net", ())


def _resolver(table):
    async def resolve(host: str, port: int) -> list[str]:
        return table[host]

    return resolve


def test_a_host_with_any_private_address_is_refused():
    resolver = _resolver({"mixed.example": ["8.8.8.8", "10.0.0.5"], "public.example": ["8.8.4.4"]})
    with pytest.raises(MediaError, match=r"non-public address \(10\.0\.0\.5\)"):
        asyncio.run(resolve_allowed("mixed.example", 443, resolver=resolver))
    assert [str(a) for a in asyncio.run(resolve_allowed("public.example", 443, resolver=resolver))] == ["8.8.4.4"]


@pytest.mark.parametrize("host", ["127.0.0.1", "[::1]", "169.254.169.254", "2130706433", "localhost"])
def test_loopback_and_metadata_hosts_are_refused(host):
    # IP literals are checked without resolving; "2130706433" and "localhost" go through the system
    # resolver, which answers them locally (127.0.0.1) without any network traffic.
    with pytest.raises(MediaError) as error:
        asyncio.run(resolve_allowed(host, 80))
    assert error.value.status == 400 and error.value.code == "media_fetch_failed"


def test_private_networks_can_be_allowed_explicitly():
    addresses = asyncio.run(resolve_allowed("127.0.0.1", 80, allow_private=True))
    assert [str(a) for a in addresses] == ["127.0.0.1"]


def test_allowlist_is_checked_before_resolving():
    async def never(host: str, port: int) -> list[str]:
        raise AssertionError("a host outside the allowlist must not be resolved")

    with pytest.raises(MediaError, match="not in the allowed domains"):
        asyncio.run(resolve_allowed("other.net", 80, allowed_domains=("example.com",), resolver=never))


def test_unresolvable_host_is_a_clear_400():
    async def failing(host: str, port: int) -> list[str]:
        raise OSError("Name or service not known")

    with pytest.raises(MediaError, match="cannot be resolved"):
        asyncio.run(resolve_allowed("nowhere.example", 80, resolver=failing))
