"""An image's bytes from its URL: a `data:` URL decoded, an `http(s)` URL fetched under the router's rules.

The rules of a fetch (`FetchPolicy`): fetching can be turned off; the body is refused as soon as it passes the
byte limit (by its Content-Length, or while it streams); the whole fetch, redirects included, has one deadline;
redirects are followed by hand, each target resolved once and connected to at the address that was checked
(no second lookup a DNS answer could change), and a redirect to an address that is not public (loopback,
private, link-local, reserved...) is refused. The URL the client gave may name any address: that one is the
operator's to allow or not (`enabled`), while a redirect is a third party's choice.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import http.client
import ipaddress
import socket
import time
import urllib.parse
from dataclasses import dataclass

from kettle.router.errors import ValidationError

_CHUNK = 64 * 1024
_REDIRECTS = {301, 302, 303, 307, 308}


@dataclass(frozen=True)
class FetchPolicy:
    enabled: bool = True  # False: only data: URLs are read
    max_bytes: int = 20 * 1024 * 1024
    timeout_s: float = 10.0
    max_redirects: int = 5


async def read_image_bytes(url: str, policy: FetchPolicy, index: int = 0) -> bytes:
    """The bytes at `url` (the `index`th image of the request, for messages); 422 for what the rules refuse."""
    if url.startswith("data:"):
        return decode_data_url(url, policy.max_bytes, index)
    scheme = urllib.parse.urlsplit(url).scheme.lower()
    if scheme not in ("http", "https"):
        raise ValidationError(f"image {index}: only data:, http: and https: URLs are read. Given: {url[:64]!r}")
    if not policy.enabled:
        raise ValidationError(f"image {index}: this server does not fetch image URLs; send the image as a data: URL")
    return await asyncio.to_thread(_fetch, url, policy, index)


def decode_data_url(url: str, max_bytes: int, index: int = 0) -> bytes:
    """The bytes of a `data:[<media type>][;base64],<data>` URL, refused past `max_bytes` before decoding."""
    header, comma, data = url[5:].partition(",")
    if not comma:
        raise ValidationError(f"image {index}: a data: URL needs a comma before its data")
    if header.endswith(";base64"):
        if len(data) // 4 * 3 > max_bytes + 2:
            raise _too_large(index, len(data) // 4 * 3, max_bytes)
        try:
            raw = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise ValidationError(f"image {index}: the data: URL's base64 data does not decode") from None
    else:
        raw = urllib.parse.unquote_to_bytes(data)
    if len(raw) > max_bytes:
        raise _too_large(index, len(raw), max_bytes)
    return raw


def _too_large(index: int, size: int, max_bytes: int, given: str = "") -> ValidationError:
    return ValidationError(f"image {index} is larger than the limit of {max_bytes} bytes. Given: {given}{size} bytes")


def is_public(address: str) -> bool:
    """Whether an IP address is a public, routable one (not loopback, private, link-local, reserved...)."""
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


def _fetch(url: str, policy: FetchPolicy, index: int) -> bytes:
    deadline = time.monotonic() + policy.timeout_s
    try:
        for hop in range(policy.max_redirects + 1):
            status, location, body = _get(url, policy, index, deadline, redirected=hop > 0)
            if status in _REDIRECTS and location:
                url = urllib.parse.urljoin(url, location)
                if urllib.parse.urlsplit(url).scheme.lower() not in ("http", "https"):
                    raise ValidationError(f"image {index}: a redirect to a URL that is not http(s) is not followed")
                continue
            if status != 200:
                raise ValidationError(f"image {index}: fetching {_shown(url)} answered HTTP {status}")
            return body
        raise ValidationError(
            f"image {index}: fetching {_shown(url)} redirected more than {policy.max_redirects} times"
        )
    except TimeoutError:
        raise ValidationError(f"image {index}: fetching it took longer than {policy.timeout_s:g} s") from None
    except OSError as error:
        raise ValidationError(f"image {index}: fetching {_shown(url)} failed: {error.strerror or error}") from None


def _get(url: str, policy: FetchPolicy, index: int, deadline: float, redirected: bool) -> tuple[int, str, bytes]:
    """One GET: (status, Location, body), the body read only for a 200."""
    parts = urllib.parse.urlsplit(url)
    host, https = parts.hostname or "", parts.scheme.lower() == "https"
    port = parts.port or (443 if https else 80)
    address = _resolve(host, port, _left(deadline))
    if redirected and not is_public(address):
        raise ValidationError(f"image {index}: a redirect to {host} ({address}) is refused: not a public address")
    kind = http.client.HTTPSConnection if https else http.client.HTTPConnection
    connection = kind(host, port, timeout=_left(deadline))
    # Connect to the address checked above, not to a second lookup of the name.
    connection._create_connection = lambda _addr, timeout, source=None: socket.create_connection(  # type: ignore[attr-defined]
        (address, port), timeout, source
    )
    try:
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        connection.request("GET", path, headers={"User-Agent": "kettle", "Accept": "image/*"})
        sock = connection.sock  # the response may take it over (and the connection forget it)
        response = connection.getresponse()
        if response.status != 200:
            return response.status, response.getheader("Location") or "", b""
        length = response.getheader("Content-Length")
        if length and length.isdigit() and int(length) > policy.max_bytes:
            raise _too_large(index, int(length), policy.max_bytes)
        chunks, size = [], 0
        while True:
            sock.settimeout(_left(deadline))
            chunk = response.read1(_CHUNK) if hasattr(response, "read1") else response.read(_CHUNK)
            if not chunk:
                return 200, "", b"".join(chunks)
            size += len(chunk)
            if size > policy.max_bytes:  # the body goes on past it: only a lower bound is known
                raise _too_large(index, size, policy.max_bytes, "at least ")
            chunks.append(chunk)
    finally:
        connection.close()


def _resolve(host: str, port: int, timeout: float) -> str:
    """The first address of `host` (an IP address is itself)."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    del timeout  # getaddrinfo has no timeout of its own; the fetch's deadline covers the connection after it
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return str(infos[0][4][0])


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    return left


def _shown(url: str) -> str:
    return url if len(url) <= 80 else url[:77] + "..."
