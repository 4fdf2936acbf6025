"""The service's HTTP port: `/metrics` (Prometheus), `/` (the status page) and `/api/v1/status` (JSON).

One small WSGI app on the standard library's threading WSGI server, like prometheus_client's own
exporter, so the metrics port needs no second listener. Who may read the page and the JSON is the
gate's business (`Gate`): with authentication off every caller sees everything; with it on, a
viewer or admin token is required and the view holds only that token's tenants. `?tenant=NAME`
(repeatable) narrows a view further, never widens it. Namespaces come a page at a time, as Diagnose
pages them: `?filter=TEXT&page_size=N&page_token=T`; the JSON's next token is in the
`X-Kvtag-Next-Page-Token` header (the document's schema is unchanged), the page's in a link.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import socket
import threading
from collections.abc import Callable, Iterable, Mapping
from socketserver import ThreadingMixIn
from typing import Any, Protocol
from urllib.parse import parse_qs, urlencode
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from kvtag.v1 import store_pb2 as pb
from prometheus_client import CollectorRegistry, make_wsgi_app

from kvtag_store.errors import ApiError
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
# A JSON route beside the status (e.g. /kv_event_sources): the caller's view -> the document, or
# raises Denied.
JsonRoute = Callable[[View], object]


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


def status_app(
    source: StatusSource,
    registry: CollectorRegistry,
    gate: Gate = open_gate,
    routes: Mapping[str, JsonRoute] | None = None,
) -> WsgiApp:
    """`routes`: more JSON documents by path, behind the same gate (each decides what the view sees)."""
    metrics = make_wsgi_app(registry)
    routes = dict(routes or {})

    def app(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "/")
        if path == "/metrics":
            return metrics(environ, start_response)  # type: ignore[no-any-return]
        if path in routes:
            return _json_route(routes[path], gate, environ, start_response)
        if path not in ("/", "/api/v1/status"):
            return _reply(start_response, 404, "text/plain", b"try /, /api/v1/status or /metrics\n")
        if environ.get("REQUEST_METHOD") not in ("GET", "HEAD"):
            return _reply(start_response, 405, "text/plain", b"use GET\n", [("Allow", "GET, HEAD")])
        try:
            view = gate(authorization_token(environ.get("HTTP_AUTHORIZATION")))
        except Denied as exc:
            challenge = [("WWW-Authenticate", 'Basic realm="kvtag status"')] if exc.status == 401 else []
            return _reply(start_response, exc.status, "text/plain", (exc.message + "\n").encode(), challenge)
        query = parse_qs(environ.get("QUERY_STRING", ""), keep_blank_values=True)
        wanted = query.get("tenant")
        if wanted:
            view = _narrowed(view, frozenset(wanted))
        try:
            request = _page_request(query)
            doc, next_token, total = source.paged(view, request)
        except (ApiError, ValueError) as exc:
            if path == "/" and _has_page_token(query):
                # The page's meta refresh reloads its own URL; once its page token has expired that
                # would answer 400 forever. A person reading the page wants the listing again.
                return _reply(
                    start_response,
                    303,
                    "text/plain",
                    b"page expired: first page\n",
                    [("Location", _first_href(query))],
                )
            return _reply(start_response, 400, "text/plain", (str(exc) + "\n").encode())
        paging = [("X-Kvtag-Total-Namespaces", str(total))]
        if next_token:
            paging.append(("X-Kvtag-Next-Page-Token", next_token))
        if path == "/api/v1/status":
            body = json.dumps(doc, indent=2).encode()
            return _reply(start_response, 200, "application/json", body, paging)
        next_href = _next_href(query, next_token) if next_token else None
        page = status_page.render(doc, next_href=next_href, total_namespaces=total)
        return _reply(start_response, 200, "text/html; charset=utf-8", page.encode(), paging)

    return app


def _json_route(
    route: JsonRoute, gate: Gate, environ: dict[str, Any], start_response: StartResponse
) -> list[bytes]:
    if environ.get("REQUEST_METHOD") not in ("GET", "HEAD"):
        return _reply(start_response, 405, "text/plain", b"use GET\n", [("Allow", "GET, HEAD")])
    try:
        doc = route(gate(authorization_token(environ.get("HTTP_AUTHORIZATION"))))
    except Denied as exc:
        return _reply(start_response, exc.status, "text/plain", (exc.message + "\n").encode())
    return _reply(start_response, 200, "application/json", json.dumps(doc, indent=2).encode())


def _page_request(query: dict[str, list[str]]) -> pb.DiagnoseRequest:
    size = query.get("page_size", ["0"])[0] or "0"
    if not size.isdigit():
        raise ValueError(f"page_size must be a non-negative integer, got {size[:32]!r}")
    return pb.DiagnoseRequest(
        filter=query.get("filter", [""])[0],
        page_token=query.get("page_token", [""])[0],
        page_size=min(int(size), 1 << 31),
    )


def _has_page_token(query: dict[str, list[str]]) -> bool:
    return any(query.get("page_token", []))


def _first_href(query: dict[str, list[str]]) -> str:
    """The page's own query without its page token: the listing from the first page."""
    kept = [(k, v) for k, values in query.items() if k != "page_token" for v in values]
    return "?" + urlencode(kept) if kept else "/"


def _next_href(query: dict[str, list[str]], token: str) -> str:
    """The page's own query with the next token in place of its own."""
    kept = [(k, v) for k, values in query.items() if k != "page_token" for v in values]
    return "?" + urlencode([*kept, ("page_token", token)])


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
    reason = {
        200: "OK",
        303: "See Other",
        400: "Bad Request",
        401: "Unauthorized",
        403: "Forbidden",
        404: "Not Found",
        405: "Method Not Allowed",
    }
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
