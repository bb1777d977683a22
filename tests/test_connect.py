"""Every way a connection can fail ends in its own error within the timeout, 50 times in a row,
and leaves nothing behind in the client process (threads, file descriptors)."""

from __future__ import annotations

import contextlib
import signal
import socket
import threading
import time

import psutil
import pytest
import zmq
from conftest import STRESS, start_server, wait_until
from relay import Relay
from reliability import record

from genie_core.client import Client
from genie_core.errors import AuthenticationError, ConnectionFailed, ConnectionLost

ROUNDS = 50
TIMEOUT = 2.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    plain = start_server(tmp_path_factory.mktemp("plain"))
    c = plain.client()
    plain.data_port = c.node["transport"]["data_port"]  # (the tcp data plane's)
    c.close()
    encrypted = start_server(tmp_path_factory.mktemp("encrypted"), "--encrypt")
    yield plain, encrypted
    plain.stop()
    encrypted.stop()


def _leaks_checked(fn):
    """Threads and open files of this process are the same before and after."""
    me = psutil.Process()
    fn(3)  # warm-up: first imports, lazily made pools
    time.sleep(0.2)
    threads, fds = threading.active_count(), me.num_fds()
    took = fn(ROUNDS)
    deadline = time.monotonic() + 5  # daemon threads of the last attempt are finishing
    while time.monotonic() < deadline and (threading.active_count() > threads or me.num_fds() > fds + 2):
        time.sleep(0.05)
    assert threading.active_count() <= threads, [t.name for t in threading.enumerate()]
    assert me.num_fds() <= fds + 2, f"file descriptors {fds} -> {me.num_fds()}"
    return took


CASES = {
    "wrong token": (AuthenticationError, "token does not match"),
    "encryption required": (AuthenticationError, "requires encryption"),
    "unknown client key": (AuthenticationError, "refused this client's encryption key"),
    "wrong server key": (ConnectionFailed, "does not hold the key"),
    "unreachable": (ConnectionFailed, "connection refused"),
    "the data port by mistake": (ConnectionFailed, "is a genie server's data port, not its control port"),
    "server dies mid-handshake": (ConnectionFailed, "closed the connection during the Genie handshake"),
    # A paused server's kernel accepts connections until its backlog fills, then stops answering SYNs.
    "server paused mid-handshake": (ConnectionFailed, "did not answer the Genie handshake|no answer within"),
}


@pytest.mark.repeat(STRESS)
@pytest.mark.parametrize("case", list(CASES))
def test_each_connect_failure_is_its_own_error_within_the_timeout_50_times(servers, case):
    plain, encrypted = servers
    error, match = CASES[case]
    stranger = dict(encrypted.info.curve)
    stranger["client_public"], stranger["client_secret"] = (k.decode() for k in zmq.curve_keypair())
    impostor = dict(encrypted.info.curve, server_public=zmq.curve_keypair()[0].decode())
    port, token = plain.info.port, plain.info.token
    data_port = plain.data_port

    def connect(i: int) -> None:
        if case == "wrong token":
            Client("127.0.0.1", port, "not-the-token", timeout=TIMEOUT).connect()
        elif case == "encryption required":
            Client("127.0.0.1", encrypted.info.port, encrypted.info.token, timeout=TIMEOUT).connect()
        elif case == "unknown client key":
            Client("127.0.0.1", encrypted.info.port, encrypted.info.token, timeout=TIMEOUT, curve=stranger).connect()
        elif case == "wrong server key":
            Client("127.0.0.1", encrypted.info.port, encrypted.info.token, timeout=TIMEOUT, curve=impostor).connect()
        elif case == "unreachable":
            Client("127.0.0.1", _free_port(), token, timeout=TIMEOUT).connect()
        elif case == "the data port by mistake":
            Client("127.0.0.1", data_port, token, timeout=TIMEOUT).connect()
        elif case == "server dies mid-handshake":
            relay = Relay(port, cut_after=1 + i % 64)  # the server "dies" anywhere in the greeting and handshake
            try:
                Client("127.0.0.1", relay.port, token, timeout=TIMEOUT).connect()
            finally:
                relay.close()
        else:
            Client("127.0.0.1", port, token, timeout=0.1).connect()  # each attempt waits out its timeout

    def rounds(n: int) -> list[float]:
        """n attempts; each must raise `error` (matching) within the timeout."""
        took = []
        for i in range(n):
            start = time.monotonic()
            with pytest.raises(error, match=match):
                connect(i)
            took.append(time.monotonic() - start)
            assert took[-1] < TIMEOUT + 1.0, f"attempt {i} took {took[-1]:.2f} s"
        return took

    if case == "server paused mid-handshake":
        plain.proc.send_signal(signal.SIGSTOP)  # the kernel still accepts; the server never answers
    try:
        took = _leaks_checked(rounds)
    finally:
        if case == "server paused mid-handshake":
            plain.proc.send_signal(signal.SIGCONT)
    record(
        "Connect failures (50 in a row each)",
        case,
        f"{error.__name__} every time; slowest {max(took):.2f} s "
        f"(median {sorted(took)[len(took) // 2]:.3f} s); no thread or file descriptor left behind",
    )
    good = plain.client()  # the server still serves
    assert good.ping() < 1
    good.close()


@contextlib.contextmanager
def _pool_session(tmp_path):
    """A client to a real server, told it is a pool's session on node gpu-node-3/5d2f1a (as
    genie_core.init does when a pool placed it), with the NODE_LOST events it emits."""
    from genie_core.cluster import pooled
    from genie_core.events import EventType

    srv = start_server(tmp_path)
    client = srv.client(heartbeat_interval=0.2, heartbeat_timeout=2.0)
    pooled(client.connection, "gpu-node-3/5d2f1a")
    lost_events: list = []
    client.events.subscribe(lost_events.append, types=[EventType.NODE_LOST])
    try:
        yield srv, client, lost_events
    finally:
        client.close()
        srv.stop()


NODE_LEFT = "node gpu-node-3/5d2f1a left the pool (Ray reports it dead)"


def test_a_lost_pool_session_is_told_once_with_its_node_and_the_one_thing_to_do(tmp_path):
    """A pool session's server closes (its node died): the cell waiting says which node and what to
    do; the pool's notice that follows replaces the reason, with the advice once, and the event
    log has one NODE_LOST for the one loss."""
    from genie_core.cluster import _session_lost

    with _pool_session(tmp_path) as (srv, client, lost_events):
        waiting = client.execute("import time; time.sleep(30)")
        time.sleep(0.5)
        srv.proc.kill()
        with pytest.raises(ConnectionLost) as first:
            waiting.wait(10)
        said = str(first.value)
        assert f"your session on gpu-node-3/5d2f1a (127.0.0.1:{srv.info.port})" in said, said
        assert said.count("%genie_init") == 1 and "placed on another node" in said, said
        _session_lost(client, NODE_LEFT)
        wait_until(lambda: "left the pool" in (client.connection.lost_reason or ""), timeout=5)
        reason = client.connection.lost_reason or ""
        assert reason.startswith("session lost: node gpu-node-3/5d2f1a left the pool"), reason
        assert reason.count("%genie_init") == 1 and "start a new session" not in reason, reason
        time.sleep(0.3)
        assert len(lost_events) == 1, lost_events


def test_a_lost_pool_session_heard_from_the_pool_first_is_one_node_lost_too(tmp_path):
    """The other order: the pool's notice comes before the connection closes."""
    from genie_core.cluster import _session_lost

    with _pool_session(tmp_path) as (srv, client, lost_events):
        _session_lost(client, NODE_LEFT)
        assert wait_until(lambda: client.connection.lost_reason is not None, timeout=5)
        srv.proc.kill()
        time.sleep(1.0)
        reason = client.connection.lost_reason or ""
        assert reason.startswith("session lost: node gpu-node-3/5d2f1a left the pool"), reason
        assert reason.count("%genie_init") == 1, reason
        with pytest.raises(ConnectionLost, match="placed on another node"):
            client.execute("print(1)").wait(5)
        assert len(lost_events) == 1, [e.data for e in lost_events]
