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
from genie_core.errors import ProtocolError
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


def _inject(
    client: Client,
    msg: Message,
    codec: Codec | None = None,
    heartbeat: bool = False,
    seq: int | None = None,
    session: str | None = None,
) -> list:
    """Send `msg` on the client's own connection, with its session and its next sequence number
    (or those given), signed by `codec` (default: the right key). Returns the frames sent."""
    c = client.connection
    sock = c.heartbeat if heartbeat else c.main
    with c._send_locks[sock]:
        msg.session = client.session if session is None else session
        msg.seq = next(c._seq) if seq is None else seq
        frames = (codec or c.codec).pack(msg)
        c._loop.call_soon(lambda: c._loop.send(sock, frames))
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
    c = victim.connection
    msg = Message("execute", {"code": _code(marker)}, [b"payload"], session=victim.session)
    with c._send_locks[c.main]:
        msg.seq = next(c._seq)
        frames = c.codec.pack(msg)
        tampered = [*frames[:-1], b"pAyload"]
        c._loop.call_soon(lambda: c._loop.send(c.main, tampered))
    _settled(victim)
    assert not marker.exists()


class _WrongSigner(Codec):
    """Signs what it packs wrongly, as if a buffer changed after signing; reads replies rightly."""

    def pack(self, msg: Message) -> list:
        frames = super().pack(msg)
        frames[1] = b"0" * len(frames[1])
        return frames


def test_a_request_refused_for_its_signature_is_answered_not_left_waiting(victim, marker):
    """A request on the client's own connection whose bytes no longer match its signature ends in
    one error within seconds instead of a wait with no end; nothing of it runs, and the session
    goes on (its sequence number was not taken)."""
    c = victim.connection
    right = c.codec
    c.codec = _WrongSigner(right.key)
    try:
        request = victim.execute(_code(marker))
    finally:
        c.codec = right
    with pytest.raises(ProtocolError, match="signature does not match its bytes"):
        request.wait(10)
    _settled(victim)
    _inject(victim, Message("execute", {"code": _code(marker)}), codec=_WrongSigner(right.key), seq=10**9)
    _settled(victim)  # (had the refused one's sequence number been taken, this would be a replay)
    assert not marker.exists()


def test_a_wrongly_signed_request_with_a_header_past_its_bound_gets_no_answer(victim, marker):
    """To answer a refused request the server reads its unverified header, and only one of at most
    4 KiB (a real header is about 200 bytes): past that, nothing is parsed and nothing answered."""
    heard: list[Message] = []
    victim.connection.on_orphan = heard.append
    msg = Message("execute", {"code": _code(marker)}, id="x" * 5000)
    _inject(victim, msg, codec=_WrongSigner(victim.connection.codec.key))
    _settled(victim)
    assert [m for m in heard if m.parent == msg.id] == []
    assert not marker.exists()


def test_a_request_refused_for_its_signature_is_answered_on_the_sessions_own_connection_only(srv, victim, marker):
    """The same wrongly signed request naming the victim's session from another client's connection
    gets no answer there (an answer would tell it the session exists), and does not run."""
    intruder = srv.client()
    try:
        heard: list[Message] = []
        intruder.connection.on_orphan = heard.append
        msg = Message("execute", {"code": _code(marker)})
        _inject(intruder, msg, codec=_WrongSigner(intruder.connection.codec.key), session=victim.session)
        _settled(intruder)  # (an answer to the refused one would have come first: one connection, in order)
        _settled(victim)
        assert [m for m in heard if m.parent == msg.id] == []
        assert not marker.exists()
    finally:
        intruder.close()


def test_a_replayed_message_runs_once(victim, marker):
    frames = _inject(victim, Message("execute", {"code": _code(marker)}))
    _settled(victim)
    c = victim.connection
    c._loop.call_soon(lambda: c._loop.send(c.main, frames))  # the same bytes again
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
    pong = victim.connection.request(Message("ping"), heartbeat=True).wait(5)  # and pings on it are answered there
    assert pong.type == "pong"


def test_a_ping_from_a_connection_that_is_not_the_sessions_gets_no_answer(srv, victim):
    """Only the session's two connections are its peers: another connection holding the token
    cannot even ping in its name (its identity is ordered below any, to catch a loose match)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, b"\x01")
    sock.connect(f"tcp://127.0.0.1:{srv.info.port}")
    codec = Codec(derive_key(srv.info.token))
    try:
        ping = Message("ping", session=victim.session, seq=10**9)
        sock.send_multipart(codec.pack(ping))
        answers = []
        deadline = time.monotonic() + 1.5
        while (left := deadline - time.monotonic()) > 0 and sock.poll(int(left * 1000) + 1):
            answers.append(codec.unpack(sock.recv_multipart(), verify=False).type)
        assert answers == []
        assert victim.ping() < 1  # the session itself is untouched
    finally:
        sock.close()
        ctx.term()


@pytest.mark.parametrize(
    "kind",
    [
        "event",
        "metrics",
        "ready",
        "welcome",
        "execute_reply",
        "reading",
        "client_readable",
        "close_session",
        "housekeeping",
        "__init__",
        "",
    ],
)
def test_types_a_client_may_not_send_are_refused_with_one_error(victim, kind):
    """Internal names (the server once dispatched on `_on_<type>`) and server-only types."""
    request = victim.request(Message(kind, {"code": "1"}))
    with pytest.raises(Exception, match="unknown request type"):
        request.wait(5)
    _settled(victim)


def test_an_oversized_message_does_not_run_and_the_client_carries_on(victim, marker):
    """Each frame under the limit, all of them over it: only the codec's total stands in the way."""
    buffers = [bytes(LIMIT // 4)] * 5
    _inject(victim, Message("execute", {"code": _code(marker)}, buffers))
    _settled(victim)
    assert not marker.exists()


def test_only_a_bad_signature_is_answered_as_one(victim, marker):
    """The answer to a refused request says its signature did not match: a message refused for
    anything else (here its size, its signature right) on the same connection gets none."""
    heard: list[Message] = []
    victim.connection.on_orphan = heard.append
    msg = Message("execute", {"code": _code(marker)}, [bytes(LIMIT // 4)] * 5)
    _inject(victim, msg)
    _settled(victim)
    assert [m for m in heard if m.parent == msg.id] == []
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

    with pytest.raises(LimitExceeded, match=r"over the 1\.0 MiB the server"):
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


def test_a_big_message_and_the_small_ones_behind_it_all_arrive_in_order(tmp_path):
    """Signatures of big messages are checked off the loop thread; what the same connection
    sends meanwhile waits its turn, and then goes on (in order)."""
    from genie_core.serialize import serialize_namespace

    own = start_server(tmp_path)  # the module's server takes 1 MiB at most
    client = own.client()
    try:
        metas, buffers = serialize_namespace({"big": bytearray(12 << 20)})  # 12 MiB on this connection
        pushed = client.request(Message("push", {"values": metas}, buffers))
        cells = [client.execute(f"print(len(big) + {i})") for i in range(3)]
        assert pushed.wait(30).content["status"] == "ok"
        assert [stdout_of([(m.type, m.content) for m in c.replies(30)]) for c in cells] == [
            f"{(12 << 20) + i}\n" for i in range(3)
        ]
    finally:
        client.close()
        own.stop()


def test_a_wrong_token_is_told_at_once_and_a_forged_request_gets_no_answer(srv):
    """The hello of a wrong token gets an (unsigned) auth_failed, so the client need not wait
    for its timeout; a forged request of any other type gets nothing at all."""
    from genie_core.errors import AuthenticationError

    start = time.monotonic()
    with pytest.raises(AuthenticationError, match="token does not match"):
        Client("127.0.0.1", srv.info.port, "not-the-token", timeout=10).connect()
    assert time.monotonic() - start < 2
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{srv.info.port}")
    wrong = Codec(derive_key("not-the-token"))
    try:
        for kind in ("execute", "ping", "info", "close"):
            sock.send_multipart(wrong.pack(Message(kind, session="s", seq=1)))
        assert not sock.poll(500), "a forged request was answered"
        sock.send_multipart(wrong.pack(Message("hello", seq=1)))
        assert sock.poll(5000)
        assert Codec(None).unpack(sock.recv_multipart(), verify=False).type == "auth_failed"
    finally:
        sock.close()
        ctx.term()


def test_a_request_id_seen_before_runs_at_most_once_whatever_its_sequence_number(victim, marker):
    first = _inject(victim, Message("execute", {"code": _code(marker)}, id="fixed-id-0123456789ab"))
    _settled(victim)
    again = victim.request(Message("execute", {"code": _code(marker)}, id="fixed-id-0123456789ab"))
    with pytest.raises(Exception, match="DuplicateRequest"):
        again.wait(10)
    assert marker.read_text() == "x" and first


def test_a_replayed_request_that_does_not_run_code_is_refused_too(srv):
    """Replays are refused by their sequence number, not only by the at-most-once record of
    requests that run: a captured `info` answered twice would leak twice."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{srv.info.port}")
    codec = Codec(derive_key(srv.info.token))
    try:
        sock.send_multipart(codec.pack(Message("hello", seq=1)))
        assert sock.poll(5000)
        session = codec.unpack(sock.recv_multipart()).content["session"]
        info = Message("info", session=session, seq=2)
        frames = codec.pack(info)
        sock.send_multipart(frames)
        sock.send_multipart(frames)
        replies = []
        deadline = time.monotonic() + 2.0  # the one answer comes in milliseconds; a second would follow it
        while (left := deadline - time.monotonic()) > 0 and sock.poll(int(left * 1000) + 1):
            reply = codec.unpack(sock.recv_multipart())
            if reply.parent == info.id:  # (metric snapshots arrive here too, so a quiet socket cannot end the wait)
                replies.append(reply.type)
        assert replies == ["info_reply"]
    finally:
        sock.close()
        ctx.term()


def test_the_record_of_an_ended_session_answers_only_its_own_connection(tmp_path):
    """A session that ended while its client was away (the lease ran out) still answers that
    client's "did it run?"; another connection naming it gets nothing from it."""
    from conftest import wait_until

    short = start_server(tmp_path, env={"GENIE_SESSION_LEASE": "2"})
    away = short.client(enable_heartbeat=False)
    watcher = short.client(heartbeat_interval=0.25)  # it outlives the lease however loaded the machine is
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{short.info.port}")
    codec = Codec(derive_key(short.info.token))
    try:
        cell = away.execute("print('ran')")
        # Until it has run, `away` pings as a heartbeat would: the cell's worker may take longer
        # than the 2 s lease to start on a loaded machine, and a session that ends mid-cell has no
        # record of its outcome to test.
        for _ in range(100):
            try:
                cell.wait(0.3)
                break
            except TimeoutError:
                away.request(Message("ping")).wait(5)
        assert cell.done
        assert wait_until(lambda: all(s["id"] != away.session[:8] for s in watcher.info()["sessions"]), timeout=10)
        outcome = away.request(Message("outcome", {"ids": [cell.id]})).wait(10).content["outcomes"][cell.id]
        assert outcome["state"] == "finished" and outcome["status"] == "ok"
        sock.send_multipart(codec.pack(Message("outcome", {"ids": [cell.id]}, session=away.session, seq=1)))
        assert sock.poll(5000)
        reply = codec.unpack(sock.recv_multipart())
        assert reply.type == "error_reply" and reply.content["ename"] == "SessionNotFound"
    finally:
        sock.close()
        ctx.term()
        away.close(notify=False)
        watcher.close()
        short.stop()


def test_the_server_lists_this_session(srv, victim):
    sessions = [s for s in victim.info()["sessions"] if s["id"] == victim.session[:8]]
    assert len(sessions) == 1 and 0 <= sessions[0]["idle_s"] < 60


def test_the_records_of_ended_sessions_keep_the_newest():
    """The server keeps the request records of the last ENDED_REMEMBERED sessions that ended (to
    answer "did it run?" from a client that was away): the oldest go first, never the newest."""
    from genie_core.server.sessions import ENDED_REMEMBERED, SessionTable

    table = SessionTable()
    ended = []
    for i in range(ENDED_REMEMBERED + 1):
        session, _ = table.open(i.to_bytes(4, "big"), Message("hello", seq=1), lambda: 0)
        table.end(session, "the client left")
        ended.append(session.id)
    assert ended[0] not in table.ended
    assert all(session_id in table.ended for session_id in ended[1:])


@pytest.mark.parametrize("replay", ["the same hello again", "a hello stamped 10 minutes ago"])
def test_a_replayed_or_stale_hello_gets_no_welcome(srv, replay):
    """A recorded hello replayed later could take a named session over: a hello is taken once,
    and only near the time it says it was sent."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{srv.info.port}")
    codec = Codec(derive_key(srv.info.token))
    hello = Message("hello", {"client": {"user": "replay-test"}}, seq=1)

    def welcomes(seconds: float) -> list[str]:
        """Welcomes answering `hello`s within `seconds` (a session also gets readings meanwhile)."""
        got, deadline = [], time.monotonic() + seconds
        while sock.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            reply = codec.unpack(sock.recv_multipart())
            if reply.type == "welcome":
                got.append(reply.parent)
        return got

    try:
        if replay == "the same hello again":
            sock.send_multipart(codec.pack(hello))
            assert welcomes(2) == [hello.id]
        else:
            hello.time -= 600
        sock.send_multipart(codec.pack(hello))
        assert welcomes(1) == [], "the hello was answered"
        fresh = Message("hello", {"client": {"user": "replay-test"}}, seq=2)
        sock.send_multipart(codec.pack(fresh))  # a new hello on the same connection is still welcome
        assert welcomes(3) == [fresh.id]
    finally:
        sock.close()
        ctx.term()
