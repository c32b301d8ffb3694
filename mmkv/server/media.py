"""Images named by URL in chat messages, fetched under the server's security rules.

* ``data:image/...;base64,...``: always allowed, decoded size capped.
* ``file://``: only when ``allowed_local_path`` is set, and only files whose resolved real path
  (symlinks followed) lies inside it.
* ``https://``: only for hosts listed in ``allowed_domains`` (none by default; plain http never).
  The host is resolved and every address must be global: private, loopback, link-local, shared,
  reserved and multicast addresses are refused. The connection goes to the address that was
  checked (the certificate is still verified for the host name), so a second DNS answer cannot
  redirect it; each redirect is checked the same way, up to ``max_redirects``.

Every load finishes within ``timeout`` seconds and reads at most ``max_bytes``; an image over
``max_pixels`` is refused from its header, before its pixels are decoded. Anything refused raises
``MediaError`` (a ``ValueError``) saying what was wrong and what is allowed.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import ipaddress
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Awaitable, Callable
from urllib.parse import unquote, urljoin, urlsplit
from urllib.request import url2pathname

import httpx
from PIL import Image, UnidentifiedImageError

Resolver = Callable[[str, int], Awaitable[list[str]]]  # (host, port) -> IP addresses
REDIRECTS = {301, 302, 303, 307, 308}


class MediaError(ValueError):
    """An image URL the server refuses or cannot load."""


@dataclass(slots=True)
class MediaPolicy:
    """What image URLs may name and how much they may cost."""

    allowed_local_path: Path | None = None
    allowed_domains: frozenset[str] = field(default_factory=frozenset)
    max_bytes: int = 10 * 2**20
    max_pixels: int = 4096 * 4096
    timeout: float = 5.0
    max_redirects: int = 3


async def system_resolver(host: str, port: int) -> list[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [info[4][0] for info in infos]


def is_public_address(address: str) -> bool:
    """Whether ``address`` is a global unicast address (an IPv4-mapped IPv6 address is judged by
    its IPv4 address)."""
    ip = ipaddress.ip_address(address.split("%")[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


class MediaLoader:
    """Turns an image URL into the image's bytes under a ``MediaPolicy``.

    Guarantees: no file outside ``allowed_local_path`` is opened, no connection is made to a host
    outside ``allowed_domains`` or to a non-global address, and no load reads more than
    ``max_bytes`` or runs past ``timeout``; refusals raise ``MediaError``.
    """

    def __init__(self, policy: MediaPolicy, resolver: Resolver = system_resolver,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.policy = policy
        self._resolver = resolver
        self._transport = transport  # None: a real TLS connection per hop

    async def load(self, url: str) -> bytes:
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme == "data":
            data = self._data_url(url)
        elif scheme == "file":
            data = await asyncio.to_thread(self._local_file, url)
        elif scheme in ("https", "http"):
            try:
                async with asyncio.timeout(self.policy.timeout):
                    data = await self._fetch(url)
            except TimeoutError:
                raise MediaError(f"image URL {_short(url)} did not load within "
                                 f"{self.policy.timeout:g} s") from None
        else:
            raise MediaError(f"image URL scheme {scheme!r} is not supported; allowed: data:, file:// "
                             f"(under --allowed-local-media-path), https:// (--allowed-media-domains)")
        self._check_pixels(data, url)
        return data

    def _data_url(self, url: str) -> bytes:
        header, sep, payload = url[5:].partition(",")
        if not sep or not header.startswith("image/") or not header.endswith(";base64"):
            raise MediaError("a data URL must look like data:image/<type>;base64,<data>")
        if len(payload) * 3 // 4 > self.policy.max_bytes:
            raise MediaError(f"data URL image is over the limit of {self.policy.max_bytes} bytes")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as err:
            raise MediaError(f"data URL is not valid base64: {err}") from None

    def _local_file(self, url: str) -> bytes:
        root = self.policy.allowed_local_path
        if root is None:
            raise MediaError("file:// image URLs are refused: the server has no "
                             "--allowed-local-media-path")
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise MediaError(f"file:// URL names host {parts.netloc!r}; only local files are allowed")
        real = os.path.realpath(url2pathname(unquote(parts.path)))
        allowed = os.path.realpath(root)
        if os.path.commonpath([real, allowed]) != allowed:
            raise MediaError(f"file {unquote(parts.path)!r} is outside the allowed media "
                             f"directory {str(root)!r}")
        if not os.path.isfile(real):
            raise MediaError(f"file {unquote(parts.path)!r} does not exist")
        if os.path.getsize(real) > self.policy.max_bytes:
            raise MediaError(f"file {unquote(parts.path)!r} is over the limit of "
                             f"{self.policy.max_bytes} bytes")
        return Path(real).read_bytes()

    async def _fetch(self, url: str) -> bytes:
        async with httpx.AsyncClient(transport=self._transport, follow_redirects=False,
                                     trust_env=False, timeout=self.policy.timeout) as client:
            for _ in range(self.policy.max_redirects + 1):
                host, port = self._check_remote(url)
                address = await self._public_address(host, port)
                parts = urlsplit(url)
                pinned = parts._replace(netloc=f"[{address}]:{port}" if ":" in address
                                        else f"{address}:{port}").geturl()
                request = client.build_request("GET", pinned, headers={"Host": parts.netloc},
                                               extensions={"sni_hostname": host})
                response = await client.send(request, stream=True)
                try:
                    if response.status_code in REDIRECTS and "location" in response.headers:
                        url = urljoin(url, response.headers["location"])
                        continue
                    if response.status_code != 200:
                        raise MediaError(f"image URL {_short(url)} answered HTTP {response.status_code}")
                    return await self._read_capped(response, url)
                finally:
                    await response.aclose()
        raise MediaError(f"image URL {_short(url)} redirected more than {self.policy.max_redirects} times")

    def _check_remote(self, url: str) -> tuple[str, int]:
        parts = urlsplit(url)
        if parts.scheme.lower() != "https":
            raise MediaError(f"image URL {_short(url)} is not https; remote images are fetched "
                             f"over https only")
        host = (parts.hostname or "").lower()
        if parts.username is not None or parts.password is not None:
            raise MediaError("image URLs with credentials are refused")
        if host not in self.policy.allowed_domains:
            allowed = ", ".join(sorted(self.policy.allowed_domains)) or "none (--allowed-media-domains)"
            raise MediaError(f"image host {host!r} is not allowed; allowed hosts: {allowed}")
        return host, parts.port or 443

    async def _public_address(self, host: str, port: int) -> str:
        try:
            addresses = await self._resolver(host, port)
        except OSError as err:
            raise MediaError(f"image host {host!r} does not resolve: {err}") from None
        refused = [a for a in addresses if not is_public_address(a)]
        if refused or not addresses:
            raise MediaError(f"image host {host!r} resolves to a non-public address "
                             f"({', '.join(refused) or 'none'}); refused")
        return addresses[0]

    async def _read_capped(self, response: httpx.Response, url: str) -> bytes:
        limit = self.policy.max_bytes
        declared = response.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise MediaError(f"image URL {_short(url)} is over the limit of {limit} bytes")
        data = bytearray()
        async for chunk in response.aiter_bytes():
            data += chunk
            if len(data) > limit:
                raise MediaError(f"image URL {_short(url)} is over the limit of {limit} bytes")
        return bytes(data)

    def _check_pixels(self, data: bytes, url: str) -> None:
        try:
            with Image.open(io.BytesIO(data)) as image:
                width, height = image.size
        except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as err:
            raise MediaError(f"image URL {_short(url)} is not a readable image: {err}") from None
        if width * height > self.policy.max_pixels:
            raise MediaError(f"image URL {_short(url)} has {width}x{height} pixels, over the limit "
                             f"of {self.policy.max_pixels}")


def _short(url: str) -> str:
    return repr(url if len(url) <= 80 else url[:77] + "...")
