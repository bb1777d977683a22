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
