"""Checkpoints on the server's disk loaded straight into the session's tensors (the client's
`torch.remote_accelerator.load` and `from_pretrained`): a `torch.save` file, a safetensors file,
or a transformers model directory (its shards too). No byte of the weights crosses the network."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, treespec_dumps

MAX_TEXT = 16 << 20  # a text file read for the client (a model's config.json): bytes at most

# A transformers model directory's weights, in the order transformers itself looks for them
_WEIGHTS = ("model.safetensors.index.json", "model.safetensors", "pytorch_model.bin.index.json", "pytorch_model.bin")


def load(path: str, device: torch.device) -> tuple[list[Any], str]:
    """Load `path` onto `device`: its leaves (tensors and plain values) and its structure, as a
    pytree spec the client rebuilds it with."""
    leaves, spec = tree_flatten(_read(Path(path), device))
    return leaves, treespec_dumps(spec)


def read_text(path: str) -> str:
    """A small text file on the server (a model's config.json)."""
    with open(path, encoding="utf-8") as fh:
        text = fh.read(MAX_TEXT + 1)
    if len(text) > MAX_TEXT:
        raise ValueError(f"{path} is more than {MAX_TEXT} bytes: not a config file")
    return text


def _read(path: Path, device: torch.device) -> Any:
    if path.is_dir():
        return _directory(path, device)
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path} on the server")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path), device=str(device))
    if path.name.endswith(".index.json"):
        return _shards(path, device)
    return torch.load(path, map_location=device, weights_only=True)


def _directory(path: Path, device: torch.device) -> dict[str, Any]:
    for name in _WEIGHTS:
        if (path / name).exists():
            loaded = _read(path / name, device)
            if not isinstance(loaded, dict):
                raise ValueError(f"{path / name} holds a {type(loaded).__name__}, not a state dict")
            return loaded
    raise FileNotFoundError(f"no model weights in {path} on the server (looked for {', '.join(_WEIGHTS)})")


def _shards(index: Path, device: torch.device) -> dict[str, Any]:
    """A sharded checkpoint: its index names each tensor's shard."""
    weight_map = json.loads(index.read_text())["weight_map"]
    merged: dict[str, Any] = {}
    for shard in dict.fromkeys(weight_map.values()):
        merged.update(_read(index.parent / shard, device))
    return merged
