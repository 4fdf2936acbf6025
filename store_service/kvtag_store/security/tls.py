"""TLS on the gRPC port: the certificate files, optional client CA (mutual TLS), and reload on SIGHUP.

gRPC asks `_fetch` for the certificate configuration at every new handshake
(grpc.dynamic_ssl_server_credentials), so a reload changes what new connections see and leaves the
established ones, and the sessions on them, alone. Sessions are not tied to connections anyway.
"""

from __future__ import annotations

import logging
import ssl
import threading
from pathlib import Path

import grpc

log = logging.getLogger("kvtag_store.security.tls")


class TlsFileError(ValueError):
    """A certificate, key or CA file that cannot be used; names the file, never its content."""


class ServerTls:
    """The server's certificate chain and key, and the CA its clients' certificates must chain to."""

    def __init__(self, cert: str | Path, key: str | Path, client_ca: str | Path | None = None) -> None:
        self.cert = Path(cert)
        self.key = Path(key)
        self.client_ca = Path(client_ca) if client_ca else None
        self._lock = threading.Lock()
        self._current = self._load()
        self._pending: grpc.ServerCertificateConfiguration | None = None

    @property
    def mutual(self) -> bool:
        return self.client_ca is not None

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            self._current, self._fetch, require_client_authentication=self.mutual
        )

    def reload(self) -> bool:
        """Re-read the files (SIGHUP). New handshakes use them; on an error the old ones stay in force."""
        try:
            config = self._load()
        except TlsFileError as exc:
            log.error("TLS files not reloaded, the previous certificate stays in force: %s", exc)
            return False
        with self._lock:
            self._current = self._pending = config
        log.info("TLS certificate reloaded", extra={"cert": str(self.cert), "mutual": self.mutual})
        return True

    def _fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """Called by gRPC before each handshake: the new configuration once after a reload, else None
        (keep the current one)."""
        with self._lock:
            pending, self._pending = self._pending, None
        return pending

    def _load(self) -> grpc.ServerCertificateConfiguration:
        cert, key = _read(self.cert, "--tls-cert"), _read(self.key, "--tls-key")
        client_ca = _read(self.client_ca, "--tls-client-ca") if self.client_ca else None
        # The stdlib checks that the key matches the certificate, which gRPC would otherwise discover
        # only at the first handshake (and then fail every connection).
        try:
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(self.cert, self.key)
            if self.client_ca is not None:
                ssl.create_default_context(cafile=str(self.client_ca))
        except (ssl.SSLError, OSError) as exc:
            raise TlsFileError(
                f"{self.cert} / {self.key}: not a matching PEM certificate chain and private key, or "
                f"{self.client_ca} is not a PEM CA bundle ({exc.__class__.__name__})"
            ) from None
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=client_ca)


def _read(path: Path, flag: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise TlsFileError(f"{flag} {path}: cannot read ({exc.strerror})") from None
