"""Who gets in, tested so that each check is the only thing in the way.

Every hostile message goes into a real, open session of a real client: its session id, its own
connection, a sequence number it has not used, so that only the check under test stands between
the message and execution. A message that gets through writes a marker file on the server."""

from __future__ import annotations

import time

import pytest
import zmq

from conftest import run, start_server, stdout_of
from genie_core.client import Client
from genie_core.protocol import Codec, Message, derive_key

LIMIT = 1 << 20  # the server under test refuses messages over 1 MiB


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("admission"), env={"GENIE_MAX_MESSAGE_BYTES": str(LIMIT)})
    yield server
    server.stop()


@pytest.fixture
def victim(srv):
    client = srv.client()
    run(client, "import os")
    yield client
    client.close()


@pytest.fixture
def marker(tmp_path):
    return tmp_path / "ran"


def _code(marker) -> str:
    return f"open({str(marker)!r}, 'a').write('x')"


def _inject(client: Client, msg: Message, codec: Codec | None = None, heartbeat: bool = False, seq: int | None = None,
            session: str | None = None) -> list:
    """Send `msg` on the client's own connection, with its session and its next sequence number
    (or those given), signed by `codec` (default: the right key). Returns the frames sent."""
    sock = client._hb if heartbeat else client._main
    with client._send_locks[sock]:
        msg.session = client.session if session is None else session
        msg.seq = next(client._seq) if seq is None else seq
        frames = (codec or client.codec).pack(msg)
        client._loop.call_soon(lambda: client._loop.send(sock, frames))
    return frames


def _settled(client: Client) -> None:
    """A request sent after the attack on the same connection has been answered: had the attack
    been admitted, its cell would have run before this one."""
    assert stdout_of(run(client, "print('after')")) == "after\n"


def test_the_right_key_on_the_clients_own_connection_runs(victim, marker):
    """The control: the same injection, correctly signed, does run. Every refusal below differs
    from this in one way only."""
    _inject(victim, Message("execute", {"code": _code(marker)}))
    _settled(victim)
    assert marker.read_text() == "x"


def test_a_forged_signature_does_not_run(victim, marker):
    _inject(victim, Message("execute", {"code": _code(marker)}), codec=Codec(derive_key("not-the-token")))
    _settled(victim)
    assert not marker.exists()


def test_an_unsigned_message_does_not_run(victim, marker):
    _inject(victim, Message("execute", {"code": _code(marker)}), codec=Codec(None))
    _settled(victim)
    assert not marker.exists()


def test_a_message_with_a_tampered_buffer_does_not_run(victim, marker):
    """Buffers are signed too: the same message with one byte of a buffer changed is refused."""
    msg = Message("execute", {"code": _code(marker)}, [b"payload"], session=victim.session)
    with victim._send_locks[victim._main]:
        msg.seq = next(victim._seq)
        frames = victim.codec.pack(msg)
        tampered = [*frames[:-1], b"pAyload"]
        victim._loop.call_soon(lambda: victim._loop.send(victim._main, tampered))
    _settled(victim)
    assert not marker.exists()


def test_a_replayed_message_runs_once(victim, marker):
    frames = _inject(victim, Message("execute", {"code": _code(marker)}))
    _settled(victim)
    victim._loop.call_soon(lambda: victim._loop.send(victim._main, frames))  # the same bytes again
    _settled(victim)
    assert marker.read_text() == "x"


def test_an_old_sequence_number_with_a_fresh_signature_does_not_run(victim, marker):
    """Not a byte-for-byte replay: a new, validly signed message whose sequence number is not
    above the last one from this connection."""
    _settled(victim)
    _inject(victim, Message("execute", {"code": _code(marker)}), seq=1)
    _settled(victim)
    assert not marker.exists()


def test_another_clients_session_cannot_be_used(srv, victim, marker):
    """A second client, holding the token, names the victim's session on its own connection."""
    intruder = srv.client()
    try:
        _inject(intruder, Message("execute", {"code": _code(marker)}), session=victim.session)
        _inject(intruder, Message("pull", {"names": ["os"]}), session=victim.session)
        _settled(intruder)
        _settled(victim)
        assert not marker.exists()
    finally:
        intruder.close()


def test_the_heartbeat_connection_may_only_ping(victim, marker):
    _inject(victim, Message("execute", {"code": _code(marker)}), heartbeat=True)
    _settled(victim)
    assert not marker.exists()
    assert victim.ping() < 1  # and pings on it still work


@pytest.mark.parametrize("kind", ["event", "metrics", "ready", "welcome", "execute_reply", "reading", "client_readable",
                                  "close_session", "housekeeping", "__init__", ""])
def test_types_a_client_may_not_send_are_refused_with_one_error(victim, kind):
    """Internal names (the server once dispatched on `_on_<type>`) and server-only types."""
    request = victim._request(Message(kind, {"code": "1"}))
    with pytest.raises(Exception, match="unknown request type"):
        request.wait(5)
    _settled(victim)


def test_an_oversized_message_does_not_run_and_the_client_carries_on(victim, marker):
    """Each frame under the limit, all of them over it: only the codec's total stands in the way."""
    buffers = [bytes(LIMIT // 4)] * 5
    _inject(victim, Message("execute", {"code": _code(marker)}, buffers))
    _settled(victim)
    assert not marker.exists()


def test_one_oversized_frame_drops_only_that_connection(victim, marker):
    """A frame over the limit: zmq drops the connection. What was in flight on it fails at once
    (ConnectionLost, never a hang), and the client carries on once zmq has reconnected."""
    from conftest import wait_until
    from genie_core.errors import ConnectionLost

    _inject(victim, Message("execute", {"code": _code(marker)}, [bytes(LIMIT + 1)]))
    with pytest.raises(ConnectionLost, match="lost"):  # when sent, or while it waits for its reply
        victim.execute("import time; time.sleep(1)").wait(10)

    def usable() -> bool:
        try:
            return stdout_of(run(victim, "print('after')", timeout=5)) == "after\n"
        except ConnectionLost:
            return False

    assert wait_until(usable, timeout=10, interval=0.2)
    assert not marker.exists()


def test_the_client_refuses_to_send_more_than_the_server_takes(victim):
    """Said before sending, instead of having the connection dropped."""
    from genie_core.errors import LimitExceeded

    with pytest.raises(LimitExceeded, match="over the 1.0 MiB the server"):
        victim.execute("x = 1  # " + "y" * LIMIT)
    _settled(victim)


def test_a_worker_cannot_send_what_only_the_server_sends(victim):
    """User code runs in the worker and can reach its socket; the server takes from a worker
    only what workers send. A forged terminal reply would end the cell early."""
    code = (
        "import gc\nfrom genie_core.worker.main import Worker\nfrom genie_core.protocol import Message\n"
        "w = next(o for o in gc.get_objects() if isinstance(o, Worker))\n"
        "for kind in ('welcome', 'event', 'pong', 'outcome_reply'):\n"
        "    w.send(kind, {'forged': True})\n"
        "import time; time.sleep(0.5)\nprint('finished')"
    )
    replies = run(victim, code)
    assert [t for t, _ in replies][-1] == "execute_reply"
    assert stdout_of(replies) == "finished\n"
    assert not any(c.get("forged") for _, c in replies)


def test_a_raw_socket_without_a_session_gets_nothing(srv, marker):
    """No hello, a made-up session: refused before anything else is looked at."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{srv.info.port}")
    codec = Codec(derive_key(srv.info.token))
    sock.send_multipart(codec.pack(Message("execute", {"code": _code(marker)}, session="made-up", seq=1)))
    assert sock.poll(5000)
    reply = codec.unpack(sock.recv_multipart())
    assert reply.type == "error_reply" and reply.content["ename"] == "SessionNotFound"
    sock.close()
    ctx.term()
    assert not marker.exists()
