"""Message signing covers header, content and buffers; anything altered is refused."""

import pytest

from genie_core.errors import ProtocolError
from genie_core.protocol import Codec, Message, derive_key


def test_round_trip_keeps_content_and_buffers():
    codec = Codec(derive_key("secret"))
    msg = Message("execute", {"code": "x = 1"}, [b"\x00\x01raw", memoryview(bytearray(b"abc"))], parent="p", session="s", seq=7)
    out = codec.unpack(codec.pack(msg))
    assert (out.type, out.content, out.parent, out.session, out.seq, out.id) == ("execute", {"code": "x = 1"}, "p", "s", 7, msg.id)
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


@pytest.mark.parametrize(
    "frames",
    [[], [b"genie/2"], [b"nope/9", b"", b"{}", b"{}"], [b"genie/2", b"", b"not json", b"{}"], [b"genie/2", b"", b"[]", b"{}"]],
)
def test_malformed_messages_raise_protocol_error(frames):
    with pytest.raises(ProtocolError):
        Codec(None).unpack(frames)


def test_size_cap():
    codec = Codec(derive_key("k"), max_bytes=1000)
    with pytest.raises(ProtocolError, match="larger"):
        codec.unpack(codec.pack(Message("push", {}, [b"x" * 2000])))


def test_key_is_not_the_token():
    assert derive_key("secret") != b"secret" and len(derive_key("secret")) == 32


def test_a_large_buffer_altered_in_any_chunk_is_refused():
    """Buffers are signed by the digests of their 4 MiB chunks (hashed in parallel): flipping
    one byte in any chunk, or moving bytes between buffers, breaks the signature."""
    import os

    codec = Codec(os.urandom(32))
    data = bytearray(os.urandom(1024)) * (20 * 1024)  # 20 MiB: five chunks, hashed in parallel
    frames = codec.pack(Message("push", {}, [data, b"tail"]))
    assert bytes(codec.unpack(frames).buffers[0]) == bytes(data)
    for where in (0, (4 << 20) + 7, len(data) - 1):
        changed = bytearray(data)
        changed[where] ^= 1
        with pytest.raises(ProtocolError, match="bad signature"):
            codec.unpack([*frames[:4], changed, frames[5]])
    with pytest.raises(ProtocolError, match="bad signature"):  # same bytes, another split
        codec.unpack([*frames[:4], bytes(data) + b"t", b"ail"])


def test_values_the_client_did_not_ask_to_unpickle_are_refused():
    from genie_core.serialize import deserialize_namespace, serialize_namespace

    metas, buffers = serialize_namespace({"n": 3, "x": 2.5, "s": "ok", "none": None, "flag": True})
    assert all(m["kind"] == "plain" for m in metas) and buffers == []  # plain values travel as JSON
    assert deserialize_namespace(metas, buffers, allow_pickle=False) == {"n": 3, "x": 2.5, "s": "ok", "none": None, "flag": True}
    metas, buffers = serialize_namespace({"evil": {"a": 1}})
    assert metas[0]["kind"] == "pickle"
    with pytest.raises(ProtocolError, match="refused a pickled object for 'evil'"):
        deserialize_namespace(metas, buffers, allow_pickle=False)
    assert deserialize_namespace(metas, buffers) == {"evil": {"a": 1}}  # a pull the user asked for


def test_the_wire_format_is_fixed_known_answers():
    """genie/2 as documented in protocol/codec.py, computed here from scratch: the key is
    HMAC-SHA256(token, context); the signature is HMAC-SHA256 over each part's length (8 bytes,
    little-endian) and then the part itself (header, content) or the SHA-256 digests of its 4 MiB
    chunks (buffers). A change to any of it breaks every client and server of another version."""
    import hashlib
    import hmac

    key = derive_key("known-answer-token")
    assert key == hmac.new(b"known-answer-token", b"genie message signing v1", hashlib.sha256).digest()
    assert key.hex() == "0d9228c02d8fc77322ce7d5b536943131c38edebd536242618aee149a5803780"
    big = bytes(range(256)) * (9 * 4096)  # 9 MiB: chunks of 4, 4 and 1 MiB
    msg = Message("execute", {"code": "x = 1"}, [big, b"tail"], parent="p", session="s", seq=7,
                  id="0123456789abcdef01234567", time=1700000000.0)
    frames = Codec(key).pack(msg)
    header = b'{"id":"0123456789abcdef01234567","type":"execute","parent":"p","session":"s","seq":7,"time":1700000000.0}'
    assert bytes(frames[0]) == b"genie/2" and bytes(frames[2]) == header and bytes(frames[3]) == b'{"code":"x = 1"}'
    mac = hmac.new(key, digestmod=hashlib.sha256)
    for part in (header, b'{"code":"x = 1"}'):
        mac.update(len(part).to_bytes(8, "little") + part)
    for part in (big, b"tail"):
        digests = b"".join(hashlib.sha256(part[i : i + (4 << 20)]).digest() for i in range(0, len(part), 4 << 20))
        mac.update(len(part).to_bytes(8, "little") + digests)
    assert bytes(frames[1]) == mac.hexdigest().encode()
    assert bytes(frames[1]) == b"e9a2a60737bde8b00114b24c859c40c3534a3f82d2a5a7fab1bea25a7f888314"


def test_the_message_table_says_who_sends_what():
    """Spot checks of the one table every side reads (genie_core/protocol/messages.py)."""
    from genie_core.protocol import RUNS, TERMINAL, MessageType as T, Peer, accepted_from, for_worker, parse

    assert accepted_from(Peer.HEARTBEAT) == {T.PING}
    assert RUNS == {T.EXECUTE, T.PUSH, T.PULL, T.TENSOR_OPS}
    assert T.EXECUTE_REPLY in TERMINAL and T.ERROR_REPLY in TERMINAL and T.STREAM not in TERMINAL and T.EVENT not in TERMINAL
    assert parse("execute", Peer.CLIENT) is T.EXECUTE and parse("execute", Peer.HEARTBEAT) is None
    assert parse("welcome", Peer.CLIENT) is None and parse("welcome", Peer.SERVER) is T.WELCOME
    assert parse("ready", Peer.WORKER) is T.READY and parse("ready", Peer.CLIENT) is None
    assert parse("event", Peer.WORKER) is None and parse("_on_event", Peer.CLIENT) is None and parse("", Peer.CLIENT) is None
    assert {for_worker(t) for t in ("execute", "push", "pull", "tensor_ops", "interrupt")} == {
        T.EXECUTE, T.PUSH, T.PULL, T.TENSOR_OPS, T.INTERRUPT}
    assert for_worker("info") is None and for_worker("close") is None and for_worker("nope") is None
