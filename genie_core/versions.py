"""What each side runs (Genie, protocol, Python, torch, CUDA) and whether a client and a server can
work together: a difference that breaks the protocol or pickling is an error, a smaller one a warning.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from . import torch_compat
from .protocol import PROTOCOL
from .version import __version__

PACKAGE = "genie-jupyter"  # what to install, on either side


def local_versions() -> dict[str, str | None]:
    """This process's versions; torch's are read without importing it (that takes seconds)."""
    return dict(_versions())


@functools.cache
def _versions() -> dict[str, str | None]:
    return {
        "genie": __version__,
        "protocol": PROTOCOL.decode(),
        "python": ".".join(map(str, sys.version_info[:3])),
        "torch": _torch_version(),
        "cuda": _torch_cuda(),
    }


def _torch_version() -> str | None:
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def _torch_cuda() -> str | None:
    """The CUDA that torch was built for (None for a CPU build, or without torch)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return getattr(getattr(torch, "version", None), "cuda", None)
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        text = (Path(next(iter(spec.submodule_search_locations))) / "version.py").read_text()
    except OSError:
        return None
    found = re.search(r"^cuda\b[^=\n]*=\s*['\"]([^'\"]+)['\"]", text, re.M)
    return found.group(1) if found else None


@dataclass
class Compatibility:
    """The verdict on two sides' versions: `errors` stop the connection, `warnings` are shown."""

    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def _minor(version: str | None) -> tuple[str, ...]:
    """'2.13.0+cpu' -> ('2', '13')."""
    return tuple(re.split(r"[.+]", version or "")[:2])


def compare(client: dict[str, str | None], server: dict[str, str | None], where: str) -> Compatibility:
    """Judge a client's versions against a server's (`where`: the server's address, for the messages)."""
    verdict = Compatibility()

    def both(name: str) -> str:
        mine, theirs = client.get(name) or "none", server.get(name) or "none"
        return f"this client has {name} {mine}, the server at {where} has {name} {theirs}"

    genie_server = server.get("genie") or "unknown"
    install = f"install the server's version here (pip install '{PACKAGE}=={genie_server}') or upgrade the server"
    if client.get("protocol") != server.get("protocol"):
        verdict.errors.append(
            f"protocol mismatch: this client speaks {client.get('protocol')} (Genie {client.get('genie')}), "
            f"the server at {where} speaks {server.get('protocol')} (Genie {genie_server}): {install}"
        )
    if _minor(client.get("python")) != _minor(server.get("python")):
        verdict.errors.append(
            f"Python mismatch: {both('python')}; functions and classes defined in the notebook travel as "
            f"bytecode, which only the same Python minor version can run: use Python "
            f"{'.'.join(_minor(server.get('python')))} here, or start the server with this kernel's Python"
        )
    if client.get("genie") != server.get("genie"):
        verdict.warnings.append(f"Genie versions differ: {both('genie')}; {install}")
    if client.get("torch") and server.get("torch") and _minor(client["torch"]) != _minor(server["torch"]):
        verdict.warnings.append(
            f"torch versions differ: {both('torch')}; remote tensors record this client's operators, which the "
            "server's torch may name differently"
        )
    for side, versions in (("this client", client), (f"the server at {where}", server)):
        torch_version = versions.get("torch")
        if torch_version and not torch_compat.is_supported(torch_version):
            verdict.warnings.append(
                f"{side} runs torch {torch_version}, outside the releases Genie is tested with "
                f"({torch_compat.SUPPORTED[0]} to {torch_compat.SUPPORTED[1]}): remote tensors may fail there"
            )
    if client.get("cuda") and server.get("cuda") and _minor(client["cuda"]) != _minor(server["cuda"]):
        verdict.warnings.append(f"CUDA builds differ: {both('cuda')}")
    return verdict
