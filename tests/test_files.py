"""`%genie_upload` / `%genie_download` against a real server: pieces over the data plane, SHA-256
checked end to end, and continued where they stopped after a lost connection."""

from __future__ import annotations

import hashlib
import os
import signal
import threading
from pathlib import Path

import numpy as np
import pytest
from conftest import run, start_server, stdout_of
from reliability import record
from test_kernel import execute, stdout

from genie_core.client import files as file_transfers
from genie_core.errors import RemoteError
from genie_core.protocol import MessageType


def pattern_file(path: Path, size: int) -> str:
    """A file of `size` bytes that differ from piece to piece; returns its SHA-256."""
    digest = hashlib.sha256()
    block = np.arange(1 << 20, dtype=np.uint32).view(np.uint8)[: 1 << 20]
    with open(path, "wb") as f:
        for i in range(0, size, len(block)):
            chunk = (block[: min(len(block), size - i)] + (i >> 20) % 251).astype(np.uint8).tobytes()
            f.write(chunk)
            digest.update(chunk)
    return digest.hexdigest()


def remote_sha(client, path: str) -> str:
    code = f"import hashlib\nprint(hashlib.sha256(open({path!r}, 'rb').read()).hexdigest())"
    return stdout_of(run(client, code)).strip()


@pytest.fixture
def small_pieces(monkeypatch):
    monkeypatch.setattr(file_transfers, "PIECE", 4 << 20)


def test_a_file_goes_up_and_comes_back_bit_exact_in_pieces(client, tmp_path, small_pieces):
    sha = pattern_file(tmp_path / "data.bin", (18 << 20) + 123)  # five pieces, the last one short
    seen: list[int] = []
    up = client.upload(tmp_path / "data.bin", "inputs/data.bin", progress=lambda done, total: seen.append(done))
    assert up.sha256 == sha and up.size == (18 << 20) + 123 and up.path.endswith("/inputs/data.bin")
    assert seen[-1] == up.size and seen == sorted(seen)
    assert remote_sha(client, "inputs/data.bin") == sha  # relative paths: the session directory
    down = client.download("inputs/data.bin", tmp_path / "back")
    assert down.sha256 == sha and hashlib.sha256((tmp_path / "back").read_bytes()).hexdigest() == sha
    assert not list(tmp_path.glob("*.genie-part"))


def test_empty_and_tiny_files(client, tmp_path):
    (tmp_path / "empty").write_bytes(b"")
    (tmp_path / "tiny.txt").write_text("hi")
    assert client.upload(tmp_path / "empty").size == 0
    assert client.upload(tmp_path / "tiny.txt").size == 2
    client.download("empty", tmp_path / "e2")
    client.download("tiny.txt", tmp_path / "t2")
    assert (tmp_path / "e2").read_bytes() == b"" and (tmp_path / "t2").read_text() == "hi"


def test_a_download_continues_a_part_file_and_restarts_a_wrong_one(client, tmp_path, small_pieces):
    sha = pattern_file(tmp_path / "src.bin", 12 << 20)
    client.upload(tmp_path / "src.bin")
    part = tmp_path / "copy.bin.genie-part"
    part.write_bytes((tmp_path / "src.bin").read_bytes()[: 5 << 20])  # an earlier download, cut
    assert client.download("src.bin", tmp_path / "copy.bin").resumed_from == 5 << 20
    assert hashlib.sha256((tmp_path / "copy.bin").read_bytes()).hexdigest() == sha
    part.write_bytes(b"x" * (3 << 20))  # a part of some other file
    again = client.download("src.bin", tmp_path / "copy.bin")
    assert again.resumed_from == 0 and again.sha256 == sha


def test_an_upload_whose_bytes_do_not_match_its_hash_is_not_kept(client):
    content = {"path": "bad.bin", "offset": 0, "sha256": "0" * 64}
    with pytest.raises(RemoteError, match="do not match the file's SHA-256"):
        client.transfers.send(MessageType.FILE_PUT, content, [b"some bytes"], timeout=10)
    assert stdout_of(run(client, "import os\nprint(sorted(f for f in os.listdir() if 'bad' in f))")) == "[]\n"


def test_missing_files_are_one_clear_error_each_way(client, tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file here"):
        client.upload(tmp_path / "nope.bin")
    with pytest.raises(RemoteError, match=r"FileNotFoundError: no file nope\.bin on the server"):
        client.download("nope.bin", tmp_path / "x")


def test_a_1_gib_upload_cut_mid_way_continues_where_it_stopped(tmp_path):
    """The server is paused (SIGSTOP) a third of the way in, long enough for the client to declare
    the connection lost; the upload waits, and once the server answers it goes on from the part."""
    size = 1 << 30
    sha = pattern_file(tmp_path / "big.bin", size)
    srv = start_server(tmp_path)
    client = srv.client(heartbeat_interval=0.2, heartbeat_timeout=1.0)
    paused = threading.Event()

    def cut(done: int, total: int) -> None:
        if done >= total // 3 and not paused.is_set():
            paused.set()
            os.kill(srv.proc.pid, signal.SIGSTOP)
            threading.Timer(3.0, os.kill, (srv.proc.pid, signal.SIGCONT)).start()

    try:
        result = client.upload(tmp_path / "big.bin", "big.bin", progress=cut)
        assert paused.is_set() and result.sha256 == sha
        assert size // 4 < result.resumed_from < size, result
        assert remote_sha(client, "big.bin") == sha
        record(
            "Files",
            "1 GiB upload, server paused 3 s a third of the way in",
            f"continued from byte {result.resumed_from:,}; {result.seconds:.1f} s in all; SHA-256 matched",
        )
    finally:
        os.kill(srv.proc.pid, signal.SIGCONT)
        client.close()
        srv.stop()


def test_the_magics_in_a_real_kernel(server, tmp_path):
    from jupyter_client.manager import start_new_kernel

    (tmp_path / "weights.txt").write_text("w" * 1000)
    km, kc = start_new_kernel(kernel_name="python3")
    try:
        execute(kc, "%load_ext genie_jupyter")
        execute(kc, f"%genie_init 127.0.0.1:{server.info.port} --token {server.info.token}")
        reply, msgs = execute(kc, f"%genie_upload {tmp_path / 'weights.txt'} ckpt/weights.txt")
        assert reply["status"] == "ok" and "uploaded " in stdout(msgs) and "1,000 bytes" in stdout(msgs), msgs
        reply, msgs = execute(kc, f"%genie_download ckpt/weights.txt {tmp_path / 'again.txt'}")
        assert reply["status"] == "ok" and (tmp_path / "again.txt").read_text() == "w" * 1000, msgs
        reply, msgs = execute(kc, "%genie_download no/such/file")
        errors = [m["content"] for _, m in msgs if m["msg_type"] == "error"]
        assert reply["status"] == "error" and "no file no/such/file on the server" in str(errors)
    finally:
        execute(kc, "%genie_shutdown")
        kc.stop_channels()
        km.shutdown_kernel(now=True)


@pytest.mark.parametrize("part", ["the start of this file", "the start of another file"])
def test_an_upload_continues_a_part_only_when_its_hash_matches(client, tmp_path, small_pieces, part):
    sha = pattern_file(tmp_path / "x.bin", 10 << 20)
    head = (tmp_path / "x.bin").read_bytes()[: 3 << 20]
    left_there = head if part == "the start of this file" else bytes(len(head))  # an earlier, cut upload
    client.transfers.send(MessageType.FILE_PUT, {"path": "x.bin", "offset": 0}, [left_there], timeout=10)
    result = client.upload(tmp_path / "x.bin")
    assert result.resumed_from == (3 << 20 if part == "the start of this file" else 0)
    assert result.sha256 == sha and remote_sha(client, "x.bin") == sha


def test_relative_paths_are_in_the_session_directory_whatever_a_cell_did(client, tmp_path):
    (tmp_path / "a.txt").write_text("here")
    client.upload(tmp_path / "a.txt", "a.txt")
    home = stdout_of(run(client, "import os\nprint(os.getcwd())")).strip()
    run(client, "import os, tempfile\nos.chdir(tempfile.gettempdir())")
    client.upload(tmp_path / "a.txt", "b.txt")
    assert stdout_of(run(client, f"print(sorted(os.listdir({home!r})))")) == "['a.txt', 'b.txt']\n"
