"""What differs between the torch releases Genie supports (SUPPORTED), in one place: each entry says
which releases need it and why, and is applied where the device registers (client) or ops run
(worker). Code elsewhere does not ask torch's version."""

from __future__ import annotations

import re
import types
from typing import Any

SUPPORTED = ("2.11", "2.15")  # the oldest and newest torch minor releases tested (pyproject.toml says the same)


def release(version: str) -> tuple[int, int]:
    """'2.11.0+cu130' -> (2, 11)."""
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None:
        raise ValueError(f"not a torch version: {version!r}")
    return int(found.group(1)), int(found.group(2))


def is_supported(version: str) -> bool:
    return release(SUPPORTED[0]) <= release(version) <= release(SUPPORTED[1])


def fake_tensors_take_plain_wrappers() -> None:
    """torch 2.11 (2.12 untried): Dynamo's `is_fake` raises "got mixed fake and real tensors!" and
    `maybe_get_fake_mode` an IndexError for a wrapper subclass with no inner tensors (a remote
    tensor holds none: its values are on the server), where 2.13 and later answer False and None.
    Each is made to answer as 2.13 does where it fails, found by trying it, not by version number."""
    from torch._subclasses import fake_tensor

    try:
        plain = _plain_wrapper()
    except Exception:  # cannot even try: leave torch as it is
        return
    for name, answer, code in (("is_fake", False, _is_fake), ("maybe_get_fake_mode", None, _maybe_get_fake_mode)):
        try:
            fails = getattr(fake_tensor, name)(plain) is not answer
        except (AssertionError, IndexError):
            fails = True
        if fails:
            _answer_for_plain_wrappers(fake_tensor, name, code)


def _answer_for_plain_wrappers(module: Any, name: str, code: Any) -> None:
    """`module.name` runs `code` (in the module's globals), which may call the original as
    `_genie_<name>`. The function object keeps its identity: Dynamo's modules import it by name."""
    function = getattr(module, name)
    original = f"_genie_{name}"
    if hasattr(module, original):
        return
    setattr(
        module,
        original,
        types.FunctionType(function.__code__, function.__globals__, name, function.__defaults__, function.__closure__),
    )
    function.__code__ = code.__code__


# The code `is_fake` and `maybe_get_fake_mode` run where they need it (torch 2.11), in fake_tensor's globals.
def _is_fake(x: Any) -> Any:
    if is_traceable_wrapper_subclass(x) and not type(x).__tensor_flatten__(x)[0]:  # type: ignore[name-defined]  # noqa: F821
        return False
    return _genie_is_fake(x)  # type: ignore[name-defined]  # noqa: F821


def _maybe_get_fake_mode(t: Any) -> Any:
    if is_traceable_wrapper_subclass(t) and not type(t).__tensor_flatten__(t)[0]:  # type: ignore[name-defined]  # noqa: F821
        return None
    return _genie_maybe_get_fake_mode(t)  # type: ignore[name-defined]  # noqa: F821


def _plain_wrapper() -> Any:
    """A wrapper subclass with no inner tensors, as a remote tensor is."""
    import torch

    class Plain(torch.Tensor):
        @staticmethod
        def __new__(cls) -> Any:
            return torch.Tensor._make_wrapper_subclass(cls, (1,), dtype=torch.float32, device=torch.device("meta"))

        def __tensor_flatten__(self) -> tuple[list[str], Any]:
            return [], None

        @staticmethod
        def __tensor_unflatten__(inner: Any, ctx: Any, size: Any, stride: Any) -> Any:
            raise NotImplementedError

        @classmethod
        def __torch_dispatch__(  # type: ignore[override]  # (torch declares it with the types it passes)
            cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            raise NotImplementedError

    return Plain()
