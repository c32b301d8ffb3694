"""The server's image URL rules. Remote origins are played by an ``httpx.MockTransport`` and DNS by a
table (this machine reaches no remote host): the loader's own checks are what is tested."""

import asyncio
import base64
import io

import httpx
import pytest
from PIL import Image

from mmkv.server.media import MediaError, MediaLoader, MediaPolicy, is_public_address

PUBLIC = "93.184.216.34"


def png(size=(8, 8)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, (200, 10, 10)).save(buffer, format="PNG")
    return buffer.getvalue()


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


@pytest.mark.parametrize("address, public", [
    ("93.184.216.34", True), ("2606:4700::1111", True), ("127.0.0.1", False), ("10.1.2.3", False),
    ("172.16.0.1", False), ("192.168.1.1", False), ("169.254.169.254", False), ("100.64.0.1", False),
    ("0.0.0.0", False), ("::1", False), ("fe80::1", False), ("fc00::1", False),
    ("::ffff:10.0.0.1", False), ("224.0.0.1", False),
])
def test_only_global_addresses_are_public(address, public):
    assert is_public_address(address) is public


def test_an_allowed_https_image_is_fetched_from_the_checked_address_with_the_host_name():
    media, seen = loader({("images.example", "/a.png"): httpx.Response(200, content=png())})
    assert load(media, "https://images.example/a.png") == png()
    assert seen[0].url.host == PUBLIC and seen[0].extensions["sni_hostname"] == "images.example"


@pytest.mark.parametrize("url, message", [
    ("http://images.example/a.png", "is not https"),
    ("https://other.example/a.png", "host 'other.example' is not allowed"),
    ("https://user:pw@images.example/a.png", "credentials"),
    ("https://inside.example/a.png", "non-public address (10.0.0.7)"),
    ("https://mixed.example/a.png", "non-public address (127.0.0.1)"),
    ("https://metadata.example/a.png", "non-public address (169.254.169.254)"),
    ("https://v6.example/a.png", "non-public address"),
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
