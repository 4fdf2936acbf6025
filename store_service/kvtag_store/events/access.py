"""Who may subscribe: the event sockets are admin-only.

Without tokens the store is open (as its gRPC port is), and its event sockets bind only to loopback
unless --insecure, like --listen. With tokens (--auth-tokens) the sockets speak ZMQ CURVE:
encrypted, and a subscriber is let in only with the subscriber key pair this store made at start-up,
which `/kv_event_sources` hands to admin tokens alone. Events name every tenant's namespaces, and a
ZMQ PUB socket cannot filter what one subscriber receives, so no per-tenant view is offered.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import zmq
import zmq.auth.thread

log = logging.getLogger("kvtag_store.events.access")

ZAP_DOMAIN = "kvtag-events"


class _SubscriberKey:
    """The ZAP credentials check: the one subscriber public key, nothing else."""

    def __init__(self, public_key: bytes) -> None:
        self._public_key = public_key
        self.refused = 0

    def callback(self, domain: str, key: bytes) -> bool:
        allowed = domain == ZAP_DOMAIN and key == self._public_key
        if not allowed:
            self.refused += 1
        return allowed


@dataclass
class CurveAccess:
    """This store's CURVE key pairs (Z85): its server pair and the pair it hands to admins."""

    server_public: bytes = field(default=b"")
    server_secret: bytes = field(default=b"", repr=False)
    subscriber_public: bytes = field(default=b"")
    subscriber_secret: bytes = field(default=b"", repr=False)

    def __post_init__(self) -> None:
        if not self.server_secret:
            self.server_public, self.server_secret = zmq.curve_keypair()
        if not self.subscriber_secret:
            self.subscriber_public, self.subscriber_secret = zmq.curve_keypair()
        self._check = _SubscriberKey(self.subscriber_public)
        self._authenticator: zmq.auth.thread.ThreadAuthenticator | None = None

    @property
    def refused(self) -> int:
        """Handshakes refused (a key other than the subscriber key)."""
        return self._check.refused

    def start(self, context: zmq.Context[zmq.Socket[bytes]]) -> None:
        """Run the ZAP handler of `context` (one per context: the publisher's own)."""
        if not zmq.has("curve"):
            raise OSError("this pyzmq's libzmq has no CURVE support; KV events cannot require tokens")
        self._authenticator = zmq.auth.thread.ThreadAuthenticator(context, log=log)
        self._authenticator.start()
        self._authenticator.configure_curve_callback(ZAP_DOMAIN, credentials_provider=self._check)

    def secure(self, socket: zmq.Socket[bytes]) -> None:
        """Make `socket` a CURVE server checked by the ZAP handler (before it binds)."""
        socket.curve_server = True
        socket.curve_secretkey = self.server_secret
        socket.curve_publickey = self.server_public
        socket.zap_domain = ZAP_DOMAIN.encode()

    def stop(self) -> None:
        if self._authenticator is not None:
            self._authenticator.stop()
            self._authenticator = None

    def for_admins(self) -> dict[str, str]:
        """What `/kv_event_sources` gives an admin: the keys a subscriber sets on its sockets."""
        return {
            "server_public_key": self.server_public.decode(),
            "subscriber_public_key": self.subscriber_public.decode(),
            "subscriber_secret_key": self.subscriber_secret.decode(),
        }


def client_curve(socket: zmq.Socket[bytes], keys: dict[str, str]) -> None:
    """Make `socket` a CURVE client with the keys `/kv_event_sources` gave (before it connects)."""
    socket.curve_serverkey = keys["server_public_key"].encode()
    socket.curve_publickey = keys["subscriber_public_key"].encode()
    socket.curve_secretkey = keys["subscriber_secret_key"].encode()
