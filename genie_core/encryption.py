"""`genie serve --encrypt`: CurveZMQ on the control connection.

The server makes a key pair for itself and one for its clients. The connection file carries the
server's public key and the client pair (whoever holds the file holds the token too); the
server's secret key never leaves its process. A ZAP handler admits only the client keys the
server issued, so a connection without them fails during the handshake, before any message.
"""

from __future__ import annotations

import logging
from typing import Any

import zmq

log = logging.getLogger("genie.encryption")

ZAP_DOMAIN = "genie"


class Keys:
    """The server's key pair and the client pair it issues (z85 text, as zmq wants them)."""

    def __init__(self) -> None:
        if not zmq.has("curve"):
            from .errors import ConfigError

            raise ConfigError("--encrypt needs libzmq built with CURVE support, which this pyzmq lacks")
        self.server_public, self.server_secret = (k.decode() for k in zmq.curve_keypair())
        self.client_public, self.client_secret = (k.decode() for k in zmq.curve_keypair())

    def for_clients(self) -> dict[str, str]:
        """What goes into the connection file: everything except the server's secret."""
        return {
            "server_public": self.server_public,
            "client_public": self.client_public,
            "client_secret": self.client_secret,
        }


class KeyGate:
    """The server's ZAP handler: admits the client keys it issued and counts the rest."""

    def __init__(self, ctx: zmq.Context[Any], allowed: set[str]) -> None:
        from zmq.auth.thread import ThreadAuthenticator

        self.allowed = set(allowed)
        self.refused = 0
        self._auth = ThreadAuthenticator(ctx, log=logging.getLogger("genie.zap"))
        self._auth.start()
        self._auth.configure_curve_callback(domain=ZAP_DOMAIN, credentials_provider=self)

    def callback(self, domain: str, key: bytes) -> bool:  # called by zmq.auth for each CURVE handshake
        text = key.decode() if isinstance(key, bytes) else str(key)
        if text in self.allowed:
            return True
        self.refused += 1
        log.warning("refused a connection with an unknown CURVE client key %s...", text[:8])
        return False

    def stop(self) -> None:
        self._auth.stop()


def secure_server(sock: zmq.Socket[Any], keys: Keys) -> None:
    """Make a listening socket a CURVE server whose clients pass the ZAP handler."""
    sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
    sock.curve_secretkey = keys.server_secret.encode()
    sock.curve_publickey = keys.server_public.encode()
    sock.curve_server = True


def secure_client(sock: zmq.Socket[Any], curve: dict[str, Any]) -> None:
    """Make a connecting socket a CURVE client of the server named in `curve` (from a connection file)."""
    sock.curve_serverkey = str(curve["server_public"]).encode()
    sock.curve_publickey = str(curve["client_public"]).encode()
    sock.curve_secretkey = str(curve["client_secret"]).encode()
