"""Configuration precedence (explicit, then GENIE_* variables, then defaults) and its errors."""

import os
import stat

import pytest

from genie_core.config import ClusterConfig, ConnectionInfo, parse_address
from genie_core.errors import ConfigError


def test_explicit_beats_environment_beats_default():
    env = {"GENIE_MASTER_PORT": "6000", "GENIE_TIMEOUT": "3.5", "GENIE_ENABLE_HEARTBEAT": "false"}
    assert ClusterConfig.resolve(environ=env).master_port == 6000
    assert ClusterConfig.resolve(environ=env, master_port=7000).master_port == 7000
    assert ClusterConfig.resolve(environ={}).master_port == 5555
    config = ClusterConfig.resolve(environ=env)
    assert config.timeout == 3.5 and config.enable_heartbeat is False


def test_gpus_from_environment():
    assert ClusterConfig.resolve(environ={"GENIE_GPUS": "0,2"}).gpus == [0, 2]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"master_port": 99999}, "invalid port 99999"),
        ({"backend": "carrier-pigeon"}, "unknown backend 'carrier-pigeon'"),
        ({"node_role": "boss"}, "unknown node_role"),
        ({"heartbeat_interval": 5.0, "heartbeat_timeout": 1.0}, "heartbeat"),
    ],
)
def test_bad_values_give_one_clear_error(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        ClusterConfig.resolve(environ={}, **kwargs)


def test_bad_environment_value_names_the_variable():
    with pytest.raises(ConfigError, match="GENIE_MASTER_PORT='abc'"):
        ClusterConfig.resolve(environ={"GENIE_MASTER_PORT": "abc"})


@pytest.mark.parametrize(
    "text, expected",
    [
        ("gpu-server", ("gpu-server", 5555)),
        ("gpu-server:6000", ("gpu-server", 6000)),
        ("genie://10.1.2.3:7000", ("10.1.2.3", 7000)),
        ("[::1]:6000", ("::1", 6000)),
    ],
)
def test_address_forms(text, expected):
    assert parse_address(text, 5555) == expected


@pytest.mark.parametrize("text", ["http://x:1", "host:port", "host:0", ""])
def test_bad_addresses(text):
    with pytest.raises(ConfigError):
        parse_address(text, 5555)


def test_connection_file_round_trip_is_private(tmp_path):
    info = ConnectionInfo("127.0.0.1", 1234, "tok", "node", 42, 1)
    path = info.write(tmp_path / "c.json")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert ConnectionInfo.read(path) == info


def test_unreadable_connection_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        ConnectionInfo.read(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not a Genie connection file"):
        ConnectionInfo.read(tmp_path / "bad.json")


def test_a_misspelled_setting_is_an_error_naming_the_nearest_one():
    """`init(tokn=...)` must not be dropped silently (the connection would then fail for
    another reason, far from the typo)."""
    import genie_core

    with pytest.raises(TypeError, match="'tokn': did you mean 'token'"):
        genie_core.init_sync("127.0.0.1:1", tokn="x")
    with pytest.raises(TypeError, match="unknown setting 'frobnicate'; the settings are master_addr"):
        ClusterConfig.resolve(frobnicate=1)
    assert not genie_core.is_initialized()
