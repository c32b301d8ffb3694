"""The server's image URL rules. Remote origins are played by an ``httpx.MockTransport``, or by a
local TLS server on 127.0.0.1 (``media_tls``) for the real pinned-address connection, and DNS by a
table (this machine reaches no remote host): the loader's own checks are what is tested."""

import asyncio
import base64
import io
import threading

import httpx
import pytest
from media_tls import TlsOrigin
from PIL import Image

import mmkv.server.media as media_module
from mmkv.server.media import (BLOCKED_NETWORKS, MediaError, MediaLoader, MediaPolicy,
                               address_refusal, is_public_address)

PUBLIC = "93.184.216.34"


def png(size=(8, 8)) -> bytes:
    return encoded("PNG", size)


def encoded(fmt: str, size=(8, 8)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, (200, 10, 10)).save(buffer, format=fmt)
    return buffer.getvalue()


def data_url(data: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64," + base64.b64encode(data).decode()


DNS = {"images.example": [PUBLIC], "inside.example": ["10.0.0.7"], "mixed.example": [PUBLIC, "127.0.0.1"],
       "metadata.example": ["169.254.169.254"], "v6.example": ["::ffff:127.0.0.1"]}


async def table_resolver(host: str, port: int) -> list[str]:
    if host not in DNS:
        raise OSError(f"no such host {host}")
    return DNS[host]


def loader(routes: dict, **policy) -> tuple[MediaLoader, list[httpx.Request]]:
    """A loader whose https origins answer from ``routes`` (host header, path) -> response."""
    seen: list[httpx.Request] = []

    async def origin(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        answer = routes[(request.headers["host"], request.url.path)]
        if callable(answer):
            return await answer()
        return answer

    policy = MediaPolicy(**{"allowed_domains": frozenset({"images.example", "inside.example",
                                                           "mixed.example", "metadata.example",
                                                           "v6.example"}), **policy})
    return MediaLoader(policy, table_resolver, httpx.MockTransport(origin)), seen


def load(media: MediaLoader, url: str) -> bytes:
    return asyncio.run(media.load(url))


@pytest.mark.parametrize("address, refused_as", [
    ("93.184.216.34", None), ("8.8.8.8", None), ("1.1.1.1", None), ("2606:4700::1111", None),
    ("2a00:1450:4001:80b::200e", None), ("2001:4860:4860::8888", None), ("2001:200::1", None),
    ("0.0.0.0", "this-network"), ("0.1.2.3", "this-network"), ("10.1.2.3", "private-use"),
    ("172.16.0.1", "private-use"), ("192.168.1.1", "private-use"),
    ("100.64.0.1", "shared address space"), ("127.0.0.1", "loopback"), ("127.8.9.10", "loopback"),
    ("169.254.169.254", "link-local"), ("192.0.0.8", "IETF protocol assignments"),
    ("192.0.2.1", "documentation"), ("198.51.100.7", "documentation"),
    ("203.0.113.9", "documentation"), ("198.18.0.1", "benchmarking"),
    ("198.19.255.1", "benchmarking"), ("192.88.99.1", "6to4 relay anycast"),
    ("224.0.0.1", "multicast"), ("239.255.255.250", "multicast"), ("240.0.0.1", "reserved"),
    ("255.255.255.255", "limited broadcast"),
    ("::", "unspecified"), ("::1", "loopback"), ("::ffff:10.0.0.1", "IPv4-mapped"),
    ("::ffff:8.8.8.8", "IPv4-mapped"), ("::127.0.0.1", "IPv4-compatible"),
    ("::8.8.8.8", "IPv4-compatible"), ("64:ff9b::7f00:1", "NAT64"),
    ("64:ff9b::808:808", "NAT64"), ("64:ff9b:1::1", "local-use NAT64"),
    ("100::1", "discard-only"), ("2001::1", "Teredo"),
    ("2001:0:4136:e378:8000:63bf:3fff:fdd2", "Teredo"), ("2001:2::1", "benchmarking"),
    ("2001:20::1", "ORCHIDv2"), ("2001:1::1", "IETF protocol assignments"),
    ("2001:db8::1", "documentation"), ("3fff::1", "documentation"),
    ("2002:7f00:1::1", "6to4"), ("2002:808:808::1", "6to4"), ("fc00::1", "unique-local"),
    ("fd12:3456::1", "unique-local"), ("fe80::1", "link-local"), ("fe80::1%eth0", "link-local"),
    ("fec0::1", "site-local"), ("ff02::1", "multicast"), ("4000::1", "outside global unicast"),
    ("1::1", "outside global unicast"), ("5f00::1", "outside global unicast"),
    ("e000::1", "outside global unicast"), ("images.example", "not an IP address"),
])
def test_only_plain_global_unicast_addresses_are_public(address, refused_as):
    reason = address_refusal(address)
    assert is_public_address(address) is (refused_as is None)
    assert reason is None if refused_as is None else reason.startswith(refused_as), reason


def test_every_blocked_network_refuses_its_first_and_last_address():
    for network, reason in BLOCKED_NETWORKS:
        for address in (network[0], network[-1]):
            assert not is_public_address(str(address)), (network, reason)


def test_an_allowed_https_image_is_fetched_from_the_checked_address_with_the_host_name():
    media, seen = loader({("images.example", "/a.png"): httpx.Response(200, content=png())})
    assert load(media, "https://images.example/a.png") == png()
    assert seen[0].url.host == PUBLIC and seen[0].extensions["sni_hostname"] == "images.example"


@pytest.mark.parametrize("url, message", [
    ("http://images.example/a.png", "is not https"),
    ("https://other.example/a.png", "host 'other.example' is not allowed"),
    ("https://user:pw@images.example/a.png", "credentials"),
    ("https://inside.example/a.png", "non-public address: 10.0.0.7 is private-use (10.0.0.0/8)"),
    ("https://mixed.example/a.png", "non-public address: 127.0.0.1 is loopback (127.0.0.0/8)"),
    ("https://metadata.example/a.png", "non-public address: 169.254.169.254 is link-local"),
    ("https://v6.example/a.png", "non-public address: ::ffff:127.0.0.1 is IPv4-mapped"),
])
def test_refused_remote_urls_make_no_request(url, message):
    media, seen = loader({})
    with pytest.raises(MediaError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load(media, url)
    assert seen == []


@pytest.mark.parametrize("location, message", [
    ("https://inside.example/b.png", "non-public address"),
    ("http://images.example/b.png", "is not https"),
    ("https://elsewhere.example/b.png", "is not allowed"),
])
def test_redirects_are_checked_again(location, message):
    media, seen = loader({("images.example", "/a.png"): httpx.Response(302, headers={"location": location})})
    with pytest.raises(MediaError, match=message):
        load(media, "https://images.example/a.png")
    assert len(seen) == 1


def test_redirect_chain_within_the_rules_and_its_limit():
    hop = lambda n: httpx.Response(302, headers={"location": f"/{n}.png"})  # noqa: E731
    media, _ = loader({("images.example", "/0.png"): hop(1), ("images.example", "/1.png"): hop(2),
                       ("images.example", "/2.png"): httpx.Response(200, content=png())})
    assert load(media, "https://images.example/0.png") == png()
    media, _ = loader({("images.example", f"/{i}.png"): hop(i + 1) for i in range(5)}, max_redirects=3)
    with pytest.raises(MediaError, match="redirected more than 3 times"):
        load(media, "https://images.example/0.png")


def test_byte_pixel_and_time_caps():
    big = png((300, 300))
    media, _ = loader({("images.example", "/big.png"): httpx.Response(200, content=big)}, max_bytes=len(big) - 1)
    with pytest.raises(MediaError, match="over the limit"):
        load(media, "https://images.example/big.png")
    media, _ = loader({("images.example", "/big.png"): httpx.Response(200, content=big)}, max_pixels=300 * 299)
    with pytest.raises(MediaError, match="300x300 pixels, over the limit of 89700"):
        load(media, "https://images.example/big.png")

    async def slow():
        await asyncio.sleep(5)
        return httpx.Response(200, content=png())

    media, _ = loader({("images.example", "/slow.png"): slow}, timeout=0.2)
    with pytest.raises(MediaError, match="did not load within 0.2 s"):
        load(media, "https://images.example/slow.png")
    media, _ = loader({("images.example", "/404.png"): httpx.Response(404)})
    with pytest.raises(MediaError, match="answered HTTP 404"):
        load(media, "https://images.example/404.png")


def test_data_urls():
    media, _ = loader({}, max_bytes=200)
    small = png()
    assert load(media, "data:image/png;base64," + base64.b64encode(small).decode()) == small
    for url, message in (("data:text/plain;base64,aGk=", "data:image/<type>;base64"),
                         ("data:image/png,rawbytes", "data:image/<type>;base64"),
                         ("data:image/png;base64,@@@@", "not valid base64"),
                         ("data:image/png;base64," + "A" * 400, "over the limit of 200 bytes"),
                         ("data:image/png;base64,aGVsbG8=", "not a readable image")):
        with pytest.raises(MediaError, match=message.replace("(", r"\(")):
            load(media, url)


def test_local_files_only_inside_the_allowed_directory(tmp_path):
    inside, outside = tmp_path / "media", tmp_path / "private"
    inside.mkdir(), outside.mkdir()
    (inside / "a.png").write_bytes(png())
    (outside / "b.png").write_bytes(png())
    (inside / "escape.png").symlink_to(outside / "b.png")
    media = MediaLoader(MediaPolicy(allowed_local_path=inside))
    assert load(media, (inside / "a.png").as_uri()) == png()
    for url in ((outside / "b.png").as_uri(), (inside / "escape.png").as_uri(),
                f"file://{inside}/../private/b.png", f"file://{inside}/%2e%2e/private/b.png"):
        with pytest.raises(MediaError, match="outside the allowed media directory"):
            load(media, url)
    with pytest.raises(MediaError, match="only local files"):
        load(media, f"file://server{inside}/a.png")
    with pytest.raises(MediaError, match="no --allowed-local-media-path"):
        load(MediaLoader(MediaPolicy()), (inside / "a.png").as_uri())


ACCEPTED = "accepted formats: PNG, JPEG, WebP, GIF, BMP"


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF", "BMP"])
def test_accepted_formats_load(fmt):
    data = encoded(fmt)
    assert load(MediaLoader(MediaPolicy()), data_url(data)) == data


@pytest.mark.parametrize("fmt", ["TIFF", "ICO", "PPM", "TGA", "PCX"])
def test_other_formats_are_refused_with_the_accepted_list(fmt):
    media = MediaLoader(MediaPolicy())
    with pytest.raises(MediaError, match=rf"is not a readable image \({ACCEPTED}\)"):
        load(media, data_url(encoded(fmt)))


@pytest.mark.parametrize("data", [b"hello", b"\x89PNG\r\n\x1a\n" + b"\x00" * 30, encoded("TIFF"),
                                  png()[:20]])
def test_errors_name_the_image_in_words_never_a_repr(data):
    media = MediaLoader(MediaPolicy())
    with pytest.raises(MediaError) as single:
        load(media, data_url(data))
    with pytest.raises(MediaError) as among:
        asyncio.run(media.load_all([data_url(png()), data_url(data)]))
    for message in (str(single.value), str(among.value)):
        assert "object at 0x" not in message and "<_io" not in message, message
        assert f"is not a readable image ({ACCEPTED})" in message
    assert str(among.value).startswith("image 1: image URL 'data:image/png;base64,...'")


class SlowFile:
    """A stand-in for the file reader that blocks until released (or 5 s), and says whether it
    has returned."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.returned = False

    def __call__(self, path: str, limit: int) -> bytes:
        self.release.wait(5)
        self.returned = True
        return png()


def test_the_timeout_covers_file_reads(tmp_path, monkeypatch):
    (tmp_path / "a.png").write_bytes(png())
    slow = SlowFile()
    monkeypatch.setattr(media_module, "_read_file", slow)
    media = MediaLoader(MediaPolicy(allowed_local_path=tmp_path, timeout=0.3))

    async def refused_while_reading() -> bool:
        # a long URL is shortened in the message, so its file name may not show
        with pytest.raises(MediaError, match=r"image URL 'file://.*' did not load within 0\.3 s"):
            await media.load((tmp_path / "a.png").as_uri())
        reading = not slow.returned  # the load gave up with the read still blocked
        slow.release.set()  # lets the reader's thread end, so asyncio.run need not wait for it
        return reading

    try:
        assert asyncio.run(refused_while_reading())
    finally:
        slow.release.set()


def test_the_timeout_covers_the_pixel_check(monkeypatch):
    release, checked = threading.Event(), []
    real_check = MediaLoader._check_pixels

    def slow_check(self, data, url):
        release.wait(5)
        checked.append(url)
        real_check(self, data, url)

    monkeypatch.setattr(MediaLoader, "_check_pixels", slow_check)
    media = MediaLoader(MediaPolicy(timeout=0.3))

    async def refused_while_checking() -> bool:
        with pytest.raises(MediaError,
                           match=r"'data:image/png;base64,\.\.\.' did not load within 0\.3 s"):
            await media.load(data_url(png()))
        checking = not checked  # the load gave up with the check still blocked
        release.set()
        return checking

    try:
        assert asyncio.run(refused_while_checking())
    finally:
        release.set()


def test_unreadable_local_file_is_refused_in_words(tmp_path, monkeypatch):
    (tmp_path / "a.png").write_bytes(png())

    def denied(path, limit):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(media_module, "_read_file", denied)
    with pytest.raises(MediaError, match="cannot be read: Permission denied"):
        load(MediaLoader(MediaPolicy(allowed_local_path=tmp_path)), (tmp_path / "a.png").as_uri())


def gated_loader(count: int) -> tuple[MediaLoader, dict]:
    """A loader whose origin answers /slow/<i>.png only once ``count`` requests are waiting at
    the same time (so loads in sequence time out), and never answers /hang/<i>.png; ``state``
    records arrivals and cancellations."""
    state = {"arrived": 0, "cancelled": [], "all_here": None}

    async def origin(request: httpx.Request) -> httpx.Response:
        if state["all_here"] is None:
            state["all_here"] = asyncio.Event()
        state["arrived"] += 1
        if state["arrived"] == count:
            state["all_here"].set()
        try:
            if request.url.path.startswith("/hang/"):
                await asyncio.sleep(60)
            await state["all_here"].wait()
        except asyncio.CancelledError:
            state["cancelled"].append(request.url.path)
            raise
        return httpx.Response(200, content=png())

    policy = MediaPolicy(allowed_domains=frozenset({"images.example"}), timeout=2.0)
    return MediaLoader(policy, table_resolver, httpx.MockTransport(origin)), state


def test_load_all_runs_the_loads_at_once_and_keeps_their_order():
    media, state = gated_loader(3)
    urls = [f"https://images.example/slow/{i}.png" for i in range(3)]
    assert asyncio.run(media.load_all(urls[:1] + [data_url(encoded("GIF"))] + urls[1:])) == \
        [png(), encoded("GIF"), png(), png()]
    assert state["arrived"] == 3 and state["cancelled"] == []
    assert asyncio.run(media.load_all([])) == []


def test_load_all_first_failure_cancels_the_others():
    media, state = gated_loader(99)

    async def run() -> None:  # the two hanging loads would take 60 s: cancelled, they end at once
        with pytest.raises(MediaError, match=r"^image 2: .*not a readable image"):
            await media.load_all(["https://images.example/hang/0.png",
                                  "https://images.example/hang/1.png", data_url(b"not an image")])
        assert sorted(state["cancelled"]) == ["/hang/0.png", "/hang/1.png"]
        assert asyncio.all_tasks() == {asyncio.current_task()}

    asyncio.run(run())


def test_cancelling_load_all_cancels_every_load():
    media, state = gated_loader(99)

    async def run() -> None:
        task = asyncio.create_task(media.load_all(
            [f"https://images.example/hang/{i}.png" for i in range(3)]))
        async def all_started() -> None:
            while state["arrived"] < 3:
                await asyncio.sleep(0.01)

        await asyncio.wait_for(all_started(), 1.0)  # the three loads run at once
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert sorted(state["cancelled"]) == [f"/hang/{i}.png" for i in range(3)]
        assert asyncio.all_tasks() == {asyncio.current_task()}

    asyncio.run(run())


# The real https path: a TLS server on 127.0.0.1 plays the origins, the resolver table maps test
# host names to it, and the address check lets 127.0.0.1 (only) pass as public.

@pytest.fixture(scope="module")
def origin(tmp_path_factory):
    server = TlsOrigin(tmp_path_factory.mktemp("tls"), ["images.test", "flip.test"])
    yield server
    server.close()


class Resolver:
    """DNS from a table; a host with several answers gives them one per call, the last repeating.
    ``calls`` lists the hosts asked for."""

    def __init__(self, table: dict[str, list[list[str]]]) -> None:
        self.table = table
        self.calls: list[str] = []

    async def __call__(self, host: str, port: int) -> list[str]:
        answers = self.table[host]
        self.calls.append(host)
        return answers[min(len(self.calls_for(host)), len(answers)) - 1]

    def calls_for(self, host: str) -> list[str]:
        return [h for h in self.calls if h == host]


def local_is_public(address: str) -> str | None:
    return None if address == "127.0.0.1" else address_refusal(address)


def tls_loader(origin: TlsOrigin, resolver: Resolver, trust: bool = True) -> MediaLoader:
    policy = MediaPolicy(allowed_domains=frozenset({"images.test", "flip.test", "wrong.test",
                                                    "inside.test"}), timeout=3.0)
    return MediaLoader(policy, resolver, refuse_address=local_is_public,
                       verify=origin.client_context() if trust else None)


def test_real_tls_fetch_pins_the_address_and_verifies_the_host_name(origin):
    origin.clear()
    origin.routes[("images.test", "/a.png")] = (200, {"Content-Type": "image/png"}, png())
    resolver = Resolver({"images.test": [["127.0.0.1"]], "wrong.test": [["127.0.0.1"]]})
    media = tls_loader(origin, resolver)
    assert load(media, f"https://images.test:{origin.port}/a.png") == png()
    assert origin.seen == [{"address": "127.0.0.1", "sni": "images.test",
                            "host": f"images.test:{origin.port}", "path": "/a.png"}]
    with pytest.raises(MediaError, match=r"could not be fetched from 127\.0\.0\.1: .*certificate "
                                         r"verify failed.*wrong\.test"):
        load(media, f"https://wrong.test:{origin.port}/a.png")
    assert origin.sni_names[-1] == "wrong.test" and len(origin.seen) == 1
    with pytest.raises(MediaError, match="certificate verify failed"):  # default trust: not the test CA
        load(tls_loader(origin, resolver, trust=False), f"https://images.test:{origin.port}/a.png")
    assert len(origin.seen) == 1


def test_real_tls_redirect_to_a_private_address_is_refused(origin):
    origin.clear()
    origin.routes[("images.test", "/away.png")] = (
        302, {"Location": f"https://inside.test:{origin.port}/b.png"}, b"")
    resolver = Resolver({"images.test": [["127.0.0.1"]], "inside.test": [["10.0.0.7"]]})
    with pytest.raises(MediaError, match=r"'inside\.test' resolves to a non-public address: "
                                         r"10\.0\.0\.7 is private-use"):
        load(tls_loader(origin, resolver), f"https://images.test:{origin.port}/away.png")
    assert [r["path"] for r in origin.seen] == ["/away.png"]
    assert resolver.calls == ["images.test", "inside.test"]


def test_real_tls_connects_to_the_checked_address_never_a_second_dns_answer(origin):
    origin.clear()
    origin.routes[("flip.test", "/a.png")] = (200, {}, png())
    origin.routes[("flip.test", "/again.png")] = (302, {"Location": "/a.png"}, b"")
    flip = {"flip.test": [["127.0.0.1"], ["127.0.0.2"]]}  # public when checked, then loopback
    resolver = Resolver(flip)
    assert load(tls_loader(origin, resolver), f"https://flip.test:{origin.port}/a.png") == png()
    assert resolver.calls == ["flip.test"]
    assert origin.seen == [{"address": "127.0.0.1", "sni": "flip.test",
                            "host": f"flip.test:{origin.port}", "path": "/a.png"}]
    resolver = Resolver(flip)  # each hop resolves once and is checked again
    with pytest.raises(MediaError, match=r"non-public address: 127\.0\.0\.2 is loopback"):
        load(tls_loader(origin, resolver), f"https://flip.test:{origin.port}/again.png")
    assert resolver.calls == ["flip.test", "flip.test"]
    assert [r["path"] for r in origin.seen] == ["/a.png", "/again.png"]
