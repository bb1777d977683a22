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
