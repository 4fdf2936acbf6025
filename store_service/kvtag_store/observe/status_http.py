"""The service's HTTP port: `/metrics` (Prometheus), `/` (the status page) and `/api/v1/status` (JSON).

One small WSGI app on the standard library's threading WSGI server, like prometheus_client's own
exporter, so the metrics port needs no second listener. Who may read the page and the JSON is the
gate's business (`Gate`): with authentication off every caller sees everything; with it on, a
viewer or admin token is required and the view holds only that token's tenants. `?tenant=NAME`
(repeatable) narrows a view further, never widens it.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import socket
import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any, Protocol
from urllib.parse import parse_qs
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

from kvtag_store.observe import status_page
from kvtag_store.observe.status import StatusSource, View

log = logging.getLogger("kvtag_store.observe.status_http")

StartResponse = Callable[..., Any]
WsgiApp = Callable[[dict[str, Any], StartResponse], Iterable[bytes]]


class Denied(Exception):
    """The caller may not see the status: 401 (no or unknown token) or 403 (a token without the role)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


# Maps the request's credentials (an Authorization header value, or None) to the caller's view.
Gate = Callable[[str | None], View]


def open_gate(_authorization: str | None) -> View:
    """Authentication off: the page shows everything, as Diagnose does."""
    return View.everything()


class Viewer(Protocol):
    """What the gate needs of an authenticated caller (kvtag_store.security.tokens's Principal)."""

    @property
    def views(self) -> bool: ...

    @property
    def sees_everything(self) -> bool: ...

    def may_use(self, tenant: str) -> bool: ...


def token_gate(authenticate: Callable[[str | None], Viewer | None]) -> Gate:
    """Authentication on: a viewer or admin token, seeing only its tenants."""

    def gate(authorization: str | None) -> View:
        principal = authenticate(authorization)
        if principal is None:
            raise Denied(401, "a viewer or admin token is required (Authorization: Bearer TOKEN)")
        if not principal.views:
            raise Denied(403, "this token may not view the status; use a viewer or admin token")
        return View(principal.may_use, principal.sees_everything)

    return gate


def authorization_token(header: str | None) -> str | None:
    """`Bearer TOKEN`, or HTTP Basic with the token as the password (what a browser can send
    without JavaScript: it prompts for it on a 401), as `Bearer TOKEN`; None when absent."""
    if not header:
        return None
    scheme, _, value = header.strip().partition(" ")
    if scheme.lower() != "basic":
        return header
    try:
        decoded = base64.b64decode(value.strip(), validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        return "Bearer "  # malformed: the gate refuses it like any bad token
    return "Bearer " + decoded.partition(":")[2]


def status_app(source: StatusSource, registry: CollectorRegistry, gate: Gate = open_gate) -> WsgiApp:
    metrics = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "/")
        if path == "/metrics":
            return metrics(environ, start_response)  # type: ignore[no-any-return]
        if path not in ("/", "/api/v1/status"):
            return _reply(start_response, 404, "text/plain", b"try /, /api/v1/status or /metrics\n")
        if environ.get("REQUEST_METHOD") not in ("GET", "HEAD"):
            return _reply(start_response, 405, "text/plain", b"use GET\n", [("Allow", "GET, HEAD")])
        try:
            view = gate(authorization_token(environ.get("HTTP_AUTHORIZATION")))
        except Denied as exc:
            challenge = [("WWW-Authenticate", 'Basic realm="kvtag status"')] if exc.status == 401 else []
            return _reply(start_response, exc.status, "text/plain", (exc.message + "\n").encode(), challenge)
        wanted = parse_qs(environ.get("QUERY_STRING", ""), keep_blank_values=True).get("tenant")
        if wanted:
            view = _narrowed(view, frozenset(wanted))
        doc = source.document(view)
        if path == "/api/v1/status":
            return _reply(start_response, 200, "application/json", json.dumps(doc, indent=2).encode())
        return _reply(start_response, 200, "text/html; charset=utf-8", status_page.render(doc).encode())

    return app


def _narrowed(view: View, tenants: frozenset[str]) -> View:
    def may_see(tenant: str) -> bool:
        return tenant in tenants and view.may_see(tenant)

    return View(may_see, view.store_wide)


def _reply(
    start_response: StartResponse,
    status: int,
    content_type: str,
    body: bytes,
    headers: list[tuple[str, str]] | None = None,
) -> list[bytes]:
    reason = {200: "OK", 401: "Unauthorized", 403: "Forbidden", 404: "Not Found", 405: "Method Not Allowed"}
    start_response(
        f"{status} {reason[status]}",
        [
            ("Content-Type", content_type),
            ("Content-Length", str(len(body))),
            ("Cache-Control", "no-store"),
            *(headers or []),
        ],
    )
    return [body]


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Server6(_Server):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Requests are not logged (a scrape every few seconds would drown the service's log)."""


def serve(listen: str, app: WsgiApp) -> tuple[WSGIServer, threading.Thread]:
    """Bind HOST:PORT (port 0 picks one) and serve `app` on a daemon thread."""
    host, _, port = listen.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    server_class: type[WSGIServer] = _Server
    if ":" in host:
        server_class = _Server6
    httpd = make_server(host, int(port), app, server_class, handler_class=_QuietHandler)
    thread = threading.Thread(target=httpd.serve_forever, name="kvtag-http", daemon=True)
    thread.start()
    return httpd, thread
