"""`mmkv serve`'s guard against DNS rebinding and its key rules: without an API key only requests
addressed to the server (by ``Host``) are answered, the page at ``/`` included; a non-loopback
bind without a key is warned of; an empty key is refused at start, naming the option."""

import argparse
import logging
import time

import httpx
import pytest

from mmkv.cli import add_serve_arguments
from mmkv.server import ServerSettings
from mmkv.server.host_check import HostAllowList, exposure_warning, host_name
from mmkv.server.launch import run
from mmkv.server.settings import settings_from_args
from server_harness import MODEL_NAME, bundled_engine, start_server

BOUND = "10.1.2.3"  # the address the settings say is bound; the harness binds 127.0.0.1 itself


@pytest.fixture(scope="module")
def keyless():
    """A server without a key whose settings name ``BOUND`` as its address and allow one more
    name; its socket is on 127.0.0.1, so the bound-address rule is tested without binding there."""
    running = start_server(bundled_engine(kv_cache_memory="4MiB"), host=BOUND,
                           allowed_hosts=frozenset({"mmkv.internal"}))
    yield running
    running.stop()
    running.engine.check_integrity()


def port(running) -> str:
    return running.url.rsplit(":", 1)[1]


@pytest.mark.parametrize("host", ["attacker.example", "attacker.example:{port}", "10.1.2.4",
                                  "mmkv.internal.attacker.example", "localhost.attacker.example",
                                  "127.0.0.1.attacker.example", "0.0.0.0"])
def test_a_host_not_addressed_to_the_server_gets_403_on_every_route(keyless, host):
    host = host.format(port=port(keyless))
    for method, path in (("GET", "/"), ("GET", "/v1/models"), ("GET", "/metrics"),
                         ("POST", "/v1/completions"), ("POST", "/tokenize"), ("POST", "/detokenize")):
        r = httpx.request(method, f"{keyless.url}{path}", headers={"Host": host},
                          json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 2})
        assert r.status_code == 403, (path, r.text)
        error = r.json()["error"]
        assert error["code"] == "host_not_allowed" and f"Host {host!r} is not allowed" in error["message"]
        assert "--allowed-hosts" in error["message"]
    assert httpx.get(f"{keyless.url}/health", headers={"Host": host}).status_code == 200


def test_a_refused_host_is_in_the_access_log(keyless, caplog):
    with caplog.at_level(logging.INFO, logger="mmkv.server.access"):
        assert httpx.get(f"{keyless.url}/v1/models", headers={"Host": "attacker.example"}).status_code == 403
        deadline = time.monotonic() + 5  # the line is written once the response is sent
        while not any("GET /v1/models 403" in r.getMessage() for r in caplog.records):
            assert time.monotonic() < deadline, caplog.text
            time.sleep(0.02)


@pytest.mark.parametrize("host", ["localhost", "localhost:{port}", "LocalHost.", "127.0.0.1:{port}",
                                  "127.9.9.9", "[::1]:{port}", f"{BOUND}:{{port}}", "mmkv.internal",
                                  "MMKV.internal:443"])
def test_localhost_the_bound_address_and_allowed_names_are_answered(keyless, host):
    headers = {"Host": host.format(port=port(keyless))}
    assert httpx.get(f"{keyless.url}/", headers=headers).status_code == 200
    r = httpx.post(f"{keyless.url}/v1/completions", headers=headers,
                   json={"model": MODEL_NAME, "prompt": "report on x.", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_allow_list_rules():
    """The port is not compared; ``*`` admits any name; a wildcard bind names no host; a request
    without ``Host`` is refused unless any name is allowed."""
    assert host_name("[::1]:8000") == "::1" and host_name("LocalHost.:80") == "localhost"
    assert host_name("::1") == "::1" and host_name("example.com") == "example.com"
    wildcard = HostAllowList.of("0.0.0.0", [])
    assert not wildcard.admits("0.0.0.0") and wildcard.admits("127.0.0.1:1") and not wildcard.admits(None)
    assert not HostAllowList.of("::", []).admits("[::]:8000")
    bound = HostAllowList.of("192.168.1.5", ["a.example:9000"])
    assert bound.admits("192.168.1.5:8000") and bound.admits("a.example") and not bound.admits("b.example")
    anything = HostAllowList.of("127.0.0.1", ["*"])
    assert anything.admits("attacker.example") and anything.admits(None)


def test_binding_beyond_loopback_without_a_key_is_warned_of():
    for host in ("0.0.0.0", "::", "192.168.1.5", "server.example"):
        warning = exposure_warning(host, None)
        assert warning is not None and host in warning and "--api-key" in warning
    for host in ("127.0.0.1", "127.0.0.2", "localhost", "::1"):
        assert exposure_warning(host, None) is None
    assert exposure_warning("0.0.0.0", "sesame") is None


def serve_args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return parser.parse_args(list(flags))


def test_an_empty_api_key_is_an_error_naming_its_option(monkeypatch, caplog):
    monkeypatch.delenv("MMKV_API_KEY", raising=False)
    with pytest.raises(ValueError, match="--api-key is empty"):
        settings_from_args(serve_args("--api-key", ""))
    with caplog.at_level(logging.INFO, logger="mmkv.server"), \
            pytest.raises(SystemExit, match="mmkv serve: --api-key is empty"):
        run(serve_args("--api-key", ""))
    assert not any("loading" in r.message for r in caplog.records)  # refused before the model loads
    monkeypatch.setenv("MMKV_API_KEY", "")
    with pytest.raises(ValueError, match="MMKV_API_KEY is set but empty"):
        settings_from_args(serve_args())
    with pytest.raises(ValueError, match="api_key is empty"):
        ServerSettings(served_model_name=MODEL_NAME, api_key="")
    monkeypatch.setenv("MMKV_API_KEY", "from-env")
    assert settings_from_args(serve_args()).api_key == "from-env"
    assert settings_from_args(serve_args("--api-key", "given")).api_key == "given"


def test_allowed_hosts_option_is_a_comma_separated_list(monkeypatch):
    monkeypatch.delenv("MMKV_API_KEY", raising=False)
    settings = settings_from_args(serve_args("--host", "0.0.0.0", "--allowed-hosts", "a.example, b.example,,*"))
    assert settings.host == "0.0.0.0" and settings.allowed_hosts == {"a.example", "b.example", "*"}
    assert settings_from_args(serve_args()).allowed_hosts == frozenset()
