"""A media item's encoded bytes from a `data:` URL, a local file (policy-checked) or an http(s) URL (fetched
with size, time and redirect limits, only from public addresses unless the policy allows private ones)."""

from __future__ import annotations

import base64
import binascii
import http.client
import ipaddress
import os
import socket
import stat
import time
from urllib.parse import unquote, unquote_to_bytes, urljoin, urlsplit

from omnistage.media.policy import MediaError, MediaPolicy

_REDIRECTS = (301, 302, 303, 307, 308)
_CHUNK = 1 << 16


def load_bytes(source: str, policy: MediaPolicy) -> bytes:
    """`data:`, `http(s)://`, `file://` or a plain path -> the bytes it holds."""
    if source.startswith("data:"):
        return data_url_bytes(source, policy.max_bytes)
    scheme = urlsplit(source).scheme.lower()
    if scheme in ("http", "https"):
        return fetch_url(source, policy)
    if scheme == "file":
        parts = urlsplit(source)
        if parts.netloc not in ("", "localhost"):
            raise MediaError("file:// URLs must name a local path (no host)")
        return read_local(unquote(parts.path), policy)
    if scheme:
        raise MediaError(f"unsupported URL scheme {scheme!r} (use data:, http(s)://, file:// or a local path)")
    return read_local(source, policy)


def data_url_bytes(url: str, max_bytes: int) -> bytes:
    """`data:[<type>][;base64],<payload>`."""
    head, sep, payload = url.partition(",")
    if not sep:
        raise MediaError("malformed data: URL (no comma)")
    if head.endswith(";base64"):
        return b64decode(payload, max_bytes)
    data = unquote_to_bytes(payload)
    _check_size(len(data), max_bytes)
    return data


def b64decode(payload: str, max_bytes: int) -> bytes:
    """Strict base64 (line breaks and spaces, as MIME encoders write them, are dropped first)."""
    _check_size(len(payload) // 4 * 3, max_bytes)
    try:
        return base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError):
        raise MediaError("invalid base64 data") from None


def read_local(path: str, policy: MediaPolicy) -> bytes:
    if policy.allowed_local_dir is None:
        raise MediaError("local files are not allowed (the server has no --allowed-local-media-path)")
    root = os.path.realpath(policy.allowed_local_dir)
    real = os.path.realpath(os.path.join(root, path))  # an absolute `path` replaces root
    if os.path.commonpath([root, real]) != root:
        raise MediaError("local file is outside --allowed-local-media-path")
    try:
        # NOTE: O_NOFOLLOW: a symlink swapped in since realpath is refused; O_NONBLOCK: a FIFO cannot hang us.
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        raise MediaError("local file not found") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise MediaError("local file not found")
        _check_size(info.st_size, policy.max_bytes)
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read()
    finally:
        os.close(fd)


def fetch_url(url: str, policy: MediaPolicy) -> bytes:
    """GET `url`, following at most `max_redirects` redirects, each hop's host checked before connecting."""
    deadline = time.monotonic() + policy.fetch_timeout_s
    for _ in range(policy.max_redirects + 1):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https"):
            raise MediaError("URL redirected to a scheme other than http(s)")
        conn = _connection(parts.scheme, parts.hostname or "", _port(parts), policy, deadline)
        try:
            conn.request("GET", (parts.path or "/") + (f"?{parts.query}" if parts.query else ""),
                         headers={"User-Agent": "omnistage", "Accept-Encoding": "identity"})
            sock, resp = conn.sock, conn.getresponse()  # (getresponse may hand the socket to resp)
            if resp.status in _REDIRECTS and resp.getheader("Location"):
                url = urljoin(url, resp.getheader("Location"))
                continue
            if resp.status != 200:
                raise MediaError(f"URL answered HTTP {resp.status}")
            return _read_limited(sock, resp, policy.max_bytes, deadline)
        except http.client.InvalidURL:
            raise MediaError("URL is not valid") from None
        except (OSError, http.client.HTTPException) as e:
            reason = "timed out" if isinstance(e, TimeoutError) else "connection failed"
            raise MediaError(f"cannot fetch URL ({reason})") from None
        finally:
            conn.close()
    raise MediaError(f"URL redirected more than {policy.max_redirects} times")


def _port(parts) -> int:
    try:
        return parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise MediaError("URL has an invalid port") from None


def _connection(scheme: str, host: str, port: int, policy: MediaPolicy,
                deadline: float) -> http.client.HTTPConnection:
    ip = resolve_host(host, port, policy)
    timeout = max(deadline - time.monotonic(), 0.001)
    cls = http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection
    conn = cls(host, port, timeout=timeout)
    # NOTE: connect to the address that was checked, not to a second DNS answer (rebinding); TLS still
    # verifies `host` (server_hostname). http.client calls this hook from connect().
    conn._create_connection = lambda addr, t, src: socket.create_connection((ip, addr[1]), t, src)
    return conn


def resolve_host(host: str, port: int, policy: MediaPolicy) -> str:
    """The address to connect to; every address `host` resolves to must be public unless the policy says."""
    if not host:
        raise MediaError("URL has no host")
    if policy.allowed_domains is not None and host.lower() not in {d.lower() for d in policy.allowed_domains}:
        raise MediaError("URL host is not in --allowed-media-domains")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        raise MediaError("cannot resolve the URL's host") from None
    addrs = [info[4][0] for info in infos]
    if not policy.allow_private_urls and not all(map(is_public, addrs)):
        raise MediaError("URL host resolves to a private, loopback or link-local address "
                         "(allowed only with --allow-private-media-urls)")
    return addrs[0]


def is_public(addr: str) -> bool:
    ip = ipaddress.ip_address(addr.split("%", 1)[0])
    if ip.version == 6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


def _read_limited(sock: socket.socket, resp: http.client.HTTPResponse, max_bytes: int,
                  deadline: float) -> bytes:
    length = resp.getheader("Content-Length")
    if length is not None and length.isdigit():
        _check_size(int(length), max_bytes)
    chunks, size = [], 0
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        sock.settimeout(left)
        # NOTE: read1, not read: read(n) waits for all n bytes, so a slow sender would outlast the deadline.
        chunk = resp.read1(_CHUNK)
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        _check_size(size, max_bytes)
        chunks.append(chunk)


def _check_size(size: int, max_bytes: int) -> None:
    if size > max_bytes:
        raise MediaError(f"media item is larger than {max_bytes} bytes")
