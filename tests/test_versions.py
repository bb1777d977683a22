"""Version checks at connect, against a real server: what breaks the protocol or pickling is a clear
error naming both sides' versions and what to install; a smaller difference is a warning."""

from __future__ import annotations

import importlib.metadata
import re
import sys
import time

import pytest
from conftest import plain, run, stdout_of
from jupyter_client.manager import start_new_kernel

import genie_core.protocol.codec as codec
from genie_core import __version__, versions
from genie_core.errors import VersionMismatch
from genie_core.protocol import PROTOCOL
from genie_core.versions import compare, local_versions


def pretend(monkeypatch, **changes: str) -> None:
    """This client claims other versions than it runs."""
    mine = {**local_versions(), **changes}
    monkeypatch.setattr(versions, "_versions", lambda: mine)


def test_the_welcome_carries_the_servers_versions(server):
    client = server.client()
    try:
        theirs = client.server_versions
        assert theirs["protocol"] == PROTOCOL.decode() and theirs["genie"] == __version__
        assert theirs["python"] == ".".join(map(str, sys.version_info[:3]))
        assert theirs["torch"] == importlib.metadata.version("torch") and client.version_warnings == []
    finally:
        client.close()


def test_a_client_of_another_protocol_is_told_at_once_which_to_install(server, monkeypatch):
    monkeypatch.setattr(codec, "PROTOCOL", b"genie/1")
    pretend(monkeypatch, protocol="genie/1", genie="0.0.9")
    start = time.monotonic()
    with pytest.raises(VersionMismatch) as err:
        server.client(timeout=10)
    took = time.monotonic() - start
    text = str(err.value)
    assert "genie/1 (Genie 0.0.9)" in text and f"{PROTOCOL.decode()} (Genie {__version__})" in text
    assert f"pip install 'genie-jupyter=={__version__}'" in text
    assert took < 5, f"answered only after {took:.1f} s: the server did not say its versions, the client timed out"


def test_another_python_minor_version_is_refused_and_leaves_no_session(server, monkeypatch):
    other = f"{sys.version_info[0]}.{sys.version_info[1] - 1}.4"
    pretend(monkeypatch, python=other)
    with pytest.raises(VersionMismatch, match=rf"this client has python {re.escape(other)}, the server .* has python"):
        server.client()
    monkeypatch.undo()
    watcher = server.client()
    try:
        sessions = watcher.info()["sessions"]
        assert [s["id"][:8] for s in sessions] == [watcher.session[:8]], sessions
    finally:
        watcher.close()


def test_a_mismatched_client_cannot_take_a_named_session_over(server, monkeypatch):
    """The server checks versions before it attaches: the session's client and its work go on."""
    owner = server.client(session_name="work")
    try:
        run(owner, "x = 'still here'")
        pretend(monkeypatch, python="2.7.18")
        with pytest.raises(VersionMismatch, match="Python mismatch"):
            server.client(session_name="work")
        monkeypatch.undo()
        assert stdout_of(run(owner, "print(x)")) == "still here\n"
    finally:
        owner.close()


def test_a_minor_difference_connects_with_a_warning(server, monkeypatch):
    pretend(monkeypatch, genie="0.1.1", torch="2.12.1")
    client = server.client()
    try:
        assert client.connected
        warned = " | ".join(client.version_warnings)
        assert "Genie versions differ: this client has genie 0.1.1" in warned
        assert "torch versions differ" in warned
    finally:
        client.close()


@pytest.mark.parametrize(
    ("field", "value", "fatal", "warned"),
    [
        ("protocol", "genie/3", True, False),
        ("python", "3.12.0", True, False),
        ("python", "3.11.0", False, False),  # a patch release pickles alike
        ("genie", "0.2.0", False, True),
        ("torch", "2.12.0", False, True),
        ("torch", "2.13.1", False, False),
        ("torch", None, False, False),  # a client without torch uses no remote tensors
        ("cuda", "12.1", False, True),
        ("cuda", None, False, False),  # a CPU build of torch on the client: nothing to compare
    ],
)
def test_what_is_fatal_and_what_is_a_warning(field, value, fatal, warned):
    server = {"genie": "0.1.0", "protocol": "genie/2", "python": "3.11.7", "torch": "2.13.0", "cuda": "12.4"}
    verdict = compare({**server, field: value}, server, "gpu:5555")
    assert (bool(verdict.errors), bool(verdict.warnings)) == (fatal, warned), verdict


def test_an_old_protocol_client_in_a_real_kernel_gets_one_clear_error(server):
    km, kc = start_new_kernel(kernel_name="python3")
    try:
        pretend_old = (
            "import genie_core.protocol.codec as c, genie_core.versions as v\n"
            "c.PROTOCOL = b'genie/1'\n"
            "base = v.local_versions()\n"
            "v._versions = lambda: {**base, 'protocol': 'genie/1', 'genie': '0.0.9'}\n"
            "%load_ext genie_jupyter"
        )
        assert kc.execute_interactive(pretend_old, timeout=60)["content"]["status"] == "ok"
        errors = []
        reply = kc.execute_interactive(
            f"%genie_init 127.0.0.1:{server.info.port} --token {server.info.token} --timeout 10",
            timeout=30,
            output_hook=lambda msg: errors.append(msg["content"]) if msg["msg_type"] == "error" else None,
        )
        assert reply["content"]["status"] == "error"
        shown = plain("\n".join(errors[0]["traceback"]))
        assert shown.startswith("VersionMismatch: protocol mismatch: this client speaks genie/1 (Genie 0.0.9)")
        assert f"genie-jupyter=={__version__}" in shown and len(shown.splitlines()) == 1  # one line, no plumbing
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
