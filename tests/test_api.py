"""The Python API: init / shutdown / is_initialized / get_cluster_state."""

import asyncio
import os

import psutil
import pytest
from conftest import run, stdout_of, wait_until

import genie_core
from genie_core.client import Client
from genie_core.errors import ConfigError, NotInitializedError


@pytest.fixture(autouse=True)
def _clean():
    yield
    genie_core.shutdown_sync()


def test_init_connects_and_reports_state(server):
    state = genie_core.init_sync(f"127.0.0.1:{server.info.port}", token=server.info.token, timeout=10)
    assert genie_core.is_initialized() and genie_core.get_cluster_state() is state
    assert state.connected and state.role == "client" and not state.embedded
    assert state.node["node_id"] == server.info.node_id
    assert [p["name"] for p in state.to_dict()["phases"]] == ["configure", "connect", "discovery"]
    assert stdout_of(run(state.client, "print(6 * 7)")) == "42\n"
    genie_core.shutdown_sync()
    assert not genie_core.is_initialized()
    with pytest.raises(NotInitializedError, match="genie_init"):
        genie_core.get_cluster_state()


def test_environment_supplies_what_arguments_omit(server, monkeypatch):
    monkeypatch.setenv("GENIE_MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("GENIE_MASTER_PORT", str(server.info.port))
    monkeypatch.setenv("GENIE_TOKEN", server.info.token)
    state = genie_core.init_sync(timeout=10)
    assert state.address == f"127.0.0.1:{server.info.port}"


def test_token_found_in_a_local_connection_file(server, monkeypatch):
    monkeypatch.delenv("GENIE_TOKEN", raising=False)
    # `genie serve` wrote its connection file; point the runtime folder at it.
    monkeypatch.setenv("GENIE_RUNTIME_DIR", str(server.connection_file.parent))
    os.replace(server.connection_file, server.connection_file.parent / f"genie-server-x-{server.info.port}.json")
    assert genie_core.init_sync(f"localhost:{server.info.port}", timeout=10).connected


def test_connection_file_argument(server, monkeypatch):
    monkeypatch.delenv("GENIE_TOKEN", raising=False)
    assert genie_core.init_sync(connection_file=str(server.connection_file), timeout=10).connected


def test_no_token_is_a_clear_error(server, monkeypatch):
    monkeypatch.delenv("GENIE_TOKEN", raising=False)
    with pytest.raises(ConfigError, match="no token"):
        genie_core.init_sync(f"127.0.0.1:{server.info.port}", timeout=5)


def test_init_again_replaces_the_old_connection(server):
    first = genie_core.init_sync(f"127.0.0.1:{server.info.port}", token=server.info.token, timeout=10)
    second = genie_core.init_sync(f"127.0.0.1:{server.info.port}", token=server.info.token, timeout=10)
    assert not first.client.connected and second.client.connected
    assert first.client.session != second.client.session


def test_awaitable_init_and_shutdown(server):
    """The seed's API: `await init(...)` and `await shutdown()`, the loop running meanwhile."""
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)  # once per turn of the loop

    async def main():
        beat = asyncio.create_task(ticker())
        state = await genie_core.init(f"127.0.0.1:{server.info.port}", token=server.info.token, timeout=10)
        assert state.connected and genie_core.is_initialized()
        before = ticks
        await genie_core.shutdown()
        beat.cancel()
        return state, ticks - before

    state, ticked = asyncio.run(main())
    assert not genie_core.is_initialized() and not state.client.connected
    assert ticked > 0  # the loop ran while the session closed (closing waits for the server's answer)


def test_init_and_client_say_what_they_take():
    """`init` shows init_sync's parameters (help, `init?`); a misspelt setting or connect option
    is an error naming it, not silently ignored."""
    import inspect

    from genie_core.client import ConnectOptions
    from genie_core.config import ClusterConfig

    taken = inspect.signature(genie_core.init).parameters
    assert {"master_addr", "connection_file", "on_phase", "on_wait"} <= set(taken)
    with pytest.raises(TypeError, match="unknown setting 'timout': did you mean 'timeout'"):
        genie_core.init_sync("127.0.0.1:1", timout=3)
    with pytest.raises(TypeError, match="heartbeat_timout"):
        Client("127.0.0.1", 1, "t", heartbeat_timout=2.0)
    config = ClusterConfig(timeout=7.0, heartbeat_timeout=3.0, session_name="nb", data_port=7001)
    made = ConnectOptions.of(config, curve={"server": "k"})
    assert (made.timeout, made.heartbeat_timeout, made.session_name, made.data_port) == (7.0, 3.0, "nb", 7001)
    assert Client("127.0.0.1", 1, "t", options=made, timeout=2.0).options == ConnectOptions(
        **{**made.__dict__, "timeout": 2.0}
    )


def test_embedded_local_server_starts_and_stops_with_us():
    state = genie_core.init_sync(timeout=30)
    assert state.embedded and state.connected and state.address.startswith("127.0.0.1:")
    pid = state.local_server.proc.pid
    assert stdout_of(run(state.client, "print('local')")) == "local\n"
    genie_core.shutdown_sync()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_server_role_serves_from_python():
    state = genie_core.init_sync(node_role="server", master_port=0, token="py-token")
    server = state.server
    client = Client("127.0.0.1", server.port, "py-token", timeout=10).connect()
    assert stdout_of(run(client, "print('served')")) == "served\n"
    client.close()
    genie_core.shutdown_sync()
    assert wait_until(lambda: not server.connection_file.exists(), 5)


def test_connecting_and_running_a_cell_never_import_torch(server):
    """torch takes seconds to import: a notebook that never touches remote tensors must not pay for
    it at %genie_init; the device registers once torch is imported."""
    import subprocess
    import sys

    code = (
        "import sys, genie_core\n"
        f"genie_core.init_sync('127.0.0.1:{server.info.port}', token='{server.info.token}', timeout=20)\n"
        "assert genie_core.get_cluster_state().client.execute('x = 1').wait(30).content['status'] == 'ok'\n"
        "print('torch' in sys.modules)\n"
        "genie_core.shutdown_sync()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr[-2000:]
