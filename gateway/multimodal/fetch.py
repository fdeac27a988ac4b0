"""Media bytes from ``data:`` URLs, http(s) URLs (SSRF-guarded) and, when enabled, one local folder.

HTTP fetches resolve the host through :mod:`address_guard`, connect to the checked address itself
(``Host`` header and TLS SNI/certificate name stay the URL's host), follow redirects by hand with
the same checks on every hop, refuse a ``Content-Length`` over the cap and stop reading as soon as
the body passes it, all under one overall timeout.  Proxies from the environment are ignored.
"""

import asyncio
import base64
import binascii
import os
from pathlib import Path
from urllib.parse import unquote_to_bytes, urljoin, urlsplit

import httpx

from .address_guard import IPAddress, Resolver, resolve_allowed, system_resolver
from .errors import MediaError
from .limits import MediaLimits

REDIRECT_STATUSES = {301, 302, 303, 307, 308}
CHUNK = 1 << 16


class MediaFetcher:
    """Owns one HTTP client (connection reuse across requests); ``close`` it on shutdown."""

    def __init__(self, limits: MediaLimits, resolver: Resolver = system_resolver) -> None:
        self.limits = limits
        self.resolver = resolver
        self.client = httpx.AsyncClient(
            trust_env=False,
            follow_redirects=False,
            timeout=httpx.Timeout(limits.fetch_timeout_s, connect=limits.connect_timeout_s),
            headers={"User-Agent": "m3stack-gateway"},
        )

    async def close(self) -> None:
        await self.client.aclose()

    async def fetch(self, url: str, max_bytes: int) -> bytes:
        scheme = urlsplit(url).scheme.lower()
        if scheme == "data":
            return decode_data_url(url, max_bytes)
        if scheme in ("http", "https"):
            try:
                async with asyncio.timeout(self.limits.fetch_timeout_s):
                    return await self._fetch_http(url, max_bytes)
            except TimeoutError:
                raise MediaError(
                    f"fetching {_shown(url)} took longer than {self.limits.fetch_timeout_s:g}s", "media_fetch_failed"
                ) from None
        if scheme in ("file", ""):
            return read_local(url, self.limits.local_media_dir, max_bytes)
        raise MediaError(f"media URLs with scheme {scheme!r} are not supported", "unsupported_media")

    async def _fetch_http(self, url: str, max_bytes: int) -> bytes:
        for _ in range(self.limits.max_redirects + 1):
            parts = urlsplit(url)
            if parts.scheme.lower() not in ("http", "https"):
                raise MediaError(f"a media redirect went to an unsupported URL ({_shown(url)})", "media_fetch_failed")
            port = parts.port or (443 if parts.scheme.lower() == "https" else 80)
            host = parts.hostname or ""
            addresses = await resolve_allowed(
                host,
                port,
                allowed_domains=self.limits.allowed_domains,
                allow_private=self.limits.allow_private_networks,
                resolver=self.resolver,
            )
            response = await self._connect(url, host, addresses)
            try:
                if response.status_code in REDIRECT_STATUSES and "location" in response.headers:
                    url = urljoin(url, response.headers["location"])
                    continue
                if response.status_code != 200:
                    raise MediaError(
                        f"fetching {_shown(url)} returned HTTP {response.status_code}", "media_fetch_failed"
                    )
                return await _read_capped(response, max_bytes, url)
            finally:
                await response.aclose()
        raise MediaError(
            f"fetching {_shown(url)} took more than {self.limits.max_redirects} redirects", "media_fetch_failed"
        )

    async def _connect(self, url: str, host: str, addresses: list[IPAddress]) -> httpx.Response:
        """GET ``url`` from the first checked address that accepts a connection."""
        for position, address in enumerate(addresses):
            request = self._pinned_request(url, host, str(address))
            try:
                return await self.client.send(request, stream=True)
            except httpx.ConnectError:
                if position + 1 < len(addresses):
                    continue
                raise MediaError(f"cannot connect to the host of {_shown(url)}", "media_fetch_failed") from None
            except httpx.HTTPError as exc:
                raise MediaError(
                    f"fetching {_shown(url)} failed ({exc.__class__.__name__})", "media_fetch_failed"
                ) from None
        raise MediaError(f"media host {host!r} has no addresses", "media_fetch_failed")

    def _pinned_request(self, url: str, host: str, address: str) -> httpx.Request:
        original = httpx.URL(url)
        pinned = original.copy_with(host=address)
        headers = {"Host": original.netloc.decode("ascii")}
        extensions = {"sni_hostname": host} if original.scheme == "https" else {}
        return self.client.build_request("GET", pinned, headers=headers, extensions=extensions)


async def _read_capped(response: httpx.Response, max_bytes: int, url: str) -> bytes:
    declared = response.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise MediaError(f"{_shown(url)} is {int(declared)} bytes, over the limit of {max_bytes}", "media_too_large")
    body = bytearray()
    try:
        async for chunk in response.aiter_bytes(CHUNK):
            body += chunk
            if len(body) > max_bytes:
                raise MediaError(f"{_shown(url)} is larger than the limit of {max_bytes} bytes", "media_too_large")
    except httpx.HTTPError as exc:
        raise MediaError(f"reading {_shown(url)} failed ({exc.__class__.__name__})", "media_fetch_failed") from None
    return bytes(body)


def decode_data_url(url: str, max_bytes: int) -> bytes:
    """``data:[<media type>][;base64],<data>``; the size is checked before decoding."""
    header, comma, payload = url.partition(",")
    if not comma:
        raise MediaError("a data: URL needs a comma before its payload")
    if header.lower().endswith(";base64"):
        compact = "".join(payload.split())
        if len(compact) // 4 * 3 > max_bytes + 2:
            raise MediaError(f"the data: URL decodes to more than the limit of {max_bytes} bytes", "media_too_large")
        try:
            data = base64.b64decode(compact, validate=True)
        except (binascii.Error, ValueError):
            raise MediaError("the data: URL is not valid base64") from None
    else:
        data = unquote_to_bytes(payload)
    if len(data) > max_bytes:
        raise MediaError(f"the data: URL decodes to more than the limit of {max_bytes} bytes", "media_too_large")
    if not data:
        raise MediaError("the data: URL is empty")
    return data


def read_local(url: str, folder: str | None, max_bytes: int) -> bytes:
    """A file under ``folder`` only (symlinks resolved before the check)."""
    if folder is None:
        raise MediaError("local media files are disabled on this server", "unsupported_media")
    parts = urlsplit(url)
    if parts.scheme and parts.netloc not in ("", "localhost"):
        raise MediaError("file:// URLs must not name a host", "unsupported_media")
    path = Path(os.path.realpath(unquote_to_bytes(parts.path if parts.scheme else url).decode("utf-8", "replace")))
    root = Path(os.path.realpath(folder))
    if not path.is_relative_to(root):
        raise MediaError("the media file is outside the allowed folder", "unsupported_media")
    try:
        size = path.stat().st_size
        if size > max_bytes:
            raise MediaError(f"the media file is {size} bytes, over the limit of {max_bytes}", "media_too_large")
        return path.read_bytes()
    except OSError as exc:
        raise MediaError(f"the media file cannot be read ({exc.strerror})") from None


def _shown(url: str) -> str:
    """The URL for error messages: no query string (it may hold credentials), at most 200 characters."""
    parts = urlsplit(url)
    shown = f"{parts.scheme}://{parts.netloc}{parts.path}"
    return shown if len(shown) <= 200 else shown[:197] + "..."
