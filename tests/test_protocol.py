"""Message signing covers header, content and buffers; anything altered is refused."""

import pytest

from genie_core.errors import ProtocolError
from genie_core.protocol import Codec, Message, derive_key


def test_round_trip_keeps_content_and_buffers():
    codec = Codec(derive_key("secret"))
    msg = Message(
        "execute", {"code": "x = 1"}, [b"\x00\x01raw", memoryview(bytearray(b"abc"))], parent="p", session="s", seq=7
    )
    out = codec.unpack(codec.pack(msg))
    assert (out.type, out.content, out.parent, out.session, out.seq, out.id) == (
        "execute",
        {"code": "x = 1"},
        "p",
        "s",
        7,
        msg.id,
    )
    assert [bytes(b) for b in out.buffers] == [b"\x00\x01raw", b"abc"]


@pytest.mark.parametrize("index", [2, 3, 4], ids=["header", "content", "buffer"])
def test_any_altered_frame_is_refused(index):
    codec = Codec(derive_key("secret"))
    frames = codec.pack(Message("execute", {"code": "x = 1"}, [b"payload"]))
    frames[index] = bytes(frames[index]).replace(b"1", b"2").replace(b"payload", b"paylo4d")
    with pytest.raises(ProtocolError, match="bad signature"):
        codec.unpack(frames)


def test_wrong_key_and_unsigned_messages_are_refused():
    frames = Codec(derive_key("other")).pack(Message("execute", {"code": "1"}))
    with pytest.raises(ProtocolError):
        Codec(derive_key("secret")).unpack(frames)
    with pytest.raises(ProtocolError):
        Codec(derive_key("secret")).unpack(Codec(None).pack(Message("execute")))


HEADER = b'{"id":"i","type":"ping","parent":"","session":"s","seq":1,"time":0.0}'


@pytest.mark.parametrize(
    "frames, why",
    [
        ([], "frames"),
        ([b"genie/4"], "frames"),
        ([b"genie/4", b"", HEADER], "frames"),
        ([b"nope/9", b"", HEADER, b"{}"], "unknown protocol"),
        ([b"genie/1", b"", HEADER, b"{}"], "unknown protocol"),
        ([b"a", b"", HEADER, b"{}"], "unknown protocol"),
        ([b"zzzzzzz", b"", HEADER, b"{}"], "unknown protocol"),
        ([b"genie/4", b"", b"not json", b"{}"], "malformed"),
        ([b"genie/4", b"", b"[]", b"{}"], "malformed"),
        ([b"genie/4", b"", HEADER, b"[]"], "malformed"),
        ([b"genie/4", b"", HEADER.replace(b',"seq":1', b""), b"{}"], "malformed"),  # every header field is required
        ([b"genie/4", b"", HEADER.replace(b',"time":0.0', b""), b"{}"], "malformed"),
        ([b"genie/4", b"", HEADER.replace(b'"seq":1', b'"seq":"x"'), b"{}"], "malformed"),
    ],
)
def test_malformed_messages_raise_protocol_error(frames, why):
    with pytest.raises(ProtocolError, match=why):
        Codec(None).unpack(frames)


def test_buffers_of_any_item_size_are_signed_and_sent_as_bytes():
    """A float32 array's memoryview counts 4-byte items; the codec signs and sends bytes."""
    import numpy as np

    codec = Codec(derive_key("secret"))
    values = np.arange(10, dtype=np.float32)
    out = codec.unpack(codec.pack(Message("push", {}, [memoryview(values), values.data])))
    assert [bytes(b) for b in out.buffers] == [values.tobytes()] * 2


def test_routing_identities_are_split_from_the_message():
    """The server's ROUTER puts one identity frame first; an identity of 7 bytes (the tag's
    length) must not be taken for the tag, as zmq frames or as bytes."""
    import zmq

    from genie_core.protocol import PROTOCOL, split_identities

    for make in (zmq.Frame, bytes):
        for ident in (b"7-bytes", b"x", b"a" * 16, PROTOCOL[::-1]):
            idents, body = split_identities([make(ident), make(PROTOCOL), make(b"sig"), make(bytes(1 << 20))])
            assert [bytes(i) for i in idents] == [ident] and bytes(body[0]) == PROTOCOL and len(body) == 3
    with pytest.raises(ProtocolError, match="no protocol tag"):
        split_identities([b"ident", b"genie/9", b"x"])


def test_size_cap():
    codec = Codec(derive_key("k"), max_bytes=1000)
    with pytest.raises(ProtocolError, match="larger"):
        codec.unpack(codec.pack(Message("push", {}, [b"x" * 2000])))


def test_key_is_not_the_token():
    assert derive_key("secret") != b"secret" and len(derive_key("secret")) == 32


def test_a_large_buffer_altered_in_any_chunk_is_refused():
    """Buffers are signed by their 4 MiB chunks (a large one by GMAC tags, a small one by its
    digest): flipping one byte in any chunk, moving bytes between buffers, or swapping two buffers of
    one size breaks the signature."""
    import os

    codec = Codec(os.urandom(32))
    data = bytearray(os.urandom(1024)) * (20 * 1024)  # 20 MiB: five chunks
    frames = codec.pack(Message("push", {}, [data, b"tail"]))
    assert bytes(codec.unpack(frames).buffers[0]) == bytes(data)
    for where in (0, (4 << 20) + 7, len(data) - 1):
        changed = bytearray(data)
        changed[where] ^= 1
        with pytest.raises(ProtocolError, match="bad signature"):
            codec.unpack([*frames[:4], changed, frames[5]])
    with pytest.raises(ProtocolError, match="bad signature"):  # same bytes, another split
        codec.unpack([*frames[:4], bytes(data) + b"t", b"ail"])
    first, second = os.urandom(2 << 20), os.urandom(2 << 20)
    frames = codec.pack(Message("push", {}, [first, second]))
    assert bytes(codec.unpack(frames).buffers[1]) == second
    with pytest.raises(ProtocolError, match="bad signature"):
        codec.unpack([*frames[:4], second, first])


def test_equal_chunks_and_equal_buffers_are_tagged_under_nonces_of_their_own():
    """A GCM key must never tag under one nonce twice: two equal chunks of a buffer, and equal
    buffers at two places of a message, get different tags."""
    import os

    from genie_core.protocol.codec import CHUNK, gmac, gmac_tags

    tagger, chunks = gmac(os.urandom(32)), bytes(2 * CHUNK)
    tags = gmac_tags(tagger, (2).to_bytes(4, "big"), chunks)
    assert len(tags) == 32 and tags[:16] != tags[16:]
    assert gmac_tags(tagger, (3).to_bytes(4, "big"), chunks) != tags


def test_values_the_client_did_not_ask_to_unpickle_are_refused():
    from genie_core.serialize import deserialize_namespace, serialize_namespace

    metas, buffers = serialize_namespace({"n": 3, "x": 2.5, "s": "ok", "none": None, "flag": True})
    assert all(m["kind"] == "plain" for m in metas) and buffers == []  # plain values travel as JSON
    assert deserialize_namespace(metas, buffers, allow_pickle=False) == {
        "n": 3,
        "x": 2.5,
        "s": "ok",
        "none": None,
        "flag": True,
    }
    metas, buffers = serialize_namespace({"evil": {"a": 1}})
    assert metas[0]["kind"] == "pickle"
    with pytest.raises(ProtocolError, match="refused a pickled object for 'evil'"):
        deserialize_namespace(metas, buffers, allow_pickle=False)
    assert deserialize_namespace(metas, buffers) == {"evil": {"a": 1}}  # a pull the user asked for


def test_the_wire_format_is_fixed_known_answers():
    """genie/4 as documented in protocol/codec.py, computed here from scratch: the key is
    HMAC-SHA256(token, context); the signature is HMAC-SHA256 over each part's length (8 bytes,
    little-endian) and then the part itself (header, content), or for a buffer the SHA-256 digests
    of its 4 MiB chunks (under 1 MiB) or their GMAC tags (from 1 MiB: AES-256-GCM over no plaintext,
    the key HMAC-SHA256(signing key, context + header), the nonce the part's number in 4 bytes and
    the chunk's in 8). A change to any of it breaks every client and server of another version."""
    import hashlib
    import hmac

    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    key = derive_key("known-answer-token")
    assert key == hmac.new(b"known-answer-token", b"genie message signing v1", hashlib.sha256).digest()
    assert key.hex() == "0d9228c02d8fc77322ce7d5b536943131c38edebd536242618aee149a5803780"
    big = bytes(range(256)) * (9 * 4096)  # 9 MiB: chunks of 4, 4 and 1 MiB
    edge = big[: 1 << 20]  # the smallest buffer tagged, and the largest one hashed
    msg = Message(
        "execute",
        {"code": "x = 1"},
        [big, b"tail", edge, edge[:-1]],
        parent="p",
        session="s",
        seq=7,
        id="0123456789abcdef01234567",
        time=1700000000.0,
    )
    frames = Codec(key).pack(msg)
    header = (
        b'{"id":"0123456789abcdef01234567","type":"execute","parent":"p","session":"s","seq":7,"time":1700000000.0}'
    )
    assert bytes(frames[0]) == b"genie/4" and bytes(frames[2]) == header and bytes(frames[3]) == b'{"code":"x = 1"}'
    mac = hmac.new(key, digestmod=hashlib.sha256)
    for part in (header, b'{"code":"x = 1"}'):
        mac.update(len(part).to_bytes(8, "little") + part)
    gmac = AESGCM(hmac.new(key, b"genie message buffers gmac\0" + header, hashlib.sha256).digest())

    def tags(place: int, part: bytes) -> bytes:
        return b"".join(
            gmac.encrypt(place.to_bytes(4, "big") + n.to_bytes(8, "big"), b"", part[i : i + (4 << 20)])
            for n, i in enumerate(range(0, len(part), 4 << 20))
        )

    mac.update(len(big).to_bytes(8, "little") + tags(2, big))
    mac.update((4).to_bytes(8, "little") + hashlib.sha256(b"tail").digest())
    mac.update(len(edge).to_bytes(8, "little") + tags(4, edge))
    mac.update((len(edge) - 1).to_bytes(8, "little") + hashlib.sha256(edge[:-1]).digest())
    assert bytes(frames[1]) == mac.hexdigest().encode()
    assert bytes(frames[1]) == b"e272047bcc1ed52dd7624f48cfe2e866b100641477448b7f1e58230dfdfd3dac"


def test_the_message_table_says_who_sends_what():
    """Spot checks of the one table every side reads (genie_core/protocol/messages.py)."""
    from genie_core.protocol import RUNS, TERMINAL, Peer, accepted_from, for_worker, parse
    from genie_core.protocol import MessageType as T

    assert accepted_from(Peer.HEARTBEAT) == {T.PING}
    assert {T.EXECUTE, T.PUSH, T.PULL, T.TENSOR_OPS} == RUNS
    assert {t for t in T if t.value.endswith("_reply")} | {T.WELCOME, T.AUTH_FAILED, T.PONG} == TERMINAL
    assert parse("execute", Peer.CLIENT) is T.EXECUTE and parse("execute", Peer.HEARTBEAT) is None
    assert parse("welcome", Peer.CLIENT) is None and parse("welcome", Peer.SERVER) is T.WELCOME
    assert parse("ready", Peer.WORKER) is T.READY and parse("ready", Peer.CLIENT) is None
    assert (
        parse("event", Peer.WORKER) is None
        and parse("_on_event", Peer.CLIENT) is None
        and parse("", Peer.CLIENT) is None
    )
    assert {for_worker(t) for t in ("execute", "push", "pull", "tensor_ops", "interrupt")} == {
        T.EXECUTE,
        T.PUSH,
        T.PULL,
        T.TENSOR_OPS,
        T.INTERRUPT,
    }
    assert for_worker("info") is None and for_worker("close") is None and for_worker("nope") is None


def test_every_message_type_has_a_content_shape():
    """genie_core/protocol/contents.py gives each type in the table the shape of its content."""
    from genie_core.protocol import MessageType
    from genie_core.protocol.contents import CONTENT

    assert set(CONTENT) == set(MessageType)


def test_a_cell_interrupted_before_it_started_answers_an_error_and_a_reply():
    """The one constructor the server and the worker use: the same content either way."""
    from genie_core.protocol.contents import interrupted_before_start

    error, reply = interrupted_before_start()
    evalue = "interrupted before it started: the cell did not run"
    assert error == {"ename": "KeyboardInterrupt", "evalue": evalue, "traceback": [f"KeyboardInterrupt: {evalue}"]}
    assert reply == {"status": "error", "ename": "KeyboardInterrupt", "evalue": evalue, "ran": False}


def test_a_gpu_is_described_in_the_welcome_with_the_keys_clients_read():
    """`GPUInfo` is the one description of a GPU; the welcome carries index, name, uuid and total
    memory, leaving out what is unknown (a GPU asked for by index but not found)."""
    from genie_core.nodes import GPUInfo

    gpu = GPUInfo(0, uuid="GPU-x", name="Fake GPU (test)", memory_total=80 << 30, utilization=5.0)
    assert gpu.description() == {"index": 0, "name": "Fake GPU (test)", "uuid": "GPU-x", "memory_total": 80 << 30}
    assert GPUInfo(3, name="unknown").description() == {"index": 3, "name": "unknown"}
    assert GPUInfo.from_dict(gpu.description()) == GPUInfo(
        0, uuid="GPU-x", name="Fake GPU (test)", memory_total=80 << 30
    )


def test_errors_come_back_through_the_one_map():
    """Genie's own error names become their classes; a user's code's error stays a RemoteError
    whatever its name (a cell's own ProtocolError is not Genie's)."""
    from genie_core.errors import LimitExceeded, RemoteError
    from genie_core.protocol import error_from, remote_error

    limit = error_from({"ename": "LimitExceeded", "evalue": "too big"}, "remote op x failed: ")
    assert isinstance(limit, LimitExceeded) and str(limit) == "too big"
    op = error_from({"ename": "ValueError", "evalue": "bad"}, "remote op x failed: ")
    assert isinstance(op, RemoteError) and op.evalue == "remote op x failed: bad"
    cell = remote_error({"ename": "ProtocolError", "evalue": "urllib3's", "traceback": ["tb"]})
    assert type(cell) is RemoteError and cell.traceback == ["tb"]


def test_a_session_remembers_its_newest_requests_and_what_ending_it_stopped():
    """The record behind "did it run?": bounded, oldest forgotten first; ending the session
    marks what was still running as stopped and leaves what finished alone."""
    from genie_core.server.sessions import REMEMBERED, Session

    session = Session(b"identity", {}, -1)
    for i in range(REMEMBERED + 5):
        assert session.received(f"r{i}", "execute")
    assert not session.received(f"r{REMEMBERED + 4}", "execute")  # seen: runs at most once
    assert len(session.requests) == REMEMBERED
    assert session.outcome("r0") == {"state": "not received"} and session.outcome("r4") == {"state": "not received"}
    assert session.outcome("r5")["state"] == "running" and session.outcome(f"r{REMEMBERED + 4}")["state"] == "running"
    session.finished("r5", {"status": "ok"})
    session.finished("r6", {"ename": "ValueError", "evalue": "bad"})
    session.ended("closed by the client")
    assert session.outcome("r5")["state"] == "finished" and session.outcome("r5")["status"] == "ok"
    assert session.outcome("r6")["status"] == "error" and session.outcome("r6")["error"] == "ValueError: bad"
    stopped = session.outcome("r7")
    assert stopped["state"] == "stopped" and "closed by the client" in stopped["error"]


def test_sequence_numbers_must_rise_per_connection():
    from genie_core.protocol import Peer
    from genie_core.server.sessions import Session

    session = Session(b"control", {}, -1, heartbeat_identity=b"beat")
    assert (
        session.peer(b"control") is Peer.CLIENT
        and session.peer(b"beat") is Peer.HEARTBEAT
        and session.peer(b"x") is None
    )
    assert session.accept_seq(b"control", 0) and session.accept_seq(b"control", 5)
    assert not session.accept_seq(b"control", 5) and not session.accept_seq(b"control", 4)
    assert session.accept_seq(b"beat", 1)  # each connection counts on its own
