"""The torch releases Genie supports (genie_core/torch_compat.py): the remote device works the same
on each, and a client and a server on different releases either work together or say why not,
naming both. scripts/test-torch-range runs this file, with the remote-device suites, under the
oldest and the newest supported torch, and with client and server on different ones."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from genie_core import torch_compat
from genie_core.versions import compare

DEV = "remote_accelerator:0"


def test_the_supported_range_is_what_the_project_declares():
    from packaging.requirements import Requirement

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    (declared,) = [Requirement(d) for d in project["project"]["dependencies"] if re.match(r"torch\b", d)]
    (major, oldest), (_, newest) = map(torch_compat.release, torch_compat.SUPPORTED)
    assert {f"{major}.{oldest}.0", f"{major}.{newest}.0", f"{major}.{newest}.9"} <= set(
        declared.specifier.filter([f"{major}.{oldest}.0", f"{major}.{newest}.0", f"{major}.{newest}.9"])
    )
    assert not list(declared.specifier.filter([f"{major}.{oldest - 1}.9", f"{major}.{newest + 1}.0"]))
    assert torch_compat.is_supported(torch.__version__), "the tests run on a torch outside the declared range"
    assert torch_compat.release("2.11.0+cu130") == (2, 11) and not torch_compat.is_supported("2.10.1")


def test_a_torch_outside_the_range_is_a_warning_naming_it():
    server = {"genie": "0.1.0", "protocol": "genie/2", "python": "3.11.7", "torch": "2.13.0", "cuda": None}
    verdict = compare({**server, "torch": "2.9.1"}, server, "gpu:5555")
    assert not verdict.errors
    assert any("this client runs torch 2.9.1, outside the releases" in w for w in verdict.warnings), verdict
    assert not compare(server, server, "gpu:5555").warnings


def test_the_server_runs_the_torch_it_was_started_with(remote):
    """In the torch-range lane the server may run another venv's torch: the welcome says which."""
    from conftest import SERVER_PYTHON

    import genie_core

    asked = subprocess.run(
        [SERVER_PYTHON, "-c", "import importlib.metadata as m; print(m.version('torch'))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert genie_core.get_cluster_state().client.server_versions["torch"] == asked


def test_dynamos_fake_tensor_checks_take_a_remote_tensor(remote):
    """torch 2.11's `is_fake` and `maybe_get_fake_mode` fail on a wrapper with no inner tensors
    (torch_compat patches them); every supported release answers as 2.13 does."""
    from torch._subclasses.fake_tensor import is_fake, maybe_get_fake_mode

    x = torch.ones(3, device=DEV)
    assert is_fake(x) is False and maybe_get_fake_mode(x) is None
    compiled = torch.compile(lambda t: t * 2 + 1, backend="remote_accelerator", options={"compiler": "eager"})
    assert torch.equal(compiled(x).cpu(), torch.full((3,), 3.0))


def test_an_op_the_servers_torch_lacks_is_one_error_naming_its_release(remote):
    """An op recorded by this client's torch that the server's torch has not (a newer release's op)
    fails at the next value with one line naming the server's torch, and both releases where they
    differ; the session goes on."""
    import genie_core
    from genie_core.errors import RemoteError
    from genie_core.remote_tensor.connection import stream_for
    from genie_core.remote_tensor.tensor import RemoteTensor

    x = torch.ones(3, device=DEV)
    stream = stream_for(0)
    out = RemoteTensor((3,), (1,), 0, torch.float32, stream)
    stream.record(("op", "aten.an_op_of_a_later_torch.default", (x._ref,), None, (out._rid,), None))
    theirs = genie_core.get_cluster_state().client.server_versions["torch"]
    missing = rf"the server's torch {re.escape(theirs)}\S* has no op aten\.an_op_of_a_later"
    with pytest.raises(RemoteError, match=missing):
        out.cpu()
    mismatched = torch_compat.release(theirs) != torch_compat.release(torch.__version__)
    if mismatched:
        with pytest.raises(RemoteError, match=rf"this client runs torch {re.escape(torch.__version__)}, the server"):
            (out + 1).cpu()
    assert torch.equal((x + 1).cpu(), torch.full((3,), 2.0))


def test_cells_import_from_the_servers_environment_whatever_virtual_env_names(tmp_path):
    """IPython puts `$VIRTUAL_ENV`'s packages ahead of the running Python's: a server started from
    one venv in a shell that activated another ran its cells on that one's torch."""
    from conftest import run, start_server, stdout_of

    other = tmp_path / "other-venv"
    site = other / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    site.mkdir(parents=True)
    (site / "genie_only_in_the_other_venv.py").write_text("")
    srv = start_server(tmp_path, env={"VIRTUAL_ENV": str(other)})
    client = srv.client()
    try:
        code = "import importlib.util; print(importlib.util.find_spec('genie_only_in_the_other_venv') is None)"
        assert stdout_of(run(client, code)) == "True\n"
    finally:
        client.close()
        srv.stop()
