"""http(s) media fetched under the policy, against a local http server: size, redirect and time limits,
private-address refusal (also after a redirect and for every address a host resolves to), pinned DNS."""

from __future__ import annotations

import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
from media_samples import wav_bytes

from omnistage.media import MediaError, MediaPolicy, decode_audio_bytes, fetch, to_conversation

WAV = wav_bytes(0.5)


class Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        path, _, arg = self.path.partition("?")
        if path == "/tone.wav":
            self._send(200, WAV)
        elif path == "/chunked":  # no Content-Length: the size limit counts what arrives
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for _ in range(4):
                self.wfile.write(b"4000\r\n" + b"x" * 0x4000 + b"\r\n")
            self.wfile.write(b"0\r\n\r\n")
        elif path.startswith("/hop/"):  # /hop/N redirects N times, then to /tone.wav
            n = int(path.rsplit("/", 1)[1])
            self._redirect(f"/hop/{n - 1}" if n > 1 else "/tone.wav")
        elif path == "/to":
            self._redirect(arg)
        elif path == "/slow":
            time.sleep(2)
            self._send(200, WAV)
        else:
            self._send(404, b"no")

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _redirect(self, location: str) -> None:
        self.send_response(302)
        self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def base():
    server = ThreadingHTTPServer(("0.0.0.0", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


LOOPBACK = MediaPolicy(allow_private_urls=True)


def audio(url: str, policy: MediaPolicy) -> np.ndarray:
    return to_conversation([{"role": "user", "content": [{"type": "audio_url", "audio_url": {"url": url}}]}],
                           policy).audios[0]


def refused(url: str, policy: MediaPolicy, needle: str) -> str:
    with pytest.raises(MediaError, match=r"^messages\[0\]\.content\[0\] \(audio_url\): ") as e:
        audio(url, policy)
    assert needle in str(e.value) and "127.0.0.1" not in str(e.value) and "/hop" not in str(e.value), e.value
    return str(e.value)


def test_fetch_allowed_with_the_flag(base):
    np.testing.assert_array_equal(audio(base + "/tone.wav", LOOPBACK), decode_audio_bytes(WAV))
    assert audio(base + "/hop/3", LOOPBACK).size == 8000
    refused(base + "/tone.wav", MediaPolicy(), "private, loopback or link-local address")


def test_limits(base):
    refused(base + "/tone.wav", MediaPolicy(allow_private_urls=True, max_bytes=len(WAV) - 1), "larger than")
    refused(base + "/chunked", MediaPolicy(allow_private_urls=True, max_bytes=0x4000 * 3), "larger than")
    refused(base + "/hop/4", LOOPBACK, "redirected more than 3 times")
    start = time.monotonic()
    refused(base + "/slow", MediaPolicy(allow_private_urls=True, fetch_timeout_s=0.3), "timed out")
    assert time.monotonic() - start < 1.5
    refused(base + "/missing", LOOPBACK, "URL answered HTTP 404")
    refused("http://127.0.0.1:1/x.wav", LOOPBACK, "cannot fetch URL (connection failed)")
    refused(base.replace("http:", "https:") + "/tone.wav", LOOPBACK, "connection failed")  # no TLS there
    refused("http://no-such-host.invalid/x.wav", LOOPBACK, "cannot resolve the URL's host")
    refused("http://127.0.0.1:99999/x.wav", LOOPBACK, "invalid port")
    refused(base + "/a b\u00e9.wav", LOOPBACK, "URL is not valid")


def test_every_hop_is_checked(base, monkeypatch):
    port = base.rsplit(":", 1)[1]
    monkeypatch.setattr(fetch, "is_public", lambda addr: addr == "127.0.0.1")  # 127.0.0.1 plays a public host
    assert audio(base + "/tone.wav", MediaPolicy()).size == 8000
    refused(f"{base}/to?http://127.0.0.2:{port}/tone.wav", MediaPolicy(), "private")
    refused(f"{base}/to?file:///etc/passwd", MediaPolicy(), "redirected to a scheme other than http(s)")
    domains = MediaPolicy(allowed_domains=("127.0.0.1",))
    assert audio(base + "/hop/1", domains).size == 8000
    refused(f"{base}/to?http://localhost:{port}/tone.wav", domains, "not in --allowed-media-domains")


def test_every_address_checked_and_pinned(base, monkeypatch):
    port = int(base.rsplit(":", 1)[1])
    answers = {"media.test": ["127.0.0.1"], "mixed.test": ["127.0.0.1", "10.1.2.3"]}
    real = socket.getaddrinfo

    def getaddrinfo(host, *args, **kw):
        if host in answers:
            found = [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port)) for a in answers[host]]
            answers[host] = ["127.0.0.1:1"]  # a second lookup (rebinding) would get nothing to connect to
            return found
        return real(host, *args, **kw)

    monkeypatch.setattr(fetch.socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(fetch, "is_public", lambda addr: addr == "127.0.0.1")
    assert audio(f"http://media.test:{port}/tone.wav", MediaPolicy()).size == 8000  # connects to the checked answer
    refused(f"http://mixed.test:{port}/tone.wav", MediaPolicy(), "private")


@pytest.mark.parametrize("addr, public", [
    ("8.8.8.8", True), ("2606:4700::1111", True), ("127.0.0.1", False), ("10.0.0.1", False),
    ("192.168.1.1", False), ("172.16.0.1", False), ("169.254.169.254", False), ("100.64.0.1", False),
    ("0.0.0.0", False), ("::1", False), ("fe80::1%eth0", False), ("fc00::1", False), ("::ffff:127.0.0.1", False),
    ("::ffff:8.8.8.8", True), ("224.0.0.1", False)])
def test_is_public(addr, public):
    assert fetch.is_public(addr) is public
