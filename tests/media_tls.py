"""A local HTTPS origin for the media tests: a throwaway CA, a certificate for chosen host names
signed by it, and a threaded server on 127.0.0.1 that records what each client sent.

Nothing here reaches beyond 127.0.0.1; the CA exists only in the test's temporary directory, so
only a client given ``client_context()`` trusts the server."""

from __future__ import annotations

import datetime
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

Route = tuple[int, dict[str, str], bytes]  # status, headers, body


def write_certificates(directory: Path, hosts: list[str]) -> tuple[Path, Path, Path]:
    """A CA certificate and a server certificate (with its key) valid for ``hosts`` only, as PEM
    files in ``directory``: (ca, certificate, key)."""
    now = datetime.datetime.now(datetime.timezone.utc)
    valid = (now - datetime.timedelta(hours=1), now + datetime.timedelta(hours=1))
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "mmkv media test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(valid[0]).not_valid_after(valid[1])
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False,
                                       encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    leaf = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
            .issuer_name(ca_name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(valid[0]).not_valid_after(valid[1])
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(h) for h in hosts]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    paths = directory / "ca.pem", directory / "cert.pem", directory / "key.pem"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return paths


class _Handler(BaseHTTPRequestHandler):
    server: "_Server"

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        host = self.headers.get("Host", "")
        self.server.origin.seen.append({
            "address": self.connection.getsockname()[0],  # the address the client connected to
            "sni": getattr(self.connection, "sni", None), "host": host, "path": self.path})
        status, headers, body = self.server.origin.routes.get(
            (host.rsplit(":", 1)[0], self.path), (404, {}, b""))
        self.send_response(status)
        for name, value in {**headers, "Content-Length": str(len(body))}.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    origin: "TlsOrigin"

    def finish_request(self, request, client_address) -> None:
        """TLS per connection, in the connection's thread; a failed handshake is recorded."""
        try:
            tls = self.origin.server_context.wrap_socket(request, server_side=True)
        except (ssl.SSLError, OSError) as err:
            self.origin.handshake_failures.append(str(err))
            return
        try:
            self.RequestHandlerClass(tls, client_address, self)
        finally:
            tls.close()


class TlsOrigin:
    """An HTTPS server on 127.0.0.1 presenting a certificate for ``hosts``.

    ``routes`` maps (host name, path) to (status, headers, body); ``seen`` lists each request as
    {address, sni, host, path}; ``sni_names`` every SNI name offered, handshakes that failed
    included."""

    def __init__(self, directory: Path, hosts: list[str]) -> None:
        self.ca, cert, key = write_certificates(directory, hosts)
        self.server_context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.server_context.load_cert_chain(cert, key)
        self.server_context.sni_callback = self._sni
        self.routes: dict[tuple[str, str], Route] = {}
        self.seen: list[dict[str, str | None]] = []
        self.sni_names: list[str | None] = []
        self.handshake_failures: list[str] = []
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.origin = self
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True)
        self._thread.start()

    def _sni(self, connection: ssl.SSLSocket, name: str | None, _context: ssl.SSLContext) -> None:
        connection.sni = name
        self.sni_names.append(name)

    def client_context(self) -> ssl.SSLContext:
        """A client TLS context that trusts this origin's CA (and nothing else)."""
        return ssl.create_default_context(cafile=str(self.ca))

    def clear(self) -> None:
        self.seen.clear(), self.sni_names.clear(), self.handshake_failures.clear()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
