"""`genie serve --encrypt` (CurveZMQ + a ZAP handler) and the rules for listening beyond loopback.

A relay between client and server records every byte on the wire, so "encrypted" is checked
by what an eavesdropper would see, with the unencrypted server as the control."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch
import zmq
from conftest import run, start_server, stdout_of
from relay import Relay
from reliability import record

from genie_core.client import Client
from genie_core.errors import AuthenticationError, ConnectionFailed

SECRET = "launch-code-" + os.urandom(6).hex()


def _session_through_relay(srv) -> bytes:
    wire = bytearray()

    def keep(data: bytes, direction: str) -> bytes:  # an eavesdropper keeps a copy of every byte
        wire.extend(data)
        return data

    relay = Relay(srv.info.port, on_chunk=keep)
    try:
        client = Client("127.0.0.1", relay.port, srv.info.token, timeout=10, curve=srv.info.curve).connect()
        try:
            assert stdout_of(run(client, f"secret = {SECRET!r}; print(secret.upper())")) == SECRET.upper() + "\n"
            client.push({"small": SECRET * 3})  # under the data-plane threshold: travels on this connection
        finally:
            client.close()
        return bytes(wire)
    finally:
        relay.close()


def test_encrypted_traffic_shows_nothing_on_the_wire(tmp_path):
    plain_srv, enc_srv = start_server(tmp_path), start_server(tmp_path, "--encrypt")
    try:
        assert plain_srv.info.curve is None and set(enc_srv.info.curve) == {
            "server_public",
            "client_public",
            "client_secret",
        }
        plain_wire, enc_wire = _session_through_relay(plain_srv), _session_through_relay(enc_srv)
        # The control: without --encrypt an eavesdropper reads the code, the output and the data.
        assert SECRET.encode() in plain_wire and SECRET.upper().encode() in plain_wire
        assert len(enc_wire) > 1000
        for needle in (SECRET, SECRET.upper(), "execute", "stdout", "small"):
            assert needle.encode() not in enc_wire, needle
        record(
            "Who gets in",
            "eavesdropper on the wire (--encrypt)",
            f"{len(enc_wire):,} bytes captured, the secret code/output/data "
            f"found 0 times (same session unencrypted: {plain_wire.count(SECRET.encode())} times)",
        )
    finally:
        plain_srv.stop()
        enc_srv.stop()


def test_an_encrypted_server_refuses_clients_without_its_keys_during_the_handshake(tmp_path):
    srv = start_server(tmp_path, "--encrypt")
    try:
        start = time.monotonic()
        with pytest.raises(AuthenticationError, match=r"requires encryption.*--connection-file"):
            Client("127.0.0.1", srv.info.port, srv.info.token, timeout=10).connect()
        took = time.monotonic() - start
        assert took < 3  # said at once, not after the 10 s timeout
        record(
            "Who gets in",
            "client without the keys (--encrypt)",
            f"refused in the handshake, AuthenticationError after {took:.2f} s",
        )
        stranger = dict(srv.info.curve)
        stranger["client_public"], stranger["client_secret"] = (k.decode() for k in zmq.curve_keypair())
        with pytest.raises(AuthenticationError, match="refused this client's encryption key"):
            Client("127.0.0.1", srv.info.port, srv.info.token, timeout=10, curve=stranger).connect()
        impostor = dict(srv.info.curve, server_public=zmq.curve_keypair()[0].decode())  # a man in the middle's key
        with pytest.raises(ConnectionFailed, match="does not hold the key in the connection file"):
            Client("127.0.0.1", srv.info.port, srv.info.token, timeout=2, curve=impostor).connect()
        # Keys alone are not enough: the token still signs every message.
        with pytest.raises(AuthenticationError, match="token does not match"):
            Client("127.0.0.1", srv.info.port, "not-the-token", timeout=10, curve=srv.info.curve).connect()
        client = srv.client()
        assert stdout_of(run(client, "print('still serving')")) == "still serving\n"
        client.close()
    finally:
        srv.stop()


def test_data_stays_private_on_an_encrypted_server(tmp_path):
    srv = start_server(tmp_path, "--encrypt")
    try:
        client = srv.client()
        report = client.select_backend()
        by_name = {c.name: c for c in report.candidates}
        for name in ("tcp", "ucx"):
            assert not by_name[name].available and "encrypts" in by_name[name].reason
        assert report.chosen in ("shm", "zmq") and "CURVE" in by_name["zmq"].reason
        t = torch.randn(1 << 20)
        client.push({"t": t})
        assert torch.equal(client.pull(["t"])["t"], t)
        client.close()
    finally:
        srv.stop()


def _serve_in_namespace(*args: str) -> subprocess.CompletedProcess:
    """`genie serve` on every address of a fresh network namespace (nothing outside can reach it)."""
    ns = "genie-t" + os.urandom(2).hex()
    if os.geteuid() != 0 or subprocess.run(["ip", "netns", "add", ns], capture_output=True).returncode != 0:
        pytest.skip("cannot create a network namespace here (needs root and `ip netns`)")
    try:
        subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], check=True)
        return subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                ns,
                sys.executable,
                "-m",
                "genie_core",
                "serve",
                "--ip",
                "0.0.0.0",
                "--port",
                "0",
                *args,
            ],
            capture_output=True,
            text=True,
            timeout=20,
        )
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_listening_beyond_loopback_needs_a_real_token_and_warns_without_encryption(tmp_path):
    refused = _serve_in_namespace("--token", "hunter2")
    assert refused.returncode == 2
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and "refusing to listen on 0.0.0.0 with a 7-character token" in lines[0], refused.stderr
    script = (
        "import subprocess, sys, time, signal\n"
        "p = subprocess.Popen(\n"
        "    [sys.executable, '-m', 'genie_core', 'serve', '--ip', '0.0.0.0', '--port', '0', *sys.argv[1:]],\n"
        "    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)\n"
        "p.stdout.readline(); time.sleep(0.5); p.send_signal(signal.SIGTERM)\n"
        "out, err = p.communicate(timeout=10); print(err)\n"
    )
    env = dict(os.environ, GENIE_STATE_DIR=str(tmp_path / "state"), GENIE_RUNTIME_DIR=str(tmp_path / "rt"))
    for flags, warned in (((), True), (("--encrypt",), False)):
        ns = "genie-t" + os.urandom(2).hex()
        if subprocess.run(["ip", "netns", "add", ns], capture_output=True).returncode != 0:
            pytest.skip("cannot create a network namespace here")
        try:
            subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], check=True)
            out = subprocess.run(
                ["ip", "netns", "exec", ns, sys.executable, "-c", script, *flags],
                capture_output=True,
                text=True,
                timeout=30,
                env=env,
            )
        finally:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        assert ("WITHOUT ENCRYPTION" in out.stdout) is warned, out.stdout + out.stderr


def test_genie_status_reaches_an_encrypted_server_through_its_connection_file(tmp_path):
    srv = start_server(tmp_path, "--encrypt", "--max-session-tensors", "40", "--max-session-bytes", "2GiB")
    plain = start_server(tmp_path)
    try:
        env = dict(os.environ, COLUMNS="160")
        env.pop("GENIE_TOKEN", None)
        text = subprocess.run(
            [sys.executable, "-m", "genie_core", "status", "--connection-file", str(srv.connection_file)],
            capture_output=True,
            text=True,
            timeout=30,
            env=env,
        )
        assert text.returncode == 0, text.stderr
        assert "security  encrypted (CurveZMQ) and signed · per session: 40 remote tensors, 2.0 GiB" in text.stdout
        other = subprocess.run(
            [sys.executable, "-m", "genie_core", "status", "--connection-file", str(plain.connection_file)],
            capture_output=True,
            text=True,
            timeout=30,
            env=env,
        )
        assert "security  signed, not encrypted · per session: 1,000,000 remote tensors, no byte limit" in other.stdout
    finally:
        srv.stop()
        plain.stop()
