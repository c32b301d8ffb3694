"""Images named by URL in chat messages, fetched under the server's security rules.

* ``data:image/...;base64,...``: always allowed, decoded size capped.
* ``file://``: only when ``allowed_local_path`` is set, and only regular files whose resolved real
  path (symlinks followed) lies inside it.
* ``https://``: only for hosts listed in ``allowed_domains`` (none by default; plain http never,
  nor URLs with credentials). The host is resolved and every address it resolves to must be plain
  global unicast: ``BLOCKED_NETWORKS`` names each refused class (this-network, private-use,
  shared, loopback, link-local, IETF protocol assignments, documentation, benchmarking,
  multicast, reserved and broadcast IPv4; unspecified, loopback, IPv4-mapped, IPv4-compatible,
  NAT64, discard-only, Teredo, ORCHID, 6to4, unique-local, site-local, link-local, multicast
  IPv6 and all IPv6 outside 2000::/3), and an address ``ipaddress`` does not call global is
  refused too. IPv4-mapped and 6to4 addresses are refused whatever IPv4 address they carry: a
  public fetch never needs them. The connection goes to the address that was checked (SNI, the
  Host header and the certificate check use the host name), so a second DNS answer cannot
  redirect it; each redirect is checked the same way, on a new connection, up to
  ``max_redirects``.

Only PNG, JPEG, WebP, GIF and BMP images are accepted (``vision.images.ACCEPTED_FORMATS``; PIL's
other decoders never see the bytes), and an image over ``max_pixels`` is refused from its header,
before its pixels are decoded. Every load, whatever its scheme, finishes within ``timeout`` seconds
from its start to the end of the pixel check, and reads at most ``max_bytes``; file reads and
decoding run off the event loop. Anything refused raises ``MediaError`` (a ``ValueError``) saying
what was wrong and what is allowed, in words: no Python repr.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import ipaddress
import os
import socket
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Awaitable, Callable
from urllib.parse import unquote, urljoin, urlsplit
from urllib.request import url2pathname

import httpx
from PIL import Image, UnidentifiedImageError

from vision.images import ACCEPTED_FORMATS, ACCEPTED_FORMATS_TEXT

Resolver = Callable[[str, int], Awaitable[list[str]]]  # (host, port) -> IP addresses
AddressCheck = Callable[[str], "str | None"]  # IP address -> why it is refused, None if it is not
REDIRECTS = {301, 302, 303, 307, 308}

_GLOBAL_UNICAST = "outside global unicast 2000::/3"
# Refused address blocks, searched in order (the first match names the class). IPv4-mapped and
# 6to4 blocks are refused whole: their embedded IPv4 address is not judged.
BLOCKED_NETWORKS: tuple[tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, str], ...] = tuple(
    (ipaddress.ip_network(network), reason) for network, reason in (
        ("0.0.0.0/8", "this-network"),
        ("10.0.0.0/8", "private-use"),
        ("100.64.0.0/10", "shared address space"),
        ("127.0.0.0/8", "loopback"),
        ("169.254.0.0/16", "link-local"),
        ("172.16.0.0/12", "private-use"),
        ("192.0.0.0/24", "IETF protocol assignments"),
        ("192.0.2.0/24", "documentation"),
        ("192.88.99.0/24", "6to4 relay anycast"),
        ("192.168.0.0/16", "private-use"),
        ("198.18.0.0/15", "benchmarking"),
        ("198.51.100.0/24", "documentation"),
        ("203.0.113.0/24", "documentation"),
        ("224.0.0.0/4", "multicast"),
        ("255.255.255.255/32", "limited broadcast"),
        ("240.0.0.0/4", "reserved"),
        ("::/128", "unspecified"),
        ("::1/128", "loopback"),
        ("::ffff:0:0/96", "IPv4-mapped"),
        ("::/96", "IPv4-compatible"),
        ("64:ff9b::/96", "NAT64"),
        ("64:ff9b:1::/48", "local-use NAT64"),
        ("100::/64", "discard-only"),
        ("2001::/32", "Teredo"),
        ("2001:2::/48", "benchmarking"),
        ("2001:10::/28", "ORCHID"),
        ("2001:20::/28", "ORCHIDv2"),
        ("2001::/23", "IETF protocol assignments"),
        ("2001:db8::/32", "documentation"),
        ("2002::/16", "6to4"),
        ("3fff::/20", "documentation"),
        ("fc00::/7", "unique-local"),
        ("fe80::/10", "link-local"),
        ("fec0::/10", "site-local"),
        ("ff00::/8", "multicast"),
        ("::/3", _GLOBAL_UNICAST),
        ("4000::/2", _GLOBAL_UNICAST),
        ("8000::/1", _GLOBAL_UNICAST),
    ))


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


def address_refusal(address: str) -> str | None:
    """Why ``address`` may not be fetched from (its class in ``BLOCKED_NETWORKS`` and the block),
    or None when it is plain global unicast."""
    try:
        ip = ipaddress.ip_address(address.split("%")[0])
    except ValueError:
        return "not an IP address"
    for network, reason in BLOCKED_NETWORKS:
        if ip in network:
            return f"{reason} ({network})"
    if not ip.is_global:  # a block the table lacks but the IANA registry of this Python names
        return "not global (IANA special-purpose address registry)"
    return None


def is_public_address(address: str) -> bool:
    """Whether ``address`` is plain global unicast (``address_refusal`` finds nothing)."""
    return address_refusal(address) is None


class MediaLoader:
    """Turns an image URL into the image's bytes under a ``MediaPolicy``.

    Guarantees: no file outside ``allowed_local_path`` is opened, no connection is made to a host
    outside ``allowed_domains`` or to an address ``refuse_address`` refuses, no load reads more
    than ``max_bytes`` or runs past ``timeout``, and only accepted image formats are decoded;
    refusals raise ``MediaError``.

    ``resolver``, ``refuse_address``, ``verify`` and ``transport`` exist for tests: ``verify`` is
    the TLS trust for https (None: httpx's default CA bundle), ``transport`` an httpx transport
    that plays every origin (None: a real TLS connection per hop).
    """

    def __init__(self, policy: MediaPolicy, resolver: Resolver = system_resolver,
                 transport: httpx.AsyncBaseTransport | None = None, *,
                 refuse_address: AddressCheck = address_refusal,
                 verify: ssl.SSLContext | None = None) -> None:
        self.policy = policy
        self._resolver = resolver
        self._transport = transport
        self._refuse_address = refuse_address
        self._verify: ssl.SSLContext | bool = verify if verify is not None else True

    async def load_all(self, urls: list[str]) -> list[bytes]:
        """The bytes of every image in ``urls`` (one request's images), in order.

        All loads run at once, each as ``load``. The first failure cancels the others and raises
        its ``MediaError`` as ``"image i: ..."`` (``i`` counted from 0); cancelling the caller
        cancels every load still running. Either way no load is left running on return."""
        async def one(index: int, url: str) -> bytes:
            try:
                return await self.load(url)
            except MediaError as err:
                raise MediaError(f"image {index}: {err}") from None

        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(one(i, url)) for i, url in enumerate(urls)]
        except BaseExceptionGroup as failed:
            raise failed.exceptions[0] from None  # the first load to fail
        return [task.result() for task in tasks]

    async def load(self, url: str) -> bytes:
        """The bytes of the image ``url`` names, checked from the URL to the pixel header within
        ``policy.timeout`` seconds; anything refused raises ``MediaError``."""
        deadline = asyncio.timeout(self.policy.timeout)
        try:
            async with deadline:
                data = await self._load(url)
                await asyncio.to_thread(self._check_pixels, data, url)
                return data
        except TimeoutError:
            if not deadline.expired():
                raise
            raise MediaError(f"image URL {_short(url)} did not load within "
                             f"{self.policy.timeout:g} s") from None

    async def _load(self, url: str) -> bytes:
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme == "data":
            return await asyncio.to_thread(self._data_url, url)
        if scheme == "file":
            return await asyncio.to_thread(self._local_file, url)
        if scheme in ("https", "http"):
            return await self._fetch(url)
        raise MediaError(f"image URL scheme {scheme!r} is not supported; allowed: data:, file:// "
                         f"(under --allowed-local-media-path), https:// (--allowed-media-domains)")

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
        shown = unquote(parts.path)
        real = os.path.realpath(url2pathname(shown))
        allowed = os.path.realpath(root)
        if os.path.commonpath([real, allowed]) != allowed:
            raise MediaError(f"file {shown!r} is outside the allowed media directory {str(root)!r}")
        if not os.path.isfile(real):
            raise MediaError(f"file {shown!r} does not exist or is not a regular file")
        try:
            data = _read_file(real, self.policy.max_bytes + 1)
        except OSError as err:
            raise MediaError(f"file {shown!r} cannot be read: {err.strerror or 'I/O error'}") from None
        if len(data) > self.policy.max_bytes:
            raise MediaError(f"file {shown!r} is over the limit of {self.policy.max_bytes} bytes")
        return data

    async def _fetch(self, url: str) -> bytes:
        for _ in range(self.policy.max_redirects + 1):
            host, port = self._check_remote(url)
            address = await self._public_address(host, port)
            parts = urlsplit(url)
            pinned = parts._replace(netloc=f"[{address}]:{port}" if ":" in address
                                    else f"{address}:{port}").geturl()
            # A client per hop: a connection verified for one host name never serves another.
            # No httpx timeout: ``load``'s deadline covers the whole fetch.
            transport = (self._transport if self._transport is not None
                         else httpx.AsyncHTTPTransport(verify=self._verify, trust_env=False))
            async with httpx.AsyncClient(transport=transport, follow_redirects=False,
                                         trust_env=False, timeout=None) as client:
                request = client.build_request("GET", pinned, headers={"Host": parts.netloc},
                                               extensions={"sni_hostname": host})
                try:
                    response = await client.send(request, stream=True)
                    try:
                        if response.status_code in REDIRECTS and "location" in response.headers:
                            url = urljoin(url, response.headers["location"])
                            continue
                        if response.status_code != 200:
                            raise MediaError(f"image URL {_short(url)} answered HTTP "
                                             f"{response.status_code}")
                        return await self._read_capped(response, url)
                    finally:
                        await response.aclose()
                except httpx.RequestError as err:
                    raise MediaError(f"image URL {_short(url)} could not be fetched from {address}: "
                                     f"{err or type(err).__name__}") from None
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
        """The address to connect to for ``host``: resolved once, every answer checked."""
        try:
            addresses = await self._resolver(host, port)
        except OSError as err:
            raise MediaError(f"image host {host!r} does not resolve: {err}") from None
        if not addresses:
            raise MediaError(f"image host {host!r} resolves to no address")
        refused = [f"{a} is {why}" for a in addresses if (why := self._refuse_address(a))]
        if refused:
            raise MediaError(f"image host {host!r} resolves to a non-public address: "
                             f"{'; '.join(refused)}; only global unicast addresses are fetched")
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
            with Image.open(io.BytesIO(data), formats=ACCEPTED_FORMATS) as image:
                width, height = image.size
        except Image.DecompressionBombError:
            raise MediaError(f"image URL {_short(url)} has more pixels than the limit of "
                             f"{self.policy.max_pixels}") from None
        except (UnidentifiedImageError, OSError):  # PIL's message holds a repr of the stream
            raise MediaError(f"image URL {_short(url)} is not a readable image (accepted formats: "
                             f"{ACCEPTED_FORMATS_TEXT})") from None
        if width * height > self.policy.max_pixels:
            raise MediaError(f"image URL {_short(url)} has {width}x{height} pixels, over the limit "
                             f"of {self.policy.max_pixels}")


def _read_file(path: str, limit: int) -> bytes:
    """At most ``limit`` bytes from the start of the file at ``path``."""
    with open(path, "rb") as file:
        return file.read(limit)


def _short(url: str) -> str:
    """``url`` as shown in messages: a data URL by its header only, others cut to 80 characters."""
    if url[:5].lower() == "data:":
        return repr(url.partition(",")[0][:60] + ",...")
    return repr(url if len(url) <= 80 else url[:77] + "...")
