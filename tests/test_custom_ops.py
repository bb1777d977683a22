"""Custom ops (`torch.library.custom_op`) on remote tensors. One defined in the notebook itself
(`__main__`), which the server cannot import, is sent there by value before its first use: its
kernels (the default one, and the one for the server's device type where there is one) run on the
server as a CUDA device would run them. Here a function is made a notebook's by its `__module__`."""

from __future__ import annotations

import pytest
import torch

from genie_core.errors import RemoteError
from genie_core.remote_tensor.connection import stream_for

DEV = "remote_accelerator:0"


def _in_notebook(fn):
    fn.__module__ = "__main__"
    return fn


@_in_notebook
def _scale(x):  # a helper of the notebook's, which a kernel calls: it goes by value too
    return x * 3


def test_a_custom_op_defined_in_the_notebook_runs_on_the_server(remote):
    @torch.library.custom_op("genie_test::scaled", mutates_args=())
    @_in_notebook
    def scaled(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return _scale(x) + y

    @scaled.register_fake
    def _(x, y):
        return torch.empty_like(x)

    @torch.library.custom_op("genie_test::bump", mutates_args=("x",))
    @_in_notebook
    def bump(x: torch.Tensor, by: float) -> None:
        x.add_(by)

    @torch.library.custom_op("genie_test::per_device", mutates_args=())
    @_in_notebook
    def per_device(x: torch.Tensor) -> torch.Tensor:
        return x + 1  # the default kernel

    @per_device.register_kernel("cpu")
    @_in_notebook
    def _(x):
        return x - 1  # the CPU's: the server of this suite runs on its CPU

    per_device.register_fake(lambda x: torch.empty_like(x))

    found = []
    for device in ("cpu", DEV):
        x, y = torch.arange(4.0, device=device), torch.ones(4, device=device)
        z = scaled(x, y)
        bump(z, 0.5)
        found.append([z.cpu(), per_device(z).cpu(), scaled(z, z).cpu()])
    for got, expected in zip(found[1], found[0], strict=True):
        assert torch.equal(got, expected)


def test_a_custom_op_whose_kernel_cannot_be_sent_says_so(remote):
    import threading

    lock = threading.Lock()

    @torch.library.custom_op("genie_test::locked", mutates_args=())
    @_in_notebook
    def locked(x: torch.Tensor) -> torch.Tensor:
        with lock:
            return x.clone()

    locked.register_fake(lambda x: torch.empty_like(x))
    with pytest.raises(RuntimeError, match="genie_test::locked: its kernels cannot be sent to the server"):
        locked(torch.ones(2, device=DEV))
    assert torch.equal((torch.ones(2, device=DEV) + 1).cpu(), torch.full((2,), 2.0))  # the session goes on


def test_a_custom_op_the_server_cannot_find_fails_naming_it(remote, monkeypatch):
    """Not sent (the client's copy of it is not the notebook's): the server's error names the op."""

    @torch.library.custom_op("genie_test::elsewhere", mutates_args=())
    def elsewhere(x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    elsewhere.register_fake(lambda x: torch.empty_like(x))
    monkeypatch.setattr(elsewhere._init_fn, "__module__", None)
    with pytest.raises(RemoteError, match=r"genie_test\.elsewhere"):
        elsewhere(torch.ones(2, device=DEV)).cpu()


def test_an_out_of_memory_on_the_server_is_torchs_out_of_memory_error(remote):
    """What the server device's allocator raises (here by a kernel that raises it) is caught as
    `torch.OutOfMemoryError` (`torch.cuda.OutOfMemoryError`), as code that shrinks a batch on OOM
    expects; the op and the server's message kept."""

    @torch.library.custom_op("genie_test::too_big", mutates_args=())
    @_in_notebook
    def too_big(x: torch.Tensor) -> torch.Tensor:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    too_big.register_fake(lambda x: torch.empty_like(x))
    with pytest.raises(torch.cuda.OutOfMemoryError, match=r"Tried to allocate 2\.00 GiB") as caught:
        too_big(torch.ones(2, device=DEV)).cpu()
    assert isinstance(caught.value, RemoteError) and "genie_test.too_big" in str(caught.value)
    assert torch.equal((torch.ones(2, device=DEV) + 1).cpu(), torch.full((2,), 2.0))


@_in_notebook
def _open_once(flag: str) -> bool:
    """Unpickled on the server with a kernel that needs it: fails the first time only."""
    import os

    if not os.path.exists(flag):
        open(flag, "w").close()
        raise RuntimeError("the server could not load this definition, this once")
    return True


class _Gate:
    def __init__(self, flag: str) -> None:
        self.flag = flag

    def __reduce__(self):
        return (_open_once, (self.flag,))


_Gate.__module__ = "__main__"


def test_a_definition_that_failed_on_the_server_goes_again(remote, tmp_path):
    """A definition the server could not load is sent again with the op's next use (not "no such
    op" from then on)."""
    gate = _Gate(str(tmp_path / "opened"))

    @torch.library.custom_op("genie_test::gated", mutates_args=())
    @_in_notebook
    def gated(x: torch.Tensor) -> torch.Tensor:
        return x * 7 if gate else x

    gated.register_fake(lambda x: torch.empty_like(x))
    x = torch.ones(2, device=DEV)
    with pytest.raises(RemoteError, match="could not load this definition, this once"):
        gated(x).cpu()
    assert gated(x).cpu().tolist() == [7.0, 7.0]


def test_an_op_that_returns_nothing_run_at_once_returns_none(remote):
    """One whose outputs the client cannot know (here its fake says so, as a data-dependent op's
    does) runs at once, one round trip; one that returns nothing then returns None, as on the CPU
    (an IndexError before)."""
    from torch._subclasses.fake_tensor import DynamicOutputShapeException

    @torch.library.custom_op("genie_test::doubled", mutates_args=("x",))
    @_in_notebook
    def doubled(x: torch.Tensor) -> None:
        x.mul_(2)

    @doubled.register_fake
    def _(x):
        raise DynamicOutputShapeException("doubled")

    for device in ("cpu", DEV):
        x = torch.arange(3.0, device=device)
        trips = stream_for(0).round_trips
        assert doubled(x) is None
        assert stream_for(0).round_trips - trips == (device == DEV)
        assert x.cpu().tolist() == [0.0, 2.0, 4.0]


def test_a_kernel_registered_after_first_use_runs_from_then_on(remote):
    """The definition goes again when the notebook's kernels change (not the first one forever)."""

    @torch.library.custom_op("genie_test::changing", mutates_args=())
    @_in_notebook
    def changing(x: torch.Tensor) -> torch.Tensor:
        return x + 1

    changing.register_fake(lambda x: torch.empty_like(x))
    x = torch.zeros(2, device=DEV)
    assert changing(x).cpu().tolist() == [1.0, 1.0]

    @changing.register_kernel("cpu")
    @_in_notebook
    def _(x):
        return x + 5

    assert changing(x).cpu().tolist() == [5.0, 5.0] == changing(torch.zeros(2)).tolist()


def test_a_definition_sent_inside_a_failed_capture_still_reaches_the_server(remote):
    ra = torch.remote_accelerator

    @torch.library.custom_op("genie_test::captured", mutates_args=())
    @_in_notebook
    def captured(x: torch.Tensor) -> torch.Tensor:
        return x * 4

    captured.register_fake(lambda x: torch.empty_like(x))
    x = torch.ones(2, device=DEV)
    with pytest.raises(RuntimeError, match="not permitted while a graph is being captured"), ra.graph(ra.CUDAGraph()):
        captured(x).sum().item()
    assert captured(x).cpu().tolist() == [4.0, 4.0]


def test_a_notebook_custom_op_in_a_graph_compiled_by_the_servers_inductor(remote):
    """The server's Inductor traces the op with its fake, sent with its kernels."""

    @torch.library.custom_op("genie_test::compiled", mutates_args=())
    @_in_notebook
    def compiled(x: torch.Tensor) -> torch.Tensor:
        return x.sin() * 2

    compiled.register_fake(lambda x: torch.empty_like(x))
    f = torch.compile(lambda t: compiled(t) + 1, backend="remote_accelerator")
    x = torch.arange(4.0)
    assert torch.allclose(f(x.to(DEV)).cpu(), x.sin() * 2 + 1)
