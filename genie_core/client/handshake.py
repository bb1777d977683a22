"""What can go wrong before a session exists, said plainly: nothing listens, something other than
a genie server answers (its data port, another protocol version, not ZMTP at all), encryption
differs, the token is wrong. zmq itself would retry silently until the timeout."""

from __future__ import annotations

import json
import socket
import time
from typing import Any

import zmq

from ..dataplane.wire import GREETING as DATA_GREETING
from ..errors import AuthenticationError, ConnectionFailed, GenieError
from ..versions import compare, local_versions

# The start of a ZMTP 3 greeting (signature, major version): a ZMTP server answers it with its
# whole 64-byte greeting, which names its security mechanism at bytes 12-31.
ZMTP_SIGNATURE = b"\xff" + bytes(8) + b"\x7f\x03"
GREETING_BYTES = 64
HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


def unanswered(address: str, timeout: float) -> ConnectionFailed:
    return ConnectionFailed(
        f"the server at {address} accepted a TCP connection but did not answer the Genie handshake "
        f"within {timeout:g} s: is a genie server (protocol genie/4) listening there?"
    )


def closed_in_handshake(address: str) -> ConnectionFailed:
    return ConnectionFailed(
        f"the server at {address} closed the connection during the Genie handshake "
        "(it stopped or crashed, or it is not a genie server)"
    )


def data_port_given(host: str, port: int) -> ConnectionFailed:
    """Someone gave a server's data port (the tcp data plane's) where its control port goes."""
    return ConnectionFailed(
        f"{host}:{port} is a genie server's data port, not its control port: connect to the port on "
        f"`genie serve`'s ready line (with a fixed --port the data port is the next one up, so "
        f"{host}:{port - 1})"
    )


def probe_server(host: str, port: int, timeout: float, encrypted: bool) -> None:
    """Fail fast, with the reason, when nothing listens, something other than ZMTP answers, or
    the server's encryption differs from ours. Sends only the start of a greeting, and reads the
    server's, which names its security mechanism."""
    address = f"{host}:{port}"
    where = f"a genie server at {address}"
    deadline = time.monotonic() + timeout
    connected = False
    greeting = b""
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            connected = True
            sock.sendall(ZMTP_SIGNATURE)
            while len(greeting) < GREETING_BYTES:
                sock.settimeout(max(deadline - time.monotonic(), 0.001))
                chunk = sock.recv(GREETING_BYTES - len(greeting))
                if not chunk:
                    break
                greeting += chunk
    except ConnectionRefusedError:
        raise ConnectionFailed(
            f"could not connect to {where}: connection refused (is `genie serve` running there?)"
        ) from None
    except socket.gaierror as exc:
        raise ConnectionFailed(f"could not connect to {where}: unknown host ({exc.strerror})") from None
    except TimeoutError:
        if connected:
            raise unanswered(address, timeout) from None
        raise ConnectionFailed(f"could not connect to {where}: no answer within {timeout:g} s") from None
    except OSError as exc:
        if greeting and greeting.startswith(DATA_GREETING[: len(greeting)]):
            raise data_port_given(host, port) from None
        raise ConnectionFailed(f"could not connect to {where}: {exc.strerror or exc}") from None
    if greeting and greeting.startswith(DATA_GREETING[: len(greeting)]):
        raise data_port_given(host, port)
    if len(greeting) < GREETING_BYTES:
        raise closed_in_handshake(address)
    if greeting[0] != 0xFF or greeting[9] != 0x7F:
        raise ConnectionFailed(f"the server at {address} does not speak ZMTP: is a genie server listening there?")
    mechanism = greeting[12:32].rstrip(b"\0")
    if mechanism == b"CURVE" and not encrypted:
        raise AuthenticationError(
            f"the server at {address} requires encryption (genie serve --encrypt): connect with its "
            "connection file (--connection-file), which holds the keys"
        )
    if mechanism == b"NULL" and encrypted:
        raise ConnectionFailed(
            f"the server at {address} does not encrypt (it was started without --encrypt), "
            "but the connection file holds encryption keys: use its current connection file"
        )


def handshake_failed(kind: int, value: int, address: str, encrypted: bool) -> GenieError:
    """Why the handshake failed, from the control socket's monitor event."""
    if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return AuthenticationError(
            f"the server at {address} refused this client's encryption key: use the connection file "
            "the server wrote this time it started (`genie serve --encrypt` makes new keys at each start)"
        )
    if kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        return ConnectionFailed(
            f"the handshake with {address} broke the ZMTP protocol (error {value:#x}): "
            "is a genie server listening there?"
        )
    if encrypted:  # the server drops a client whose key exchange it cannot read
        return ConnectionFailed(
            f"the encryption handshake with {address} failed: the server there does not hold "
            "the key in the connection file (a stale file, or someone in between), or it "
            "stopped during the handshake"
        )
    return closed_in_handshake(address)


def wrong_token(address: str) -> AuthenticationError:
    return AuthenticationError(
        f"authentication failed: the token does not match the server at {address} "
        "(see the `genie serve` output or its connection file)"
    )


def version_problems(frame: Any, address: str) -> list[str]:
    """What keeps us from a server that answered in the version-neutral frame (another protocol
    version); [] when the answer cannot be read."""
    try:
        theirs = {str(k): str(v) for k, v in dict(json.loads(bytes(frame))).items()}
        mine = local_versions()
        return compare(mine, {**mine, **theirs}, address).errors  # the answer names only the protocol and Genie
    except (ValueError, TypeError):
        return []
