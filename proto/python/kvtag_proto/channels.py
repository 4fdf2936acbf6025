"""Client channels to a kvtag store: TLS (optionally with a client certificate) and the bearer token,
shared by the client library and the service's CLI so both dial a secured store the same way.

The token rides as `authorization: Bearer <token>` metadata added by a channel interceptor, so it is
sent with TLS and, for loopback tests, without it. It is read from `token_file` (re-read when the
file changes, so a rotated token is picked up without a restart), else from $KVTAG_TOKEN. It is
never logged and never part of an error message.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

TOKEN_ENV = "KVTAG_TOKEN"


class ChannelConfigError(ValueError):
    """A TLS or token file the client cannot use; names the file, never its content."""


@dataclass(frozen=True)
class ChannelSecurity:
    """How to reach a secured store. Empty fields: plaintext, no token (beyond $KVTAG_TOKEN)."""

    tls_ca: str = ""  # PEM CA bundle that signed the store's certificate; enables TLS
    tls_cert: str = ""  # PEM client certificate, for a store that requires mutual TLS
    tls_key: str = ""  # its private key
    token_file: str = ""  # a file holding the bearer token (first line)
    # The name the store's certificate must carry when it differs from the dialled host (a
    # HEALTHCHECK dialling 127.0.0.1 a certificate issued for kvtag.internal).
    server_name: str = ""
    use_env_token: bool = True  # fall back to $KVTAG_TOKEN when token_file is empty

    @property
    def tls(self) -> bool:
        return bool(self.tls_ca or self.tls_cert)


class TokenSource:
    """The current token: the file's first line, re-read when its mtime or size changes."""

    def __init__(self, token_file: str = "", env_token: str | None = None) -> None:
        self.path = Path(token_file) if token_file else None
        self._env_token = env_token or ""
        self._lock = threading.Lock()
        self._stamp: tuple[int, int] | None = None
        self._token = ""
        if self.path is not None:
            self.token()  # fail early on a missing file

    def token(self) -> str:
        if self.path is None:
            return self._env_token
        try:
            stat = self.path.stat()
        except OSError as exc:
            raise ChannelConfigError(f"token_file {self.path}: cannot read ({exc.strerror})") from None
        stamp = (stat.st_mtime_ns, stat.st_size)
        with self._lock:
            if stamp != self._stamp:
                try:
                    text = self.path.read_text(encoding="utf-8")
                except (OSError, UnicodeDecodeError):
                    raise ChannelConfigError(f"token_file {self.path}: cannot read it as text") from None
                self._token = text.strip().splitlines()[0].strip() if text.strip() else ""
                self._stamp = stamp
            return self._token


class _BearerInterceptor(
    grpc.UnaryUnaryClientInterceptor,  # type: ignore[misc]
    grpc.UnaryStreamClientInterceptor,  # type: ignore[misc]
    grpc.StreamUnaryClientInterceptor,  # type: ignore[misc]
    grpc.StreamStreamClientInterceptor,  # type: ignore[misc]
):
    """Adds `authorization: Bearer <token>` to every call."""

    def __init__(self, source: TokenSource) -> None:
        self._source = source

    def _with_token(self, details: Any) -> Any:
        try:
            token = self._source.token()
        except ChannelConfigError:
            token = ""  # the store answers UNAUTHENTICATED, which the caller reports
        if not token:
            return details
        metadata = [*(details.metadata or ()), ("authorization", f"Bearer {token}")]
        return _CallDetails(details, metadata)

    def intercept_unary_unary(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        return continuation(self._with_token(details), request)

    def intercept_unary_stream(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        return continuation(self._with_token(details), request)

    def intercept_stream_unary(self, continuation: Callable[..., Any], details: Any, requests: Any) -> Any:
        return continuation(self._with_token(details), requests)

    def intercept_stream_stream(self, continuation: Callable[..., Any], details: Any, requests: Any) -> Any:
        return continuation(self._with_token(details), requests)


class _CallDetails(grpc.ClientCallDetails):  # type: ignore[misc]
    def __init__(self, base: Any, metadata: Sequence[tuple[str, str]]) -> None:
        self.method = base.method
        self.timeout = base.timeout
        self.metadata = metadata
        self.credentials = base.credentials
        self.wait_for_ready = getattr(base, "wait_for_ready", None)
        self.compression = getattr(base, "compression", None)


def _read_pem(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ChannelConfigError(f"{what} {path}: cannot read ({exc.strerror})") from None


def channel_credentials(security: ChannelSecurity) -> grpc.ChannelCredentials:
    if bool(security.tls_cert) != bool(security.tls_key):
        raise ChannelConfigError("tls_cert and tls_key go together (the client certificate and its key)")
    return grpc.ssl_channel_credentials(
        root_certificates=_read_pem(security.tls_ca, "tls_ca") if security.tls_ca else None,
        private_key=_read_pem(security.tls_key, "tls_key") if security.tls_key else None,
        certificate_chain=_read_pem(security.tls_cert, "tls_cert") if security.tls_cert else None,
    )


def open_channel(
    target: str, security: ChannelSecurity | None = None, options: Sequence[tuple[str, Any]] = ()
) -> grpc.Channel:
    """A channel to `target` with TLS when configured and the bearer token on every call when one is
    set. ChannelConfigError when a named file cannot be read."""
    security = security or ChannelSecurity()
    options = list(options)
    if security.server_name:
        options.append(("grpc.ssl_target_name_override", security.server_name))
    env_token = os.environ.get(TOKEN_ENV, "") if security.use_env_token else ""
    source = TokenSource(security.token_file, env_token)
    if security.tls:
        channel = grpc.secure_channel(target, channel_credentials(security), options=list(options))
    else:
        channel = grpc.insecure_channel(target, options=list(options))
    if not security.token_file and not env_token:
        return channel
    return grpc.intercept_channel(channel, _BearerInterceptor(source))
