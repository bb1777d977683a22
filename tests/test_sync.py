"""`%genie_sync` against a real server: the notebook's own modules import in remote cells, edits
are re-imported, unchanged files are not sent again, .gitignore is honoured, and the server keeps
every file inside the session's directory."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from conftest import run, stdout_of
from jupyter_client.manager import KernelManager
from test_kernel import execute, stdout

from genie_core.errors import LimitExceeded, RemoteError
from genie_core.protocol import Message, MessageType


@pytest.fixture
def project(tmp_path):
    root = tmp_path / "project"
    (root / "pkg").mkdir(parents=True)
    (root / "mymodel.py").write_text("def answer():\n    return 1\n\nclass Net:\n    pass\n")
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "helpers.py").write_text("SCALE = 10\n")
    (root / "labels.csv").write_text("cat,dog\n")
    (root / "notes.ipynb").write_text("{}")
    return root


def edit(path: Path, text: str) -> None:
    """Rewrite a file so that its size or modification time differs, as an editor's save does."""
    before = path.stat().st_mtime_ns
    path.write_text(text)
    while path.stat().st_mtime_ns == before:
        time.sleep(0.01)
        path.write_text(text)


def test_synced_modules_import_remotely_and_unchanged_files_are_not_sent_again(client, project):
    first = client.sync(project)
    assert sorted(first.sent) == ["labels.csv", "mymodel.py", "pkg/__init__.py", "pkg/helpers.py"]
    code = "import mymodel, pkg.helpers\nprint(mymodel.answer() * pkg.helpers.SCALE, open('labels.csv').read().strip())"
    assert stdout_of(run(client, code)) == "10 cat,dog\n"
    again = client.sync(project)
    assert again.sent == [] and again.unchanged == 4 and again.bytes_sent == 0
    assert client.sync_if_changed() is None  # nothing changed: no round trip at all


def test_an_edited_module_is_re_imported_and_a_removed_file_removed(client, project):
    client.sync(project)
    assert stdout_of(run(client, "import mymodel\nprint(mymodel.answer())")) == "1\n"
    edit(project / "mymodel.py", "def answer():\n    return 2\n\nclass Net:\n    pass\n")
    (project / "labels.csv").unlink()
    report = client.sync_if_changed()
    assert report is not None and report.sent == ["mymodel.py"] and report.removed == 1 and report.unchanged == 2
    assert stdout_of(run(client, "import os\nprint(mymodel.answer(), os.path.exists('labels.csv'))")) == "2 False\n"


def test_gitignore_is_honoured_in_a_git_work_tree_and_outside_one(client, project):
    (project / ".gitignore").write_text("labels.csv\ncheckpoints/\n")
    (project / "checkpoints").mkdir()
    (project / "checkpoints" / "step1.py").write_text("x = 1\n")
    outside = client.sync(project)
    assert "labels.csv" not in outside.sent and not any(p.startswith("checkpoints") for p in outside.sent)
    if shutil.which("git") is None:
        pytest.skip("no git here")
    subprocess.run(["git", "init", "-q", str(project)], check=True)
    (project / "pkg" / ".gitignore").write_text("helpers.py\n")  # a nested rule: only git knows it
    inside = client.sync(project)
    assert sorted(inside.sent) == [] and inside.removed == 1  # pkg/helpers.py is now ignored, so it goes
    files = stdout_of(run(client, "import os\nprint(sorted(os.listdir('pkg')))"))
    assert files == "['__init__.py']\n"


def test_a_sync_over_the_cap_names_the_biggest_files(client, project):
    (project / "weights.bin").write_bytes(os.urandom(900 << 10))
    with pytest.raises(LimitExceeded, match=r"over the 512\.0 KiB cap.*weights\.bin \(900\.0 KiB\)"):
        client.sync(project, max_total=512 << 10)


@pytest.mark.parametrize("path", ["../escape.py", "/etc/escape.py", "pkg/../../escape.py", ".hidden.py", "a\\b.py"])
def test_the_server_writes_nothing_outside_the_session_directory(client, path):
    data = b"print('escaped')\n"
    msg = Message(MessageType.SYNC, {"manifest": {path: hashlib.sha256(data).hexdigest()}, "files": [path]}, [data])
    with pytest.raises(RemoteError, match="refused to sync"):
        client.request(msg).wait(10)


def test_content_that_does_not_match_its_hash_is_refused(client):
    msg = Message(MessageType.SYNC, {"manifest": {"a.py": "0" * 64}, "files": ["a.py"]}, [b"x = 1\n"])
    with pytest.raises(RemoteError, match="does not match its hash"):
        client.request(msg).wait(10)


def test_in_a_real_kernel_an_edit_between_two_cells_is_re_imported(server, project):
    km = KernelManager(kernel_name="python3")
    km.start_kernel(cwd=str(project))  # the notebook's directory
    kc = km.client()
    kc.start_channels()
    kc.wait_for_ready(timeout=60)
    try:
        execute(kc, "%load_ext genie_jupyter")
        execute(kc, f"%genie_init 127.0.0.1:{server.info.port} --token {server.info.token}")
        reply, msgs = execute(kc, "%genie_sync")
        assert reply["status"] == "ok" and "4 files sent" in stdout(msgs), msgs
        reply, msgs = execute(kc, "%%remote\nimport mymodel\nprint(mymodel.answer())")
        assert stdout(msgs) == "1\n", msgs
        edit(project / "mymodel.py", "def answer():\n    return 42\n\nclass Net:\n    pass\n")
        reply, msgs = execute(kc, "%%remote\nprint(mymodel.answer())")  # synced just before the cell ran
        assert stdout(msgs) == "42\n", msgs
        # A pushed object whose class lives in a notebook-local module; a notebook function travels by value.
        code = "from mymodel import Net\nnet = Net()\ndef double(x):\n    return 2 * x\n%genie_push net double"
        reply, msgs = execute(kc, code)
        assert reply["status"] == "ok", msgs
        reply, msgs = execute(kc, "%%remote\nprint(type(net).__module__, isinstance(net, mymodel.Net), double(21))")
        assert stdout(msgs) == "mymodel True 42\n", msgs
    finally:
        execute(kc, "%genie_shutdown")
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def test_names_and_contents_that_do_not_pair_up_are_refused(client):
    msg = Message(MessageType.SYNC, {"manifest": {"a.py": "0" * 64}, "files": ["a.py"]}, [])
    with pytest.raises(RemoteError, match="1 file names for 0 contents"):
        client.request(msg).wait(10)
