"""Fetching media: data: URLs, one local folder, and http served on 127.0.0.1 (the only host contacted)."""

import asyncio
import base64
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from m3stack.gateway.multimodal import MediaError, MediaLimits
from m3stack.gateway.multimodal.fetch import MediaFetcher, decode_data_url, read_local

BODY = bytes(range(256)) * 64  # 16 KiB


class _Handler(BaseHTTPRequestHandler):
    hosts: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        type(self).hosts.append(self.headers.get("Host", ""))
        routes = {
            "/media.bin": lambda: self._send(200, BODY),
            "/hop": lambda: self._redirect("/media.bin"),
            "/loop": lambda: self._redirect("/loop"),
            "/to-other-host": lambda: self._redirect(f"http://localhost:{self.server.server_port}/media.bin"),
            "/to-file": lambda: self._redirect("file:///etc/passwd"),
            "/declared-too-big": lambda: self._send(200, b"x" * 10, length=10**9),
            "/streamed-too-big": self._stream_forever,
            "/slow": self._slow,
        }
        routes.get(self.path, lambda: self._send(404, b"not here"))()

    def _send(self, status: int, body: bytes, length: int | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body) if length is None else length))
        self.end_headers()
        self.wfile.write(body)

    def _redirect(self, location: str) -> None:
        self.send_response(302)
        self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _stream_forever(self) -> None:
        self.send_response(200)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            for _ in range(1000):  # bounded: 64 MiB at most if nobody hangs up
                self.wfile.write(b"10000\r\n" + b"y" * 0x10000 + b"\r\n")
        except OSError:
            pass  # the client hung up at its cap, as it should

    def _slow(self) -> None:
        time.sleep(10)
        self._send(200, b"late")

    def log_message(self, *args) -> None:
        pass


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False  # the slow handler may still sleep when the module's tests end

    def handle_error(self, request, client_address) -> None:
        pass  # clients hanging up mid-response (timeouts, caps) are what these tests provoke


@pytest.fixture(scope="module")
def server():
    httpd = _QuietServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_port}"
    httpd.shutdown()
    httpd.server_close()


def _fetch(url: str, max_bytes: int = 1 << 20, resolver=None, **limits) -> bytes:
    async def run() -> bytes:
        settings = {"allow_private_networks": True, "allowed_domains": ("127.0.0.1",), **limits}
        fetcher = MediaFetcher(MediaLimits(**settings), **({"resolver": resolver} if resolver else {}))
        try:
            return await fetcher.fetch(url, max_bytes)
        finally:
            await fetcher.close()

    return asyncio.run(run())


def test_http_fetch_and_redirects(server):
    assert _fetch(f"{server}/media.bin") == BODY
    assert _fetch(f"{server}/hop") == BODY


def test_connection_goes_to_the_checked_address_with_the_original_host_header(server):
    """The host name is resolved once by the guard; the socket goes to that address, Host stays the name."""
    port = server.rsplit(":", 1)[1]

    async def resolver(host: str, port: int) -> list[str]:
        assert host == "media.test"
        return ["127.0.0.1"]

    _Handler.hosts.clear()
    body = _fetch(f"http://media.test:{port}/media.bin", resolver=resolver, allowed_domains=("media.test",))
    assert body == BODY and _Handler.hosts == [f"media.test:{port}"]


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("/loop", "more than 3 redirects"),
        ("/to-other-host", "'localhost' is not in the allowed domains"),
        ("/to-file", "unsupported URL"),
        ("/missing", "returned HTTP 404"),
        ("/declared-too-big", "over the limit"),
        ("/streamed-too-big", "larger than the limit"),
    ],
)
def test_http_refusals_are_400s(server, path, message):
    with pytest.raises(MediaError, match=message) as error:
        _fetch(f"{server}{path}")
    assert error.value.status == 400


def test_loopback_is_refused_unless_allowed(server):
    with pytest.raises(MediaError, match="non-public address"):
        _fetch(f"{server}/media.bin", allow_private_networks=False)


def test_fetch_timeout(server):
    started = time.monotonic()
    with pytest.raises(MediaError, match=r"took longer than 0\.5s"):
        _fetch(f"{server}/slow", fetch_timeout_s=0.5)
    assert time.monotonic() - started < 8  # the server would answer after 10 s


def test_data_urls():
    payload = bytes(range(100))
    assert decode_data_url("data:image/png;base64," + base64.b64encode(payload).decode(), 1000) == payload
    assert decode_data_url("data:text/plain,a%20b", 1000) == b"a b"
    with pytest.raises(MediaError, match="not valid base64"):
        decode_data_url("data:image/png;base64,***", 1000)
    with pytest.raises(MediaError, match="more than the limit"):
        decode_data_url("data:image/png;base64," + base64.b64encode(bytes(5000)).decode(), 1000)
    with pytest.raises(MediaError, match="needs a comma"):
        decode_data_url("data:image/png;base64", 1000)


def test_unsupported_scheme():
    with pytest.raises(MediaError, match="scheme 'ftp'"):
        _fetch("ftp://127.0.0.1/x")


def test_local_files_only_under_the_allowed_folder(tmp_path):
    folder = tmp_path / "media"
    folder.mkdir()
    (folder / "a.bin").write_bytes(b"inside")
    (tmp_path / "secret.bin").write_bytes(b"outside")
    (folder / "link.bin").symlink_to(tmp_path / "secret.bin")
    assert read_local(f"file://{folder}/a.bin", str(folder), 100) == b"inside"
    with pytest.raises(MediaError, match="outside the allowed folder"):
        read_local(f"file://{tmp_path}/secret.bin", str(folder), 100)
    with pytest.raises(MediaError, match="outside the allowed folder"):
        read_local(f"file://{folder}/link.bin", str(folder), 100)
    with pytest.raises(MediaError, match="outside the allowed folder"):
        read_local(f"file://{folder}/../secret.bin", str(folder), 100)
    with pytest.raises(MediaError, match="disabled"):
        read_local(f"file://{folder}/a.bin", None, 100)
    with pytest.raises(MediaError, match="over the limit"):
        read_local(f"file://{folder}/a.bin", str(folder), 3)
