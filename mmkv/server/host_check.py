"""Which ``Host`` a server without an API key answers: its guard against DNS rebinding.

A web page can make its visitor's browser send requests to a name the page's owner controls and
then point that name at 127.0.0.1 (DNS rebinding); the browser then treats the keyless server as
the page's own origin. Such a request still names the page's host in its ``Host`` header, so a
server without a key answers only requests whose ``Host`` names it: ``localhost``, a loopback
address (``127.0.0.0/8``, ``::1``), the address it binds to (unless that is a wildcard such as
``0.0.0.0``), or a name given with ``--allowed-hosts`` (``*``: any name, no check). The port is not
compared; names are compared without case and without a trailing dot. A request without ``Host``
is refused too. ``/health`` answers a status and nothing else, so it is exempt, as it is from the
key. With an API key the key guards every route and no ``Host`` is checked.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Iterable

from mmkv.server.protocol import ApiError

ANY_HOST = "*"
WILDCARD_BINDS = frozenset({"", "0.0.0.0", "::"})
OPEN_PATHS = frozenset({"/health"})


def host_name(header: str) -> str:
    """The host part of a ``Host`` header or host name: lower case, without port, IPv6 brackets
    or trailing dot (``"[::1]:8000"`` -> ``"::1"``, ``"LocalHost.:80"`` -> ``"localhost"``)."""
    header = header.strip().lower()
    if header.startswith("["):
        name = header[1:].partition("]")[0]
    elif header.count(":") == 1:
        name = header.partition(":")[0]
    else:  # a name without port, or a bare IPv6 address
        name = header
    return name.rstrip(".")


def is_loopback(name: str) -> bool:
    """Whether ``name`` (a ``host_name``) is ``localhost`` or a loopback address."""
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True, slots=True)
class HostAllowList:
    """The ``Host`` names a keyless server answers: loopback ones always, plus ``names``; every
    name when ``any_host``."""

    names: frozenset[str]
    any_host: bool

    @classmethod
    def of(cls, bound: str, allowed: Iterable[str]) -> HostAllowList:
        """The list for a server bound to ``bound`` that also allows ``allowed`` (``*``: any)."""
        names = {host_name(name) for name in allowed}
        if host_name(bound) not in WILDCARD_BINDS:
            names.add(host_name(bound))
        return cls(frozenset(names - {ANY_HOST, ""}), ANY_HOST in names)

    def admits(self, header: str | None) -> bool:
        if self.any_host:
            return True
        if header is None:
            return False
        name = host_name(header)
        return is_loopback(name) or name in self.names


def exposure_warning(bound: str, api_key: str | None) -> str | None:
    """What to warn of at start when the server binds to a non-loopback address without a key
    (anyone who can reach that address can use it); None when it binds to loopback or has a key."""
    if api_key or is_loopback(host_name(bound)):
        return None
    return (f"serving on {bound} without an API key: anyone who can reach this address can use the "
            f"server; give --api-key (or MMKV_API_KEY), or bind to 127.0.0.1")


class RequireHost:
    """ASGI middleware: an HTTP request to any path but ``/health`` whose ``Host`` the allow-list
    does not admit gets a 403 naming that host and how to allow it; nothing else runs for it."""

    def __init__(self, app, allow: HostAllowList) -> None:
        self.app, self.allow = app, allow

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = dict(scope["headers"]).get(b"host")
            header = given.decode("latin-1") if given is not None else None
            if not self.allow.admits(header):
                await refusal(header).response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def refusal(header: str | None) -> ApiError:
    """The 403 for a request whose ``Host`` is ``header`` (None: it sent none)."""
    named = f"Host {header!r} is not allowed" if header is not None else "a Host header is required"
    return ApiError(403, f"{named}: a server without an API key answers only requests addressed to "
                         f"localhost, a loopback address, the address it binds to, or a name given "
                         f"with --allowed-hosts (or start it with --api-key)",
                    type="permission_error", code="host_not_allowed")
